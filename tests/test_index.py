"""PrefixIndex logic on hand-made event streams (real engine streams: test_vllm_events)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvbus
import kvbus.routing.index
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, Kind, KVEventBatch, Message
from kvbus.bus.intake import SLICE
from kvbus.bus.subscription import Resync, ResyncReason
from kvbus.routing import _kernels
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import decode_kv_batch

B = 4  # block size


@pytest.fixture(autouse=True, params=["C kernels", "Python kernels"])
def kernels(request: pytest.FixtureRequest) -> None:
    """Every test here on the index's C loops and on their Python reference."""
    if request.param == "Python kernels":
        before = kvbus.routing.index.use_kernels(_kernels)
        request.addfinalizer(lambda: kvbus.routing.index.use_kernels(before))
    elif kvbus.routing.index.kernels is _kernels:
        pytest.skip("kvbus.routing._ckernels did not build (test_index_kernels says why)")


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


def test_a_block_stays_held_until_its_last_copy_goes() -> None:
    """vLLM caches a prompt's recomputed last block as a second copy under the same
    hash and sends BlockStored/BlockRemoved per copy."""
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8])))
    index.apply(message("a", stored([2], PROMPT[4:8], parent=1)))  # the copy
    assert index.copies("a") == 3 and index.resident("a") == 2
    index.apply(message("a", BlockRemoved([2], "GPU")))
    assert index.match(PROMPT) == {"a": 8} and index.blocks("a") == {1, 2}
    index.apply(message("a", BlockRemoved([2], "GPU")))
    assert index.match(PROMPT) == {"a": 4} and index.blocks("a") == {1}
    index.apply(message("a", BlockRemoved([2], "GPU")))  # one more than was stored
    assert index.unknown_removals == 1 and index.match(PROMPT) == {"a": 4}


def test_a_block_stored_under_an_evicted_parent_still_chains() -> None:
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8])))
    index.apply(message("a", BlockRemoved([2], "GPU")))
    index.apply(message("a", stored([3], PROMPT[8:12], parent=2)))
    assert index.unchained == 0
    # The engine cannot hit block 3 without block 2 either: the prefix stops at 1.
    assert index.match(PROMPT) == {"a": 4}
    index.apply(message("a", stored([2], PROMPT[4:8], parent=1)))  # recomputed
    assert index.match(PROMPT) == {"a": 12}


def test_remembered_keys_of_evicted_blocks_are_bounded() -> None:
    index = PrefixIndex(B)
    for h in range(1, 5001):
        tokens = [h, h + 1, h + 2, h + 3]
        index.apply(message("a", stored([h], tokens), BlockRemoved([h], "GPU")))
    state = index._workers["a"]
    assert len(state.keys) <= 1024 and len(state.forgotten) <= 1024
    assert index.resident("a") == 0 and len(index) == 0


def test_lookahead_tokens_enter_the_block_keys() -> None:
    """vLLM 0.33 with lookahead hashing: a block's hash also covers the next L tokens,
    so equal blocks followed by other tokens are other blocks, and a prompt's block
    without L tokens after it is never cached."""
    index = PrefixIndex(B)
    event = stored([1, 2], PROMPT[:8])
    event.lookahead_token_ids = [PROMPT[4:6], PROMPT[8:10]]
    index.apply(message("a", event))
    assert index.lookahead == 2
    assert index.match(PROMPT) == {"a": 8}
    assert index.match(PROMPT[:10]) == {"a": 8}
    assert index.match(PROMPT[:9]) == {"a": 4}  # block 2 lacks its lookahead tokens
    assert index.match([*PROMPT[:8], 7, 7]) == {"a": 4}  # other tokens after block 2


# --- recorded real vLLM streams (tests/data/record_vllm_streams.py) --------------------

RECORDED = msgspec.msgpack.decode(
    (Path(__file__).parent / "data/vllm_streams.msgpack").read_bytes()
)
RB = RECORDED["block_size"]


class Replay:
    """Feeds an index recorded engine payloads, the ``way_in`` given."""

    def __init__(self, way_in: str) -> None:
        self.way_in = way_in

    def __call__(
        self, index: PrefixIndex, worker: str, run: str, start: int = 0, stop: int | None = None
    ) -> int:
        """Feed ``worker`` the payloads [start, stop) of ``run``; returns stop."""
        payloads = RECORDED["runs"][run]["payloads"]
        stop = len(payloads) if stop is None else stop
        for payload in payloads[start:stop]:
            if self.way_in == "payload":
                assert index.apply_payload(worker, payload) == 0
            else:
                batch, _ = decode_kv_batch(payload)
                index.apply(Message(worker, 1, 1, Kind.KV, 0.0, batch, payload, 0))
        return stop


@pytest.fixture(params=["decoded", "payload"])
def replay(request: pytest.FixtureRequest) -> Replay:
    """The recorded payloads decoded first (a consumer read the body), or applied
    straight from their bytes (`PrefixIndex.apply_payload`)."""
    return Replay(request.param)


def predicted(index: PrefixIndex, worker: str, step: dict[str, Any]) -> int:
    tokens = step["tokens"]
    held = index.match(tokens, lora_name=step["lora"]).get(worker, 0)
    return min(held, (len(tokens) - 1) // RB * RB)


def kinds(run: str) -> set[str]:
    return {
        type(e).__name__
        for p in RECORDED["runs"][run]["payloads"]
        for e in decode_kv_batch(p)[0].events
    }


@pytest.mark.parametrize("run", ["a", "b"])
def test_recorded_engine_runs_predicted_and_mirrored_step_by_step(run: str, replay: Replay) -> None:
    """Run a evicts (a 32-block cache) and clears (reset_prefix_cache); run b serves a
    LoRA adapter over the same tokens. Before each prompt the index predicts the
    engine's cache hit exactly; after it the index holds exactly the engine's blocks."""
    index = PrefixIndex()  # the block size comes from the events
    applied = 0
    reset = False
    for step in RECORDED["runs"][run]["steps"]:
        applied = replay(index, "w", run, applied, step["before"])
        if step.get("reset"):
            reset = True
            continue
        if not reset:  # vLLM publishes a reset's AllBlocksCleared with its next step
            assert predicted(index, "w", step) == step["cached"]
        reset = False
        applied = replay(index, "w", run, applied, step["after"])
        assert index.blocks("w") == set(step["engine_blocks"])
    assert index.block_size == RB
    expected = {"a": {"BlockRemoved", "AllBlocksCleared"}, "b": {"BlockStored"}}[run]
    assert expected <= kinds(run)


def test_recorded_lora_blocks_match_only_with_their_adapter(replay: Replay) -> None:
    steps = RECORDED["runs"]["b"]["steps"]
    tokens = steps[0]["tokens"]
    assert steps[1]["tokens"] == tokens and steps[1]["lora"] == "tenant-lora"
    index = PrefixIndex()
    replay(index, "w", "b", 0, steps[1]["before"])  # base-model blocks only
    assert index.match(tokens, lora_name="tenant-lora") == {}
    replay(index, "w", "b", steps[1]["before"], steps[1]["after"])
    full = len(tokens) // RB * RB
    assert index.match(tokens, lora_name="tenant-lora") == {"w": full}
    assert index.match(tokens) == {"w": full}


async def test_recorded_engine_restart_replaces_that_workers_blocks(memory_url: str) -> None:
    """Run a, then run b (another engine process: new hash seed) under the same source
    through a real publisher and subscription: the new epoch leaves only run b's blocks."""
    for run in ("a", "b"):
        with kvbus.Publisher(memory_url, source="w") as publisher:
            for payload in RECORDED["runs"][run]["payloads"]:
                publisher.publish(payload)
    index = PrefixIndex()
    undecoded = 0
    async with kvbus.subscribe("kv", memory_url, follow=False) as items:
        async for item in items:
            index.apply(item)
            if isinstance(item, Message) and item.kind == Kind.KV:
                undecoded += not item.decoded  # applied from its payload
        assert items.stats.skipped_events == 0
    assert index.blocks("w") == set(RECORDED["runs"]["b"]["steps"][-1]["engine_blocks"])
    assert undecoded == sum(len(RECORDED["runs"][r]["payloads"]) for r in "ab")


async def test_the_subscriber_decodes_batches_packed_once_the_index_reads_them(
    memory_url: str,
) -> None:
    """The index reads each batch's ``packed_events``; after the first slice, the
    subscriber decodes them so as its check of each batch (no second decode), and
    nobody decodes a body but that of the one batch packed events cannot hold."""
    batches = 3 * SLICE
    with kvbus.Publisher(memory_url, source="w") as publisher:
        for i in range(batches):
            events: list[Any] = [stored([i], list(range(i * B, (i + 1) * B)))]
            if i == 2 * SLICE:
                events.append({"type": "BlockPinned", "block_hashes": [i]})
            publisher.publish(msgspec.msgpack.encode([1.0, events]))
    index = PrefixIndex()
    async with kvbus.subscribe("kv", memory_url, follow=False) as items:
        async for item in items:
            index.apply(item)
        decoded_by_the_consumer = items._undecoded.packed_read
        assert items._undecoded.read == 1 and items.stats.skipped_events == 1
    assert index.blocks("w") == set(range(batches))
    assert 0 < decoded_by_the_consumer <= SLICE


async def test_a_batch_the_quick_way_does_not_take_is_decoded_and_counted(
    memory_url: str,
) -> None:
    """What `PrefixIndex.apply` cannot read with packed token ids (vLLM's older array
    dialect, an event type this kvbus does not know, token ids that are not ints) is
    decoded the subscriber's way: the rest applies, and the skipped events are counted
    once, in the subscription's stats."""
    current = stored([1, 2], PROMPT[: 2 * B])
    older = ["BlockStored", [3, 4], None, PROMPT[2 * B :], B, None, "GPU", None]
    payloads = [
        msgspec.msgpack.encode([1.0, [older], None]),
        msgspec.msgpack.encode([1.0, [current, {"type": "BlockPinned", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [{**msgspec.to_builtins(current), "token_ids": ["x"]}]]),
    ]
    with kvbus.Publisher(memory_url, source="w") as publisher:
        for payload in payloads:
            publisher.publish(payload)
    index = PrefixIndex()
    async with kvbus.subscribe("kv", memory_url, follow=False) as items:
        async for item in items:
            index.apply(item)
        assert items.stats.skipped_events == 2
    assert index.match(PROMPT) == {"w": 2 * B}  # the current store; the older one
    assert index.blocks("w") == {1, 2, 3, 4}  # chains under no parent of its own
    fresh = PrefixIndex()
    assert [fresh.apply_payload("w", p) for p in payloads] == [0, 1, 1]
    assert fresh.blocks("w") == index.blocks("w")


def test_recorded_two_engines_hold_the_same_prefix(replay: Replay) -> None:
    index = PrefixIndex()
    replay(index, "a", "a")
    b_steps = RECORDED["runs"]["b"]["steps"]
    shortest = min(RECORDED["prefix_lengths"]) // RB * RB
    applied = replay(index, "b", "b", 0, b_steps[-2]["before"])
    for step in b_steps[-2:]:  # the tenants engine a served last, sent to engine b
        applied = replay(index, "b", "b", applied, step["before"])
        assert index.match(step["tokens"]).get("a", 0) >= shortest
        assert predicted(index, "b", step) == step["cached"]  # b computes them
        applied = replay(index, "b", "b", applied, step["after"])
        found = index.match(step["tokens"])
        assert found["a"] >= shortest and found["b"] >= shortest
    index.clear("a")
    assert set(index.match(b_steps[-1]["tokens"])) == {"b"}


@pytest.mark.parametrize("block_size", [0, -16, 2**40])
def test_an_event_with_an_impossible_block_size_is_skipped(block_size: int) -> None:
    """block_size 0 in the first event used to become the index's block size: every
    later match divided by zero, and the router answered 500 to every request."""
    index = PrefixIndex()
    forged = BlockStored([1, 2], None, PROMPT, block_size, None, "GPU", None)
    index.apply(message("a", forged))
    index.apply(message("a", stored([7, 8], PROMPT[: 2 * B])))
    assert index.malformed == 1
    assert index.match(PROMPT[: 2 * B]) == {"a": 2 * B}


@pytest.mark.parametrize("bad_token", [-1, 2**32, 2**64 - 1])
@pytest.mark.parametrize("lora", [None, "adapter"])
def test_an_event_with_a_token_id_outside_32_bits_is_skipped(
    bad_token: int, lora: str | None
) -> None:
    """Such a token id used to raise out of ``apply`` (the gateway's follow loop caught
    it, uncounted); now the event is counted malformed and the rest still applies."""
    index = PrefixIndex()
    tokens = [*PROMPT[: 2 * B - 1], bad_token]
    index.apply(message("a", BlockStored([1, 2], None, tokens, B, None, "GPU", lora)))
    index.apply(message("a", stored([7, 8], PROMPT[: 2 * B])))
    assert index.malformed == 1
    assert index.match(PROMPT[: 2 * B]) == {"a": 2 * B}


def test_a_skipped_event_does_not_change_the_lookahead() -> None:
    """The lookahead is learned from the events; one skipped as malformed (here for a
    token id past 32 bits) used to set it anyway, and every later prompt was keyed
    with lookahead tokens that no engine hashes: no match anywhere."""
    index = PrefixIndex(B)
    index.apply(message("a", stored([7, 8], PROMPT[: 2 * B])))
    forged = stored([1, 2], [*PROMPT[: 2 * B - 1], 2**32])
    forged.lookahead_token_ids = [PROMPT[:3], PROMPT[:3]]
    index.apply(message("b", forged))
    assert index.malformed == 1 and index.lookahead == 0
    assert index.match(PROMPT[: 2 * B]) == {"a": 2 * B}


def test_tokenless_offload_events_count_a_copy_of_known_blocks_by_medium() -> None:
    """vLLM's offloading connector names offloaded blocks by engine hash only (no
    tokens, block size 0): each is another copy, in its medium, of a block the worker
    stored on the GPU; removed as usual; unknown hashes are skipped, not guessed."""
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8])))
    placeholder = BlockStored([1, 2, 99], None, [], 0, None, "CPU", None)
    index.apply(message("a", placeholder))
    assert index.copies("a", "CPU") == 2 and index.unchained == 1 and index.malformed == 0
    index.apply(message("a", BlockRemoved([1, 2], "GPU")))  # evicted from the GPU only
    assert index.match(PROMPT) == {"a": 8}
    assert index.match_weighted(PROMPT) == {"a": 1.0}  # two CPU copies at 0.5
    index.apply(message("a", BlockRemoved([1, 2], "CPU")))
    assert index.match(PROMPT) == {}
    gpu_placeholder = BlockStored([1], None, [], 0, None, "GPU", None)
    index.apply(message("a", gpu_placeholder))
    assert index.malformed == 1  # a tokenless GPU store is still malformed


def test_mixed_events_take_the_block_by_block_way_with_the_same_counts() -> None:
    """An event mixing new blocks with copies, and a removal mixing sole copies, extra
    copies, duplicates and unknown hashes, count exactly as one block at a time."""
    index = PrefixIndex(B)
    index.apply(message("a", stored([1, 2], PROMPT[:8])))
    index.apply(message("b", stored([1], PROMPT[:4])))
    index.apply(message("a", stored([2, 3], PROMPT[4:12], parent=1)))  # 2 again: a copy
    assert index.copies("a") == 4 and index.resident("a") == 3
    index.apply(message("a", BlockRemoved([3, 2, 3, 42], "GPU")))
    assert index.unknown_removals == 2  # the second 3, and 42
    assert index.resident("a") == 2 and index.copies("a") == 2
    assert index.match(PROMPT) == {"a": 8, "b": 4}
    index.apply(message("a", BlockRemoved([1, 2], "GPU")))  # the sole copies, at once
    assert index.match(PROMPT) == {"b": 4} and index.resident("a") == 0
    assert len(index) == 1  # block 1, held by b alone


def test_workers_storing_the_same_blocks_share_keys_only_under_the_same_parent() -> None:
    index = PrefixIndex(B)
    other = [7, 7, 7, 7]
    index.apply(message("a", stored([1, 2], PROMPT[:8])))
    index.apply(message("b", stored([7], PROMPT[:4]), stored([8], PROMPT[4:8], parent=7)))
    index.apply(message("c", stored([5], other), stored([6], PROMPT[4:8], parent=5)))
    assert index.match(PROMPT) == {"a": 8, "b": 8}
    assert index.match([*other, *PROMPT[4:8]]) == {"c": 8}
    assert len(index) == 4


def test_the_shared_keys_are_bounded() -> None:
    index = PrefixIndex(B)
    for h in range(1, 3001):
        index.apply(message("a", stored([h], [h, h, h, h]), BlockRemoved([h], "GPU")))
    assert len(index._chains) <= 1024 and len(index) == 0
