"""The prefix index on hybrid models (kvbus.routing.index_window): events shaped as
vLLM 0.32 sends them for a model with a 64-token sliding window beside full attention
(read off a real engine: the window group's stores come first in a batch, name the
same engine hashes as the full-attention blocks of the same tokens, and carry no
parent). Real engines: test_router_window."""

from __future__ import annotations

import random

import pytest

from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvbus.routing.index import PrefixIndex
from kvbus.routing.index_window import _window_ands

BLOCK = 32
A = list(range(5, 5 + 4 * BLOCK + 8))  # 4 whole blocks


def full(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(
        hashes, parent, tokens, BLOCK, None, "GPU", None,
        group_idx=1, kv_cache_spec_kind="full_attention",
    )  # fmt: skip


def window(hashes: list[int], tokens: list[int]) -> BlockStored:
    return BlockStored(
        hashes, None, tokens, BLOCK, None, "GPU", None,
        group_idx=0, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64,
    )  # fmt: skip


def blocks(tokens: list[int], first: int, last: int) -> list[int]:
    return tokens[first * BLOCK : last * BLOCK]


def served(index: PrefixIndex, worker: str = "h/dp0") -> None:
    """Prompt A run on a hybrid engine: four full-attention blocks (hashes 100..103) and
    its last window (blocks 2 and 3), the window group's store first."""
    index.apply_events(
        worker,
        [window([102, 103], blocks(A, 2, 4)), full([100, 101, 102, 103], blocks(A, 0, 4))],
    )


def test_a_hit_needs_the_window_before_its_end() -> None:
    index = PrefixIndex()
    served(index)
    assert index.match(A + [9] * 40) == {"h/dp0": 128}  # the next turn: all 4 blocks
    # The same system prompt (3 blocks), then other words: the window before its end
    # (blocks 1 and 2) is not held, nor any shorter one from the start.
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {}
    # A prompt of exactly the 4 blocks: the engine computes its last token, so at most
    # 3 blocks, and their window (1, 2) is not held either.
    assert index.match(A[: 4 * BLOCK]) == {}


def test_a_window_eviction_leaves_the_full_attention_copy() -> None:
    index = PrefixIndex()
    served(index)
    index.apply_events("h/dp0", [BlockRemoved([103], "GPU", group_idx=0)])
    key = index.keys(A)[3]
    assert index.holds("h/dp0", key)  # the full-attention block is still there
    assert index.match(A + [9] * 40) == {}  # but the window ending at 4 is not
    index.apply_events("h/dp0", [BlockRemoved([103], "GPU", group_idx=1)])
    assert not index.holds("h/dp0", key)


def test_other_groups_are_skipped_removals_included() -> None:
    index = PrefixIndex()
    local = BlockStored(
        [100], None, blocks(A, 0, 1), BLOCK, None, "GPU", None,
        group_idx=2, kv_cache_spec_kind="chunked_local_attention",
    )  # fmt: skip
    index.apply_events("h/dp0", [full([100, 101], blocks(A, 0, 2)), local])
    index.apply_events("h/dp0", [BlockRemoved([100], "GPU", group_idx=2)])
    assert index.match([*A[: 2 * BLOCK], 1]) == {"h/dp0": 64}
    assert index.other_groups == 2


def mamba(hashes: list[int], group: int, tokens: list[int]) -> BlockStored:
    """A mamba (linear-attention) group's store as vLLM 0.32 sends it: the hashes of the
    block boundaries where it saved a state, no parent, the chunk's tokens."""
    return BlockStored(
        hashes, None, tokens, BLOCK, None, "GPU", None,
        group_idx=group, kv_cache_spec_kind="mamba",
    )  # fmt: skip


def test_a_mamba_hit_needs_the_state_at_its_boundary() -> None:
    """Three linear-attention groups saved their state at the end of A's prefill (block
    3): A's next turn finds all four blocks, a prompt sharing three nothing."""
    index = PrefixIndex()
    states = [mamba([103], group, A[: 4 * BLOCK]) for group in range(3)]
    index.apply_events("m/dp0", [*states, full([100, 101, 102, 103], blocks(A, 0, 4))])
    assert index.match(A + [9] * 40) == {"m/dp0": 128}
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {}
    index.apply_events("m/dp0", [mamba([102], 0, A[: 3 * BLOCK])])  # a state at block 2
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {"m/dp0": 96}


def test_every_sparse_group_must_allow_the_hit() -> None:
    """A model with sliding-window and mamba groups: the longest hit both allow, found as
    vLLM's coordinator finds it, cutting by each until neither shortens it."""
    index = PrefixIndex()
    index.apply_events(
        "x/dp0",
        [
            window([101, 102], blocks(A, 1, 3)),  # not block 0
            mamba([101, 103], 2, A[: 4 * BLOCK]),
            full([100, 101, 102, 103], blocks(A, 0, 4)),
        ],
    )
    # Four blocks: the window wants 2 and 3 (no 3); three: 1 and 2, yes, but no state
    # at block 2; two: a state at 1, but the window wants 0 and 1; one: the window
    # wants 0. Nothing.
    assert index.match(A + [9] * 40) == {}
    index.apply_events("x/dp0", [window([100], blocks(A, 0, 1))])
    assert index.match(A + [9] * 40) == {"x/dp0": 64}


def test_plain_workers_beside_hybrid_ones_match_as_before() -> None:
    index = PrefixIndex()
    served(index)
    index.apply_events(
        "p/dp0", [BlockStored([7, 8, 9], None, blocks(A, 0, 3), BLOCK, None, "GPU", None)]
    )
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {"p/dp0": 96}


def test_an_emptied_cache_keeps_the_model_and_a_restart_forgets_it() -> None:
    """``AllBlocksCleared`` (vLLM's ``/reset_prefix_cache``) empties the cache, not the
    model: full-attention blocks stored before the window group's (a request routed in
    between) are still cut. A restart (a new epoch, or events lost) may bring another
    model: what was learned of the groups goes."""
    index = PrefixIndex()
    served(index)
    index.apply_events("h/dp0", [AllBlocksCleared()])
    assert index.window_mask == 1
    index.apply_events("h/dp0", [full([1, 2, 3], blocks(A, 0, 3))])
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {}  # no window held yet
    index.clear("h/dp0")  # as a new epoch or a resync does
    assert index.window_mask == 0
    # Restarted with a plain model: its matches are no longer cut.
    index.apply_events(
        "h/dp0", [BlockStored([1, 2, 3], None, blocks(A, 0, 3), BLOCK, None, "GPU", None)]
    )
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {"h/dp0": 96}


def test_a_window_block_never_held_in_full_is_not_indexed() -> None:
    index = PrefixIndex()
    index.apply_events("h/dp0", [window([555], blocks(A, 0, 1))])
    assert index.unchained == 1 and index.window_mask == 0


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8])
def test_window_ands_are_the_ands_of_each_window(width: int) -> None:
    rng = random.Random(width)
    for count in range(0, 30):
        masks = [rng.getrandbits(4) | rng.getrandbits(4) for _ in range(count)]
        expected = []
        for i in range(count):
            value = -1
            for mask in masks[max(0, i - width + 1) : i + 1]:
                value &= mask
            expected.append(value)
        assert _window_ands(masks, width) == expected


def test_a_request_just_routed_leaves_the_windows_vllm_keeps_pending() -> None:
    """Before its engine's events come, a request routed to a hybrid worker counts as
    leaving its prompt's blocks in the full-attention group and, in the window group,
    what vLLM's sparse retention keeps: the window ending on the replay boundary (its
    prompt less one token, in whole blocks) and the window ending on the junction, where
    the full-attention group held a shared prefix the window group could not reuse.
    Its next turn is predicted to find it all, and so is a sibling sharing the junction;
    a block-aligned prompt keeps the window before its last block, not the one ending
    on it."""
    from kvbus import Kind, LoadMetrics, Message
    from kvbus.routing.router import Router

    r = Router(block_size=BLOCK, seed=1)
    record = LoadMetrics(ts=0.0, running=0, waiting=0, kv_cache_usage=0.0)
    r.apply_metrics(Message("h/dp0", 1, 1, Kind.METRICS, 0.0, record, b"", 0))
    served(r.index)  # a hybrid model (A served), window 2 blocks
    b = [*A[: 3 * BLOCK], *range(2000, 2000 + 2 * BLOCK + 5)]  # 5 whole blocks, new tail
    first = r.route(b)
    assert first is not None and first.predicted_cached_tokens == 0
    assert first.window_ends == [5, 3]  # replay boundary, junction (A's 3 blocks)
    assert first.window_keys == first.keys[3:5] + first.keys[1:3]
    turn = r.route([*b, *range(3000, 3040)])  # its next turn: all 5 blocks
    sibling = r.route([*A[: 3 * BLOCK], *range(4000, 4070)])  # shares the junction
    stranger = r.route([*A[: 2 * BLOCK], *range(5000, 5070)])  # shares 2 blocks only
    assert turn is not None and sibling is not None and stranger is not None
    assert turn.predicted_cached_tokens == 160
    assert (sibling.predicted_cached_tokens, stranger.predicted_cached_tokens) == (96, 0)
    aligned = r.route([*range(6000, 6000 + 4 * BLOCK)])  # exactly 4 blocks, all new
    assert aligned is not None and aligned.window_ends == [3]
    assert aligned.window_keys == aligned.keys[1:3]  # not block 3: vLLM recomputes it
    again = r.route([*range(6000, 6000 + 4 * BLOCK), *range(7000, 7040)])
    assert again is not None and again.predicted_cached_tokens == 96
    for decision in (first, turn, sibling, stranger, aligned, again):
        r.finished(decision)
    r.state.expire(1e12)  # long after: nothing pending any more
    assert not r.state.window_pending_masks and not r.state.pending_masks


def test_a_finished_requests_pending_blocks_give_way_to_the_engines_events() -> None:
    """A request that ends before its engine's events come leaves its blocks pending
    (its prompt in full attention; in a mamba group, the states vLLM's retention keeps
    by rule) only until the events report its last block: from then on the index says
    what the engine kept, and what it evicted since. Under load a router saw its
    events late and, for the rest of ``linger``, predicted states the engine had not
    kept (a real Qwen3-Next engine, test_router_window)."""
    from kvbus import Kind, LoadMetrics, Message
    from kvbus.routing.router import Router

    r = Router(block_size=BLOCK, seed=1, clock=lambda: 1000.0)  # nothing expires by itself
    record = LoadMetrics(ts=0.0, running=0, waiting=0, kv_cache_usage=0.0)
    r.apply_metrics(Message("m/dp0", 1, 1, Kind.METRICS, 0.0, record, b"", 0))

    def engine(*events: object) -> None:
        batch = KVEventBatch(0.0, list(events))  # type: ignore[arg-type]
        r.apply_kv(Message("m/dp0", 1, 1, Kind.KV, 0.0, batch, b"", 0))

    # A served: its four blocks, and its state at the end of block 3 in two groups.
    engine(
        *(mamba([103], g, A[: 4 * BLOCK]) for g in range(2)),
        full([100, 101, 102, 103], blocks(A, 0, 4)),
    )
    b = [*A[: 3 * BLOCK], *range(2000, 2000 + 2 * BLOCK + 5)]  # A's 3 blocks, 2 new
    turn = [*b, *range(3000, 3040)]
    sibling = [*A[: 3 * BLOCK], *range(4000, 4070)]

    def predicted() -> tuple[int, int]:
        """The turn's and the sibling's predictions, neither routed (a router's shed
        decisions take nothing): what ``b`` left, alone."""
        r.shed_after = -1.0
        turned, sided = r.route(turn), r.route(sibling)
        r.shed_after = None
        assert turned is not None and sided is not None and turned.shed and sided.shed
        return turned.predicted_cached_tokens, sided.predicted_cached_tokens

    first = r.route(b)
    assert first is not None and first.window_ends == [5, 3]
    r.finished(first)  # before any event of it
    assert predicted() == (160, 96)  # the rule: replay boundary, junction
    # Its events: blocks 3-4, and a state at block 3 only (not the rule's).
    states = [mamba([104], g, b[: 4 * BLOCK]) for g in range(2)]
    engine(*states, full([104, 105], blocks(b, 3, 5), parent=102))
    assert predicted() == (128, 0)
    engine(BlockRemoved([105, 104], "GPU"))  # evicted at once
    assert predicted() == (0, 0)
    assert not r.index.awaited and not r.state.requests._awaiting
    # A request whose events never come lingers, and is forgotten, as before.
    lost = r.route([*range(9000, 9000 + 3 * BLOCK)])
    assert lost is not None
    r.finished(lost)
    assert r.index.awaited
    r.state.expire(1e12)
    assert not r.index.awaited and not r.state.requests._awaiting
    assert not r.state.window_pending_masks and not r.state.pending_masks
    # Two requests of one prompt end before its events: one store releases both.
    prompt = [*range(8000, 8000 + 3 * BLOCK)]
    twins = [r.route(prompt), r.route(prompt)]
    assert twins[0] is not None and twins[1] is not None
    keys = set(twins[0].keys)
    for twin in twins:
        r.finished(twin)
    assert keys <= r.state.pending_masks.keys()
    engine(full([300, 301, 302], prompt))
    assert not r.state.requests._awaiting and not keys & r.state.pending_masks.keys()
    # A cache emptied forgets what waited on it.
    lost = r.route([*range(9000, 9000 + 3 * BLOCK)])
    assert lost is not None
    r.finished(lost)
    engine(AllBlocksCleared())
    assert not r.index.awaited and not r.state.requests._awaiting
    assert not r.state.window_pending_masks and not r.state.pending_masks


def test_a_replicas_request_leaves_the_same_windows_and_forged_ends_are_clamped() -> None:
    """Router replicas share the windows a request leaves (``RouteEvent.window_ends``):
    a sibling routed by the other replica finds the junction's window too. Ends read off
    the bus are untrusted: out of range or too many, they are clamped."""
    from kvbus import Kind, LoadMetrics, Message
    from kvbus.routing.router import Router
    from kvbus.wire.events import RouteEvent

    record = LoadMetrics(ts=0.0, running=0, waiting=0, kv_cache_usage=0.0)
    routers = [Router(block_size=BLOCK, seed=1, replica=name) for name in ("r1", "r2")]
    for router in routers:
        router.apply_metrics(Message("h/dp0", 1, 1, Kind.METRICS, 0.0, record, b"", 0))
        served(router.index)
    one, two = routers
    one.share = lambda event: two.apply_routes(
        Message("r1", 1, event.request, Kind.ROUTES, 0.0, event, b"", 0)
    )
    first = one.route([*A[: 3 * BLOCK], *range(2000, 2000 + 2 * BLOCK + 5)])
    assert first is not None and two.peer_requests == 1
    sibling = two.route([*A[: 3 * BLOCK], *range(4000, 4070)])
    assert sibling is not None and sibling.predicted_cached_tokens == 96
    keys = first.keys
    for number, ends in enumerate(([-5, 10**18], [2, 2, 2, 4, 5] * 1000, []), start=100):
        event = RouteEvent(ts=0.0, request=number, phase="routed", worker="h/dp0",
                           keys=keys, window_ends=ends)  # fmt: skip
        two.apply_routes(Message("r3", 1, number, Kind.ROUTES, 0.0, event, b"", 0))
    peers = [two.replica_requests.get("r3", n) for n in (100, 101, 102)]
    assert [p.window_keys if p else None for p in peers] == [keys[-2:], keys[0:2], keys[-2:]]
