"""Issue 28, the index's slice: what one message (or one source) can do to a consumer's
decoding and to its `PrefixIndex`: quadratic maps, a fleet-wide lookahead or block size,
unbounded blocks, a store that fails half-way."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

import kvbus.routing.index
import kvbus.routing.index_feed
import kvbus.routing.index_keys
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, Kind, KVEventBatch, Message
from kvbus.routing.index import PrefixIndex
from kvbus.routing.router import Router
from kvbus.wire.events import LoadMetrics, decode_kv_batch, decode_raw, encode

B = 4
PROMPT = list(range(100, 116))  # 4 blocks of B


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, block_size: int = B
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block_size, None, "GPU", None)


def message(source: str, *events: object) -> Message:
    batch = KVEventBatch(time.time(), list(events))  # type: ignore[arg-type]
    return Message(source, 1, 1, Kind.KV, 0.0, batch, b"", 0)


# --- 1. maps keyed by arrays --------------------------------------------------------------


def map_keyed_by_int_pairs(entries: int) -> bytes:
    """A msgpack map of ``entries`` keys ``[i, -1]``: untyped, each key is a tuple of
    ints, whose hashes an attacker can make all equal (then building the dict is
    quadratic)."""
    body = b"".join(msgspec.msgpack.encode([i, -1]) + b"\x01" for i in range(entries))
    return b"\xdf" + entries.to_bytes(4, "big") + body


HOSTILE_MAP = map_keyed_by_int_pairs(48_000)  # 280 KiB


def test_a_map_keyed_by_arrays_of_ints_is_refused_at_its_first_key() -> None:
    """Decoded untyped, such a map cost O(n^2) with colliding keys (280 KiB: 3.5 s on
    the loop). Connector stats (and ``kvbus tail``'s JSON) now refuse it as malformed
    at its first key, before any dict is built."""
    assert len(HOSTILE_MAP) >= 280 * 1024
    with pytest.raises(msgspec.ValidationError, match=r"at `key\[0\]` in `\$`"):
        decode_raw(HOSTILE_MAP)
    nested = msgspec.msgpack.encode({"data": msgspec.Raw(HOSTILE_MAP)})
    with pytest.raises(msgspec.ValidationError, match=r"key\[0\]"):
        decode_raw(nested)


def test_vllm_offloading_stats_still_decode_with_label_tuple_keys() -> None:
    stats = {
        "types": {"vllm:kv_offload_load_bytes": "counter"},
        "data": {"vllm:kv_offload_load_bytes": {("CPU_to_GPU",): 100, (): 5}},
        "num_bytes": [1, 2.5],
        7: None,
    }
    assert decode_raw(msgspec.msgpack.encode(stats)) == stats


def test_a_map_in_extra_keys_skips_that_event_alone() -> None:
    """``BlockStored.extra_keys`` admitted any value, so the same map cost O(n^2) in the
    router, the compactor, ``top`` and ``tail``. vLLM sends atoms and arrays there
    (LoRA names, cache salts, (mm hash, offset) pairs, prompt-embeds digests): those
    decode; a map is a malformed event, counted and skipped, the batch's others kept."""
    good = stored([1], PROMPT[:B])
    good.extra_keys = [("adapter", ("mm-hash", 0), b"\x00digest", "salt")]
    plain = stored([2], PROMPT[B : 2 * B], parent=1)
    event = msgspec.msgpack.encode(stored([3], PROMPT[:B]))
    hostile_entry = msgspec.msgpack.encode([msgspec.Raw(HOSTILE_MAP)])
    # The same store with its extra keys one entry holding the map.
    hostile = msgspec.msgpack.decode(event)
    hostile["extra_keys"] = [msgspec.Raw(hostile_entry)]
    payload = msgspec.msgpack.encode(
        [1.0, [msgspec.Raw(encode(good)), msgspec.Raw(msgspec.msgpack.encode(hostile)), plain]]
    )
    batch, skipped = decode_kv_batch(payload)
    assert skipped == 1
    assert batch.events == [good, plain]
    assert batch.events[0].extra_keys == [("adapter", ("mm-hash", 0), b"\x00digest", "salt")]


def test_extra_keys_of_the_older_array_dialect_decode_too() -> None:
    old = ["BlockStored", [1], None, PROMPT[:B], B, None, "GPU", None, [["a", b"d", ["m", 1]]]]
    batch, skipped = decode_kv_batch(msgspec.msgpack.encode([1.0, [old]]))
    assert skipped == 0 and batch.events[0].extra_keys == [("a", b"d", ("m", 1))]


# --- 2. lookahead per worker --------------------------------------------------------------


def with_lookahead(event: BlockStored, ahead: int) -> BlockStored:
    """``event`` (blocks of PROMPT from its start) from an engine hashing ``ahead``
    tokens past each block."""
    blocks = range(len(event.block_hashes))
    event.lookahead_token_ids = [PROMPT[(i + 1) * B : (i + 1) * B + ahead] for i in blocks]
    return event


def test_one_workers_lookahead_does_not_blind_the_fleet() -> None:
    """The index kept one learned lookahead: one event carrying lookahead tokens keyed
    every later prompt with them, and no other worker matched again (a restarted
    router replaying that event stayed blind). Each worker now keys with its own."""
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2, 3, 4], PROMPT)))
    index.apply(message("b", stored([5, 6, 7, 8], PROMPT)))
    index.apply(message("odd", with_lookahead(stored([9, 10], PROMPT[: 2 * B]), 2)))
    assert index.lookahead == 0  # the fleet's: two workers against one
    assert index.match(PROMPT) == {"a": 16, "b": 16, "odd": 8}
    assert index.match_keys(index.keys(PROMPT)) == {"a": 16, "b": 16}
    # A fleet that hashes ahead is keyed ahead, and a plain worker still matches.
    index.clear("a")
    index.clear("b")
    index.apply(message("c", with_lookahead(stored([11, 12], PROMPT[: 2 * B]), 2)))
    assert index.lookahead == 2
    assert index.match(PROMPT) == {"odd": 8, "c": 8}
    index.apply(message("a", stored([1, 2, 3, 4], PROMPT)))
    assert index.match(PROMPT)["a"] == 16


# --- 3. block size per worker ---------------------------------------------------------------


def test_one_workers_block_size_does_not_poison_the_others() -> None:
    """Without ``--block-size``, the first event fixed the block size for all: a first
    event of block size 1 left every other worker's events skipped. Each worker now
    has its own; prompts are keyed with the one most workers use."""
    index = PrefixIndex()
    index.apply(message("odd", stored([1, 2, 3], PROMPT[:3], block_size=1)))
    index.apply(message("a", stored([11, 12, 13, 14], PROMPT)))
    index.apply(message("b", stored([21, 22], PROMPT[: 2 * B])))
    assert index.block_size == B
    assert index.profiles() == {(1, 0): 1, (B, 0): 2}
    assert index.match(PROMPT) == {"odd": 3, "a": 16, "b": 8}
    assert index.match_keys(index.keys(PROMPT)) == {"a": 16, "b": 8}
    index.apply(message("odd", stored([4], PROMPT[:B], block_size=B)))  # not its size
    assert index.other_block_size == 1 and index.match(PROMPT)["odd"] == 3


def test_a_configured_block_size_is_every_workers() -> None:
    index = PrefixIndex(B)
    index.apply(message("odd", stored([1, 2, 3], PROMPT[:3], block_size=1)))
    index.apply(message("a", stored([11, 12], PROMPT[: 2 * B])))
    assert index.other_block_size == 3 and index.match(PROMPT) == {"a": 8}


def test_profiles_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query keys the prompt once per (block size, lookahead) in use: past
    `MAX_PROFILES` a worker bringing another one is skipped, counted."""
    monkeypatch.setattr(kvbus.routing.index_keys, "MAX_PROFILES", 3)
    index = PrefixIndex()
    for size in range(1, 6):
        index.apply(message(f"w{size}", stored([size], PROMPT[:size], block_size=size)))
    assert len(index.profiles()) == 3 and index.profile_refused == 2
    index.clear("w1")
    index.apply(message("w5", stored([5], PROMPT[:5], block_size=5)))
    assert index.match(PROMPT)["w5"] == 5


# --- 4. blocks per worker ------------------------------------------------------------------


def a_long_chain(index: PrefixIndex, worker: str, blocks: int, first_hash: int = 1) -> None:
    parent = None
    for start in range(0, blocks, 100):
        hashes = list(range(first_hash + start, first_hash + start + 100))
        tokens = [t % 50_000 for t in range(start * B, (start + 100) * B)]
        index.apply(message(worker, stored(hashes, tokens, parent)))
        parent = hashes[-1]


def held_keys(index: PrefixIndex) -> int:
    return len({k for w in index._workers.values() for k in w.held})


def test_blocks_one_worker_makes_the_index_hold_are_capped() -> None:
    """An engine of 1,000 blocks could claim a million (195 MiB of router index). Past
    its cap a worker's oldest blocks are forgotten (counted): its newest still match,
    the other workers are untouched, the index stays consistent."""
    index = PrefixIndex(B, max_blocks_per_worker=1000)
    index.apply(message("a", stored([1, 2, 3, 4], PROMPT)))
    a_long_chain(index, "big", 5000, first_hash=1000)
    big = index._workers["big"]
    assert len(big.held) <= 1000 and index.over_cap == 5000 - len(big.held)
    assert big.resident == len(big.held) and len(index) == held_keys(index)
    assert index.match(PROMPT) == {"a": 16}
    assert index.holds("big", big.keys[5999])  # the newest block is still held
    # A forgotten block's removal is an unknown one; nothing else changes.
    index.apply(message("big", BlockRemoved([1000, 1001], "GPU")))
    assert index.unknown_removals == 2 and index.match(PROMPT) == {"a": 16}


def test_an_advertised_capacity_caps_the_workers_gpu_blocks() -> None:
    index = PrefixIndex(B)
    load = LoadMetrics(ts=0.0, running=0, waiting=0, kv_cache_usage=0.0, kv_cache_blocks=100)
    index.apply(Message("big", 1, 1, Kind.METRICS, 0.0, load, encode(load), 0))
    a_long_chain(index, "big", 10_000)
    limit = 100 * kvbus.routing.index.CAPACITY_HEADROOM + 1024
    assert index.resident("big") <= limit and index.over_cap >= 10_000 - limit
    assert len(index) == held_keys(index)


def test_a_routers_load_records_cap_the_index_by_the_engines_capacity() -> None:
    """The router reads load from the metrics stream, not the index: it hands the
    advertised capacity on, so a source claiming more blocks than its engine holds is
    capped in the router's index too (clamped first: 2**62 blocks would cap nothing)."""
    router = Router(block_size=B)
    for blocks in (100, 2**62):
        name = f"engine-{blocks}"
        load = LoadMetrics(ts=0.0, running=0, waiting=0, kv_cache_usage=0.0, kv_cache_blocks=blocks)
        router.apply_metrics(Message(name, 1, 1, Kind.METRICS, 0.0, load, encode(load), 0))
        a_long_chain(router.index, name, 5_000)
    assert router.index.resident("engine-100") <= 100 * kvbus.routing.index.CAPACITY_HEADROOM + 1024
    assert router.index.resident(f"engine-{2**62}") == 5_000


def test_one_block_named_by_many_hashes_costs_bounded_memory() -> None:
    """A source storing the same block under 200,000 engine hashes held one block but
    200,000 hash entries: the cap counted held blocks only."""
    index = PrefixIndex(B, max_blocks_per_worker=1000)
    for start in range(0, 200_000, 1000):
        index.apply(message("a", *(stored([h], PROMPT[:B]) for h in range(start, start + 1000))))
    state = index._workers["a"]
    assert len(state.keys) <= 1000 + kvbus.routing.index._MIN_REMEMBERED
    assert index.match(PROMPT[:B]).get("a", 0) == B  # the block itself is still known


def test_a_hash_stored_again_under_other_tokens_leaves_no_orphan_block() -> None:
    """Hash 7 stored again under other tokens replaced its key and left the old block
    held with no hash pointing to it: removing 7 still left the worker credited."""
    index = PrefixIndex(B)
    for n in range(2000):
        index.apply(message("a", stored([7], [n, n + 1, n + 2, n + 3])))
    assert len(index._workers["a"].held) == 1
    index.apply(message("a", BlockRemoved([7], "GPU")))
    assert index._workers["a"].held == {} and index.match([0, 1, 2, 3]).get("a", 0) == 0
    assert index.match([1999, 2000, 2001, 2002]).get("a", 0) == 0


# --- 5. a store that fails is skipped whole -------------------------------------------------


def test_a_store_whose_keys_fail_counts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`apply` counted the blocks as stored (and adopted the block size) before making
    their keys, then raised: the router's insertion window counted blocks nobody
    held. Now the keys come first; a failing event is a counted, skipped event."""

    def failing(*args: Any) -> list[int]:
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(kvbus.routing.index_feed, "keys_of", failing)
    index = PrefixIndex()
    event = with_lookahead(stored([1, 2], PROMPT[: 2 * B]), 2)
    index.apply(message("a", event))  # does not raise
    assert index.malformed == 1
    assert index.stored(index.worker_number("a")) == 0
    assert index.block_size is None and index.lookahead == 0 and index.workers() == []


def test_extra_keys_holding_a_list_apply_or_are_skipped_whole() -> None:
    """The schema allows arrays in extra keys (vLLM's (mm hash, offset) pairs); one
    built in-process as a list raised ``TypeError`` out of `apply` after counting."""
    index = PrefixIndex(B)
    event = stored([1, 2], PROMPT[: 2 * B])
    event.extra_keys = [(["mm-hash", 0],), None]  # type: ignore[list-item]
    index.apply(message("a", event, AllBlocksCleared(), stored([3], PROMPT[:B])))
    index.apply(message("b", event))
    number = index.worker_number("b")
    applied = index.malformed == 0
    assert index.stored(number) == (2 if applied else 0)
    assert index.match(PROMPT) == {"a": B}
