"""PrefixIndex logic on hand-made event streams (real engine streams: test_vllm_events)."""

from __future__ import annotations

import time

from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, Kind, KVEventBatch, Message
from kvbus.index import PrefixIndex
from kvbus.subscribe import Resync, ResyncReason

B = 4  # block size


def stored(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    medium: str | None = "GPU",
    lora: str | None = None,
    kind: str | None = None,
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, B, None, medium, lora, kv_cache_spec_kind=kind)


def message(source: str, *events: object) -> Message:
    batch = KVEventBatch(time.time(), list(events))  # type: ignore[arg-type]
    return Message(source, 1, 1, Kind.KV, 0.0, batch, b"", 0)


PROMPT = list(range(100, 116))  # 4 blocks


def test_chained_prefix_across_events_and_workers() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8])))
    index.apply(message("a", stored([3], PROMPT[8:12], parent=2)))
    index.apply(message("b", stored([71], PROMPT[:4])))  # other engine hashes, same tokens
    assert index.match([*PROMPT, 1, 2]) == {"a": 12, "b": 4}
    assert index.match([5, *PROMPT[1:]]) == {}  # a different first block matches nothing
    assert len(index) == 3


def test_eviction_clear_and_resync_touch_only_that_worker() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2, 3], PROMPT[:12])))
    index.apply(message("b", stored([9, 8], PROMPT[:8])))
    index.apply(message("a", BlockRemoved([2], "GPU")))
    assert index.match(PROMPT) == {"a": 4, "b": 8}
    index.apply(message("b", AllBlocksCleared()))
    assert index.match(PROMPT) == {"a": 4}
    index.apply(Resync("a", 2, ResyncReason.NEW_EPOCH, None, 1))
    assert index.match(PROMPT) == {} and len(index) == 0


def test_lora_and_extra_keys_separate_prefixes() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8], lora="sql")))
    assert index.match(PROMPT) == {}
    assert index.match(PROMPT, lora_name="sql") == {"a": 8}


def test_media_are_tracked_and_weighted() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8], medium="GPU")))
    index.apply(message("a", stored([1, 2], PROMPT[:8], medium="CPU")))
    index.apply(message("a", BlockRemoved([2], "GPU")))  # block 2 now only offloaded
    assert index.match(PROMPT) == {"a": 8}
    assert index.match_weighted(PROMPT) == {"a": 1.5}  # GPU block + CPU-only block
    index.apply(message("a", BlockRemoved([2], "CPU")))
    assert index.match(PROMPT) == {"a": 4}
    assert index.match_weighted(PROMPT) == {"a": 1.0}


def test_only_full_attention_groups_count() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([1], PROMPT[:4], kind="sliding_window")))
    index.apply(message("b", stored([1], PROMPT[:4], kind="full_attention")))
    assert index.match(PROMPT) == {"b": 4}


def test_unknown_parent_is_skipped_not_guessed() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([5], PROMPT[4:8], parent=4)))  # joined mid-stream
    assert index.unchained == 1 and len(index) == 0
