"""Writes vllm_array_events.msgpack.hex: KVEventBatch payloads in the pre-0.26 vLLM
dialect (events as tagged arrays), one per historical BlockStored schema.

The structs below restate vLLM's event classes as they stood before vLLM PR #42892
(array_like=True, tag=True), with the fields each release had: lora_id (#16750),
medium (#19737), lora_name (#27577), extra_keys (#33304), group_idx (#37688),
kv_cache_spec_kind/_sliding_window (#40984). Run it to regenerate the vectors; the
test suite only reads the checked-in file.
"""

from pathlib import Path
from typing import Any

import msgspec


def schema(extra_fields: list[tuple[str, Any, Any]]) -> tuple[type, type, type, type]:
    class Base(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    stored_fields = [
        ("block_hashes", list[int | bytes]),
        ("parent_block_hash", int | bytes | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
    ]
    stored = msgspec.defstruct("BlockStored", stored_fields + extra_fields, bases=(Base,))
    removed = msgspec.defstruct(
        "BlockRemoved", [("block_hashes", list[int | bytes]), ("medium", str | None)], bases=(Base,)
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(Base,))
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
        array_like=True,
        omit_defaults=True,
        gc=False,
    )
    return stored, removed, cleared, batch


REQUIRED = msgspec.NODEFAULT
SCHEMAS = {
    "v0.9 (medium)": [("medium", str | None)],
    "v0.11 (lora_name)": [("medium", str | None), ("lora_name", str | None)],
    "v0.22 (extra_keys, group_idx, spec kind)": [
        ("medium", str | None),
        ("lora_name", str | None),
        ("extra_keys", list[tuple[Any, ...] | None] | None, None),
        ("group_idx", int | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
    ],
}

if __name__ == "__main__":
    lines = []
    for name, fields in SCHEMAS.items():
        stored, removed, cleared, batch = schema(fields)
        extra = {}
        if "lora_name" in [f[0] for f in fields]:
            extra["lora_name"] = "adapter-a"
        if "group_idx" in [f[0] for f in fields]:
            extra.update(
                extra_keys=[("adapter-a",), None], group_idx=0, kv_cache_spec_kind="full_attention"
            )
        events = [
            stored(
                block_hashes=[2**64 - 5, 17],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=7,
                medium="GPU",
                **extra,
            ),
            removed(block_hashes=[17], medium="CPU"),
            cleared(),
        ]
        payload = msgspec.msgpack.encode(batch(1700000000.5, events, 1))
        lines.append(f"{name}\t{payload.hex()}")
    Path(__file__).with_name("vllm_array_events.msgpack.hex").write_text("\n".join(lines) + "\n")
