"""Decoding vLLM's payloads: produced by vLLM's own classes (map dialect) and checked-in
vectors of the older array dialect."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_kv_batch,
    encode,
)

vllm_events = pytest.importorskip("vllm.distributed.kv_events")


def vllm_batch() -> object:
    v = vllm_events
    return v.KVEventBatch(
        ts=1700000000.25,
        events=[
            v.BlockStored(
                block_hashes=[2**64 - 1, 12345],
                parent_block_hash=2**63 + 7,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=3,
                medium="CPU",
                lora_name="sql-adapter",
                extra_keys=[("sql-adapter", "salt"), None],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=None,
                locality="LOCAL",
                ownership="tier2",
                session_id="s-1",
            ),
            v.BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=None,
                token_ids=[1] * 32,
                block_size=32,
                lora_id=None,
                medium=None,
                lora_name=None,
            ),
            v.BlockRemoved(block_hashes=[12345], medium="GPU", group_idx=1),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )


def test_decodes_vllm_map_dialect_field_for_field() -> None:
    payload = msgspec.msgpack.Encoder().encode(vllm_batch())  # vLLM's publisher encoder
    batch, skipped = decode_kv_batch(payload)
    assert skipped == 0
    assert batch.ts == 1700000000.25 and batch.data_parallel_rank == 2
    stored, stored_bytes, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2**64 - 1, 12345] and stored.parent_block_hash == 2**63 + 7
    assert stored.token_ids == list(range(64)) and stored.block_size == 32
    assert (stored.lora_id, stored.medium, stored.lora_name) == (3, "CPU", "sql-adapter")
    assert stored.extra_keys == [("sql-adapter", "salt"), None] and stored.group_idx == 1
    assert stored.kv_cache_spec_kind == "full_attention"
    assert (stored.locality, stored.ownership, stored.session_id) == ("LOCAL", "tier2", "s-1")
    assert isinstance(stored_bytes, BlockStored) and stored_bytes.block_hashes == [b"\x01" * 32]
    assert stored_bytes.medium is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [12345]
    assert removed.group_idx == 1
    assert isinstance(cleared, AllBlocksCleared)


def test_our_encoding_is_vllms() -> None:
    payload = msgspec.msgpack.Encoder().encode(vllm_batch())
    batch, _ = decode_kv_batch(payload)
    # The same msgpack value, field for field. Not always the same bytes: with 0.33's
    # lookahead_token_ids a BlockStored may have more than 15 fields, and msgspec then
    # writes a map16 header (as vLLM 0.33 does) where 0.32's writes a fixmap.
    assert msgspec.msgpack.decode(encode(batch)) == msgspec.msgpack.decode(payload)


def test_decodes_real_engine_scheduler_output() -> None:
    """Events taken from vLLM's own block pool (the objects its scheduler publishes)."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(
        num_gpu_blocks=8, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True
    )
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    events = pool.take_events()
    payload = msgspec.msgpack.Encoder().encode(vllm_events.KVEventBatch(ts=1.0, events=events))
    batch, skipped = decode_kv_batch(payload)
    assert skipped == 0 and len(batch.events) == len(events)
    assert [type(e).__name__ for e in batch.events] == [type(e).__name__ for e in events]


VECTORS = [
    line.split("\t")
    for line in (Path(__file__).parent / "data" / "vllm_array_events.msgpack.hex")
    .read_text()
    .splitlines()
]


@pytest.mark.parametrize(("schema", "hex_payload"), VECTORS, ids=[v[0] for v in VECTORS])
def test_decodes_older_array_dialect(schema: str, hex_payload: str) -> None:
    batch, skipped = decode_kv_batch(bytes.fromhex(hex_payload))
    assert skipped == 0 and batch.ts == 1700000000.5 and batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2**64 - 5, 17] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.lora_id == 7 and stored.medium == "GPU"
    if "lora_name" in schema or "extra_keys" in schema:
        assert stored.lora_name == "adapter-a"
    if "extra_keys" in schema:
        assert stored.extra_keys == [("adapter-a",), None] and stored.group_idx == 0
        assert stored.kv_cache_spec_kind == "full_attention"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [17]
    assert removed.medium == "CPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_unknown_event_type_is_skipped_and_the_rest_kept() -> None:
    good = BlockStored([1], None, [5] * 16, 16, None, "GPU", None)
    raw = msgspec.msgpack.encode(
        [
            1.0,
            [
                msgspec.to_builtins(good),
                {"type": "BlockMoved", "block_hashes": [1]},
                ["BlockRemoved", [1], "GPU"],
            ],
            0,
        ]
    )
    batch, skipped = decode_kv_batch(raw)
    assert skipped == 1
    assert batch.events == [good, BlockRemoved([1], "GPU")]


def test_unknown_fields_are_ignored() -> None:
    raw = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [9],
                    "medium": "GPU",
                    "from_the_future": {"x": 1},
                }
            ],
        ]
    )
    batch, skipped = decode_kv_batch(raw)
    assert skipped == 0 and batch.events == [BlockRemoved([9], "GPU")]


def test_not_a_batch_raises() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_kv_batch(b"\xc1garbage")
    with pytest.raises(msgspec.ValidationError):
        decode_kv_batch(msgspec.msgpack.encode({"not": "a batch"}))


def test_round_trip_of_our_own_batch() -> None:
    batch = KVEventBatch(2.0, [AllBlocksCleared()], None)
    assert decode_kv_batch(encode(batch)) == (batch, 0)
