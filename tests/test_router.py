"""Router policy logic on hand-made streams and a hand-driven clock (real engines and
the HTTP router: test_router_e2e)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbus import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Kind,
    KVEventBatch,
    LoadMetrics,
    Message,
)
from kvbus.bus.subscription import Resync, ResyncReason
from kvbus.routing.in_flight import RequestsInFlight
from kvbus.routing.index import PrefixIndex
from kvbus.routing.router import CostWeights, Policy, Router
from kvbus.wire.events import SourceStopped

B = 4
PROMPT = list(range(100, 133))  # 8 full blocks and one token


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kv(source: str, *events: object) -> Message:
    batch = KVEventBatch(time.time(), list(events))  # type: ignore[arg-type]
    return Message(source, 1, 1, Kind.KV, 0.0, batch, b"", 0)


def load(
    source: str, running: int = 0, waiting: int = 0, usage: float = 0.0, ago: float = 0.0
) -> Message:
    """A load record made ``ago`` seconds before now (wall clock)."""
    made = time.time() - ago
    body = LoadMetrics(ts=made, running=running, waiting=waiting, kv_cache_usage=usage)
    return Message(source, 1, 1, Kind.METRICS, made, body, b"", 0)


def stopped(source: str, ts: float) -> Message:
    return Message(source, 1, 2, Kind.CONTROL, ts, SourceStopped(), b"", 0)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, B, None, "GPU", None)


def router(
    policy: str = "kv",
    workers: tuple[str, ...] = ("a", "b"),
    clock: Clock | None = None,
    **options: Any,
) -> Router:
    r = Router(policy, block_size=B, seed=1, clock=clock or Clock(), **options)
    for worker in workers:
        r.apply_metrics(load(worker))
    return r


def test_the_worker_holding_the_prefix_wins_and_predicts_the_engines_count() -> None:
    r = router()
    r.apply_kv(kv("b", stored([1, 2, 3], PROMPT[:12])))
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "b"
    assert decision.matched_tokens == 12 and decision.predicted_cached_tokens == 12
    r.finished(decision)
    # A prompt that is exactly the held blocks: vLLM recomputes its last block.
    whole = r.route(PROMPT[:12])
    assert whole is not None and whole.worker == "b"
    assert (whole.matched_tokens, whole.predicted_cached_tokens) == (12, 8)


def test_a_decision_names_the_latest_events_of_its_worker_it_was_made_from() -> None:
    """``Decision.kv_seq`` (the ``x-kvbus-kv-seq`` header): the seq of the worker's
    latest kv message applied, -1 before any; another worker's do not count."""
    r = router()
    first = r.route(PROMPT)
    assert first is not None and first.kv_seq == -1
    for seq, source in ((1, "b"), (2, "b"), (7, "a")):
        item = kv(source, stored([10 + seq], PROMPT[:4]))
        r.apply_kv(Message(source, 1, seq, Kind.KV, 0.0, item.body, b"", 0))
    r.finished(first)
    on_a, on_b = r.route(PROMPT, exclude={"b"}), r.route(PROMPT, exclude={"a"})
    assert on_a is not None and on_b is not None and (on_a.kv_seq, on_b.kv_seq) == (7, 2)
    r.apply_kv(Resync("b", 2, ResyncReason.NEW_EPOCH))  # b restarted: its seqs start again
    on_b = r.route(PROMPT, exclude={"a"})
    assert on_b is not None and on_b.kv_seq == -1


def test_load_outweighs_a_short_prefix_per_the_weights() -> None:
    r = router(weights=CostWeights(prefill=1, eviction=0, waiting=4, running=2))
    r.apply_kv(kv("b", stored([1], PROMPT[:4])))  # saves b one block of prefill
    r.apply_metrics(load("b", running=1))  # costs b two
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "a"
    heavy_prefix = router(weights=CostWeights(prefill=5, eviction=0, waiting=4, running=2))
    heavy_prefix.apply_kv(kv("b", stored([1], PROMPT[:4])))
    heavy_prefix.apply_metrics(load("b", running=1))
    decision = heavy_prefix.route(PROMPT)
    assert decision is not None and decision.worker == "b"


def test_a_decision_names_what_the_best_worker_for_the_cache_held() -> None:
    """Regret: the load term sent the prompt away from the worker holding a block of it,
    and a policy blind to the cache may do the same; each says what it gave up."""
    r = router(weights=CostWeights(prefill=1, eviction=0, waiting=4, running=2))
    r.apply_kv(kv("b", stored([1], PROMPT[:4])))
    r.apply_metrics(load("b", running=1))
    traded = r.route(PROMPT)
    assert traded is not None and traded.worker == "a"
    assert (traded.predicted_cached_tokens, traded.best_cached_tokens) == (0, 4)
    blind = router("round_robin")
    blind.apply_kv(kv("a", stored([1, 2, 3], PROMPT[:12])))
    picks = [blind.route(PROMPT) for _ in range(2)]
    # The first to b gave up a's 12 tokens; then b is about to hold all 32 (the first
    # request's blocks), which the second, sent to a, gives up for a's 12.
    assert [(d.worker, d.predicted_cached_tokens, d.best_cached_tokens) for d in picks if d] == [
        ("b", 0, 12),
        ("a", 12, 32),
    ]
    whole = router()
    whole.apply_kv(kv("a", stored([1, 2, 3], PROMPT[:12])))
    held = whole.route(PROMPT[:12])  # all of it held: vLLM recomputes the last block
    assert held is not None and (held.predicted_cached_tokens, held.best_cached_tokens) == (8, 8)


def test_a_burst_follows_the_first_request_before_any_event() -> None:
    clock = Clock()
    r = router(clock=clock)
    first = r.route(PROMPT)
    assert first is not None and first.matched_tokens == 0
    # Same prompt at once: the first one's blocks are assumed there (8 blocks of
    # prefill saved outweigh one more request in flight).
    second = r.route(PROMPT)
    assert second is not None and second.worker == first.worker
    assert second.matched_tokens == 32
    # Both end; no event ever confirmed the blocks: after ``linger`` they are forgotten.
    r.finished(first)
    r.finished(second)
    clock.now += r.linger + 0.1
    third = r.route(PROMPT)
    assert third is not None and third.matched_tokens == 0


@pytest.mark.parametrize("emptied", ["reset", "restart"])
def test_a_reset_or_a_restart_ends_what_finished_requests_left_assumed(emptied: str) -> None:
    """A request ended before its engine's events came: its blocks stay assumed there for
    ``linger`` seconds, unless the engine's cache empties first (an ``AllBlocksCleared``,
    a new epoch): from then on nothing of them is predicted. A request still in flight
    keeps its blocks assumed (it caches them after the clear)."""
    r = router(workers=("a",))  # one worker: every request goes there
    first = r.route(PROMPT)
    assert first is not None
    r.finished(first)
    lingering = r.route(PROMPT)
    assert lingering is not None and lingering.worker == first.worker
    assert lingering.matched_tokens == 32  # assumed, though no event confirmed them
    other = r.route(list(range(500, 533)))  # in flight on the same worker
    assert other is not None and other.worker == first.worker
    r.finished(lingering)
    if emptied == "reset":
        r.apply_kv(kv(first.worker, AllBlocksCleared()))
    else:
        r.apply_kv(Resync(first.worker, 2, ResyncReason.NEW_EPOCH))
    after = r.route(PROMPT)  # no time passed: only the clear tells
    assert after is not None and after.matched_tokens == 0
    again = r.route(list(range(500, 533)))
    assert again is not None and again.matched_tokens == 32


def test_a_reset_under_load_queues_the_prompts_its_requests_compute_again() -> None:
    """A reset that emptied a cache while requests ran there preempted them (vLLM frees
    no block a request holds): each computes its whole prompt again, ahead of new work.
    The worker's queue counts them until they start (those not started), or until they
    end or a request routed after the reset starts (those streaming); a second clear
    counts nothing twice."""
    clock = Clock()
    r = router(workers=("a",), clock=clock)
    a = r.index.worker_number("a")
    streaming = r.route(PROMPT)  # 8 blocks
    assert streaming is not None
    r.started(streaming)
    waiting = r.route(PROMPT)  # a sibling: finds the 8 blocks pending, prefills none
    assert waiting is not None and waiting.prefill_blocks == 0
    assert r.state.queued_blocks(a) == 0
    clock.now += 0.01
    r.apply_kv(kv("a", AllBlocksCleared()))
    # Both compute all 8 blocks again: 16 blocks queued, and the load cost shows it.
    assert r.state.queued_blocks(a) == 16
    assert r.state.load[a] == pytest.approx(r.cost.load_cost(16, 1, 0, 0.0))
    r.apply_kv(kv("a", AllBlocksCleared()))
    assert r.state.queued_blocks(a) == 16
    r.started(waiting)  # routed before the reset: only its own 8 go
    assert r.state.queued_blocks(a) == 8
    clock.now += 0.01
    later = r.route(list(range(500, 533)))
    assert later is not None and r.state.queued_blocks(a) == 16  # its own 8 more
    r.started(later)  # routed after the reset: what the reset preempted was computed
    assert r.state.queued_blocks(a) == 0
    for request in (streaming, waiting, later):  # released already: nothing goes twice
        r.finished(request)
    assert r.state.queued_blocks(a) == 0
    # A request still streaming when it ends takes its recompute with it.
    again = r.route(list(range(600, 633)))
    assert again is not None
    r.started(again)
    clock.now += 0.01
    r.apply_kv(kv("a", AllBlocksCleared()))
    assert r.state.queued_blocks(a) == 8
    r.finished(again)
    assert r.state.queued_blocks(a) == 0
    # A restart is not a reset: its requests fail rather than compute again.
    last = r.route(list(range(700, 733)))
    assert last is not None
    r.started(last)
    r.apply_kv(Resync("a", 2, ResyncReason.NEW_EPOCH))
    assert r.state.queued_blocks(a) == 0


def test_a_loss_keeps_what_finished_requests_left_assumed() -> None:
    """Lost events (a gap) empty the index of that worker, not the engine's cache: the
    blocks a finished request left assumed stay for ``linger``."""
    r = router()
    first = r.route(PROMPT)
    assert first is not None
    r.finished(first)
    r.apply_kv(Resync(first.worker, 1, ResyncReason.GAP))
    after = r.route(PROMPT)
    assert after is not None and after.worker == first.worker and after.matched_tokens == 32


def test_blocks_the_engine_reported_follow_its_events_once_the_request_ends() -> None:
    r = router()
    first = r.route(PROMPT)
    assert first is not None
    hashes = list(range(1, 9))
    r.apply_kv(kv(first.worker, stored(hashes, PROMPT[:32])))
    r.finished(first)
    r.apply_kv(kv(first.worker, BlockRemoved(hashes[4:], "GPU")))  # evicted right away
    again = r.route(PROMPT)
    assert again is not None and again.worker == first.worker
    assert again.matched_tokens == 16  # not the 32 the request had put there


def test_stale_stopped_and_down_workers_get_no_traffic() -> None:
    clock = Clock()
    r = router(clock=clock, stale_after=5.0)
    r.apply_kv(kv("a", stored([1, 2], PROMPT[:8])))
    clock.now += 3
    r.apply_metrics(load("b"))
    clock.now += 3  # a's metrics are 6 s old, b's 3 s
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "b"
    assert r.eligible() == ["b"]

    r.apply_metrics(load("a"))
    r.mark_down("b", 10)
    assert {r.route(PROMPT).worker for _ in range(5)} == {"a"}  # type: ignore[union-attr]

    r.apply_metrics(stopped("a", time.time()))
    assert r.route(PROMPT) is None  # a stopped, b down
    clock.now += 11
    r.apply_metrics(load("b"))  # b's next record after the down time
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "b"


def test_a_past_runs_stop_replayed_from_history_changes_nothing() -> None:
    r = router()
    r.apply_kv(stopped("a", time.time() - 60))  # the engine's previous run ended
    assert sorted(r.eligible()) == ["a", "b"]
    r.apply_kv(stopped("a", time.time()))
    assert r.eligible() == ["b"]
    r.apply_metrics(load("a"))
    assert sorted(r.eligible()) == ["a", "b"]


def test_a_record_read_back_from_history_is_as_fresh_as_its_age() -> None:
    clock = Clock()
    r = router(clock=clock, stale_after=5.0)
    r.apply_metrics(load("a"), age=6.0)  # already stale when read
    r.apply_metrics(load("b"), age=3.0)
    assert r.eligible() == ["b"]
    clock.now += 2.5
    assert r.eligible() == []


def test_exclude_skips_a_worker_for_one_decision() -> None:
    r = router()
    r.apply_kv(kv("a", stored([1, 2], PROMPT[:8])))
    decision = r.route(PROMPT, exclude={"a"})
    assert decision is not None and decision.worker == "b"


@pytest.mark.parametrize("policy", [Policy.ROUND_ROBIN, Policy.RANDOM])
def test_load_blind_policies_use_only_live_workers(policy: Policy) -> None:
    clock = Clock()
    r = router(policy.value, ("a", "b", "c"), clock=clock)
    r.apply_kv(kv("a", stored([1, 2], PROMPT[:8])))
    picks = [r.route(PROMPT) for _ in range(30)]
    assert {p.worker for p in picks if p} == {"a", "b", "c"}
    # Their predictions still come from the index (first visits: nothing in flight yet).
    first = {p.worker: p.matched_tokens for p in reversed(picks) if p}
    assert first == {"a": 8, "b": 0, "c": 0}
    if policy is Policy.ROUND_ROBIN:
        assert [p.worker for p in picks[:6] if p] == [p.worker for p in picks[3:9] if p]
    clock.now += 10
    r.apply_metrics(load("c"))
    assert {r.route(PROMPT).worker for _ in range(10)} == {"c"}  # type: ignore[union-attr]


def test_a_restart_clears_only_that_workers_prefix() -> None:
    r = router(weights=CostWeights(eviction=0))  # (a's emptied cache would evict nothing)
    r.apply_kv(kv("a", stored([1, 2], PROMPT[:8])))
    r.apply_kv(kv("b", stored([7], PROMPT[:4])))
    r.apply_kv(Resync("a", 2, ResyncReason.NEW_EPOCH))
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "b" and decision.matched_tokens == 4


def test_blocks_offloaded_to_cpu_count_less_than_on_gpu() -> None:
    clock = Clock()
    r = router(weights=CostWeights(prefill=1, eviction=0, running=1), clock=clock)
    cpu = BlockStored([1, 2, 3, 4], None, PROMPT[:16], B, None, "CPU", None)
    r.apply_kv(kv("a", cpu))  # 4 blocks at weight 0.5: saves 2
    r.apply_kv(kv("b", stored([9, 8, 7], PROMPT[:12])))  # 3 on the GPU: saves 3
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "b"
    r.finished(decision)
    clock.now += r.linger + 0.1  # the request's own blocks are forgotten
    r.apply_metrics(load("b", running=2))  # now b costs 2 more: a wins
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "a" and decision.matched_tokens == 16


# --- the capacity-aware part of the cost ------------------------------------------------


def capacity(source: str, blocks: int) -> Message:
    body = LoadMetrics(ts=0.0, running=0, waiting=0, kv_cache_usage=0.0, kv_cache_blocks=blocks)
    return Message(source, 1, 1, Kind.METRICS, 0.0, body, b"", 0)


def busy_cache(r: Router, worker: str, blocks: int, first_hash: int) -> None:
    """``worker`` newly caches ``blocks`` blocks of other prompts."""
    tokens = [7 + i % 900 for i in range(first_hash, first_hash + blocks * B)]
    r.apply_kv(kv(worker, stored(list(range(first_hash, first_hash + blocks)), tokens)))


def test_a_new_conversation_goes_where_it_evicts_least() -> None:
    r = router(weights=CostWeights(eviction=2))
    for worker in ("a", "b"):
        r.apply_metrics(capacity(worker, 20))
    busy_cache(r, "a", 16, 1000)  # a cached 16 of the fleet's last 20 blocks
    busy_cache(r, "b", 4, 2000)
    r.apply_kv(kv("a", stored([1], PROMPT[:4])))  # ... and holds the shared first block
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "b", decision.explain()
    assert decision.runner_up == "a" and decision.excess == 0.0
    # Without the eviction term the one shared block would have pulled it to a.
    blind = router(weights=CostWeights(eviction=0))
    for worker in ("a", "b"):
        blind.apply_metrics(capacity(worker, 20))
    busy_cache(blind, "a", 16, 1000)
    busy_cache(blind, "b", 4, 2000)
    blind.apply_kv(kv("a", stored([1], PROMPT[:4])))
    assert blind.route(PROMPT).worker == "a"  # type: ignore[union-attr]


def test_a_cache_just_emptied_takes_new_conversations_again() -> None:
    """A reset or restart empties a worker's cache: its recent insertions evict nothing
    any more, so its eviction term drops at once (it kept pushing new work to the
    caches that were still full until those insertions aged out of the window)."""
    r = router(weights=CostWeights(eviction=2, kv_usage=0))
    for worker in ("a", "b"):
        r.apply_metrics(capacity(worker, 20))
    busy_cache(r, "a", 16, 1000)  # a cached 16 of the fleet's last 20 blocks
    busy_cache(r, "b", 4, 2000)
    r.apply_metrics(load("b", running=1))  # b is a little busier
    before = r.route(list(range(5000, 5033)))
    assert before is not None and before.worker == "b", before.explain()
    r.finished(before)
    r.apply_kv(kv("a", AllBlocksCleared()))
    after = r.route(list(range(6000, 6033)))
    assert after is not None and after.worker == "a", after.explain()
    assert after.excess == 0.0
    # Its blocks from before the clear leave the window without going negative, and
    # what it caches after the clear counts again.
    busy_cache(r, "b", 24, 3000)
    assert r.state.inserted[r.index.worker_number("a")] >= 0.0
    busy_cache(r, "a", 16, 4000)
    assert r.state.inserted[r.index.worker_number("a")] > 0.0


def test_a_held_conversation_stays_on_the_busier_cache() -> None:
    r = router()
    for worker in ("a", "b"):
        r.apply_metrics(capacity(worker, 10))
    busy_cache(r, "a", 16, 1000)
    busy_cache(r, "b", 4, 2000)
    r.apply_kv(kv("a", stored(list(range(1, 7)), PROMPT[:24])))  # 6 of its 8 blocks
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "a"
    assert decision.excess > 0 and decision.new_blocks == 2
    assert "-> a" in decision.explain() and "runner-up b" in decision.explain()


def test_capacity_shares_weigh_a_larger_cache_more() -> None:
    """b's cache is 3x a's: caching 3x as much is its fair share, not an excess."""
    r = router()
    r.apply_metrics(capacity("a", 10))
    r.apply_metrics(capacity("b", 30))
    busy_cache(r, "a", 5, 1000)
    busy_cache(r, "b", 15, 2000)
    decision = r.route(PROMPT)
    assert decision is not None and decision.excess == 0.0


def test_same_inputs_give_the_same_decisions() -> None:
    def decisions(seed: int) -> list[str]:
        r = Router(block_size=B, seed=seed, clock=Clock())
        for worker in "abcd":
            r.apply_metrics(load(worker))
        picks = []
        for i in range(40):
            decision = r.route([i % 5 + 10] * 12)
            assert decision is not None
            picks.append(decision.worker)
            r.finished(decision)
        return picks

    assert decisions(3) == decisions(3)
    assert len(set(decisions(3))) > 1


# --- load in blocks of prefill -----------------------------------------------------------


def test_prefill_queued_ahead_weighs_until_the_response_streams() -> None:
    clock = Clock()
    r = router(weights=CostWeights(queued=1, running=0.5, eviction=0), clock=clock)
    r.apply_kv(kv("a", stored([1, 2], PROMPT[:8])))  # a holds 2 of the prompt's 8 blocks
    ahead = r.route(list(range(500, 540)), exclude={"b"})  # 10 blocks to prefill on a
    assert ahead is not None and ahead.worker == "a"
    decision = r.route(PROMPT)  # 6 blocks on a behind 10 queued, or 8 on b
    assert decision is not None and decision.worker == "b", decision.explain()
    r.finished(decision)
    clock.now += r.linger + 0.1  # b never reported those blocks: forgotten
    r.apply_metrics(load("a"))
    r.apply_metrics(load("b"))
    r.started(ahead)  # a's prefill is done: a decode slot (0.5) is less than 2 blocks
    decision = r.route(PROMPT)
    assert decision is not None and decision.worker == "a", decision.explain()


def test_a_record_that_still_counts_this_routers_ended_request_is_not_foreign_load() -> None:
    clock = Clock()
    r = router(clock=clock)
    first = r.route(PROMPT, exclude={"b"})
    assert first is not None
    r.finished(first)
    r.apply_metrics(load("a", running=1))  # sent before the request ended
    same = r.route([7] * 12, exclude={"b"})
    assert same is not None and same.load == 0.0
    r.finished(same)
    clock.now += r.linger + 0.1  # a record this much later counts someone else's
    r.apply_metrics(load("a", running=1))
    later = r.route([8] * 12, exclude={"b"})
    assert later is not None and later.load == r.weights.waiting


def test_others_load_shows_though_this_router_just_ended_requests_there() -> None:
    """An engine whose record counts two requests of another router (or client), made
    after five of this router's ended there: all of the record is someone else's. (Its
    ends counted as its own for ``linger`` would hide every one of them.)"""
    clock = Clock()
    r = router(clock=clock)
    for i in range(5):
        mine = r.route([20 + i] * 12, exclude={"b"})
        assert mine is not None and mine.worker == "a"
        r.finished(mine)
    clock.now += 0.2
    r.apply_metrics(load("a", running=2, usage=0.1, ago=0.0))
    r.apply_metrics(load("b", usage=0.0))
    decision = r.route([9] * 12, exclude={"b"})
    assert decision is not None
    assert decision.load == pytest.approx(2 * r.weights.waiting + 0.1 * r.weights.kv_usage)
    elsewhere = r.route([9] * 12)
    assert elsewhere is not None and elsewhere.worker == "b", elsewhere.explain()


def test_a_record_made_while_this_routers_request_ran_counts_it_until_one_made_after() -> None:
    """The record arrives after the request's response ended (the bus is slower than
    HTTP), made while the request ran: its count is the request's. Once a record made
    after the end arrives, the ended request is in no record: a count there is someone
    else's, though the end is within ``linger``."""
    clock = Clock()
    r = router(clock=clock)
    first = r.route(PROMPT, exclude={"b"})
    assert first is not None
    clock.now += 0.5
    r.finished(first)
    r.apply_metrics(load("a", running=1, ago=0.3))  # made 0.2 s before the end
    again = r.route([7] * 12, exclude={"b"})
    assert again is not None and again.load == 0.0, again.explain()
    r.finished(again)
    clock.now += 0.3
    assert clock.now - 0.5 < 1000.0 + r.linger  # both ends still linger
    r.apply_metrics(load("a", running=1, ago=0.0))  # made 0.3 s after both ended
    later = r.route([8] * 12, exclude={"b"})
    assert later is not None and later.load == r.weights.waiting, later.explain()


def test_a_records_stamp_within_clock_skew_or_unreadable_lets_go_of_nothing() -> None:
    """Ends within `CLOCK_SKEW` before a record's stamp (hosts' clocks disagree that
    much) still count as in it, and every end where the stamp is not a number or before
    the end; a stamp in the future counts as now."""
    cases = ((0.02, True), (math.nan, True), (-1e9, True), (1e9, False), (0.1, False))
    for stamp_after_end, counted_as_ours in cases:
        clock = Clock()
        r = router(clock=clock)
        mine = r.route([5] * 12, exclude={"b"})
        assert mine is not None
        r.finished(mine)
        clock.now += 0.5
        # ``ago`` as the wall clock sees it: the end was 0.5 s ago (made 0.5 - after ago).
        r.apply_metrics(load("a", running=1, ago=0.5 - stamp_after_end))
        decision = r.route([6] * 12, exclude={"b"})
        assert decision is not None
        expected = 0.0 if counted_as_ours else r.weights.waiting
        assert decision.load == expected, (stamp_after_end, decision.explain())


def test_a_worker_that_sent_no_event_yet_is_routed_beside_offloaded_blocks() -> None:
    """With blocks off the GPU somewhere, a prompt whose deepest match was a worker
    holding only what was just routed to it (no event of its own yet) raised KeyError
    out of route()."""
    r = router()
    first = r.route(PROMPT)
    assert first is not None
    other = "b" if first.worker == "a" else "a"
    r.apply_kv(kv(other, BlockStored([1], None, PROMPT[:B], B, None, "CPU", None)))
    again = r.route(PROMPT)
    assert again is not None and again.worker == first.worker


def test_replicas_that_share_nothing_send_a_new_prefix_to_the_same_worker() -> None:
    """Rendezvous affinity: routers with other seeds, which met the workers in another
    order (other numbers), pick the same worker for a prefix none holds, and prefixes
    spread over the workers."""
    workers = ("w0", "w1", "w2", "w3")
    replicas, clock = [], Clock()
    for order, seed in ((workers, 1), (workers[::-1], 7), (workers[1:] + workers[:1], 99)):
        replica = Router("kv", block_size=B, seed=seed, clock=clock)
        for worker in order:
            replica.apply_metrics(load(worker))
        replicas.append(replica)
    picks = dict.fromkeys(workers, 0)
    for i in range(200):
        prompt = list(range(1000 * i, 1000 * i + 33))
        decisions = [replica.route(prompt) for replica in replicas]
        assert all(d is not None for d in decisions)
        chosen = {d.worker for d in decisions if d is not None}
        assert len(chosen) == 1, [d.explain() for d in decisions if d is not None]
        picks[chosen.pop()] += 1
        for replica, decision in zip(replicas, decisions, strict=True):
            assert decision is not None
            replica.finished(decision)
    assert min(picks.values()) >= 25, picks
    # The term is a tie-breaker: two blocks held elsewhere outweigh it.
    r = replicas[0]
    r.weights = CostWeights(eviction=0)  # (two blocks held by one worker: all its insertions)
    prompt = list(range(5000, 5033))
    favourite = r.route(prompt)
    assert favourite is not None
    r.finished(favourite)
    clock.now += r.linger + 0.1  # its blocks, never reported, are forgotten
    for worker in workers:
        r.apply_metrics(load(worker))
    other = next(w for w in workers if w != favourite.worker)
    r.apply_kv(kv(other, stored([1, 2], prompt[:8])))
    decision = r.route(prompt)
    assert decision is not None and decision.worker == other, decision.explain()


def test_a_load_record_names_the_block_size_before_any_event() -> None:
    """A router given no block size learned it from the first BlockStored: until then
    prompts had no keys, every worker tied at 0 held and a first burst scattered. The
    stat logger's load record now names it."""
    r = Router("kv", seed=1, clock=Clock())  # no block_size
    for worker in ("a", "b", "c", "d"):
        body = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
        r.apply_metrics(Message(worker, 1, 1, Kind.METRICS, 0.0, body, b"", 0))
    assert r.route(PROMPT) is not None and r.index.block_size is None  # blind, as before
    forged = (0, -4, 1 << 30)
    for size in (*forged, B):
        body = LoadMetrics(
            ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0, block_size=size
        )
        r.apply_metrics(Message("a", 1, 2, Kind.METRICS, 0.0, body, b"", 0))
        assert r.index.block_size == (B if size == B else None)
    burst = [r.route(PROMPT) for _ in range(8)]
    assert all(d is not None for d in burst)
    decided = [d for d in burst if d is not None]
    assert {d.worker for d in decided} == {decided[0].worker}
    assert [d.matched_tokens for d in decided][1:] == [32] * 7
    # The engines' own events decide once they come: a store of another size wins.
    r.apply_kv(kv("b", BlockStored([1], None, PROMPT[:8], 8, None, "GPU", None)))
    assert r.index.block_size == 8


class _Ended:
    """A request of this router, as `RequestsInFlight` counts it (`Routed`)."""

    def __init__(self, number: int) -> None:
        self.worker, self.number = "ab"[number], number
        self.keys: list[int] = []
        self.window_keys: list[int] = []
        self.window_ends: list[int] = []
        self.prefill_blocks, self.new_blocks = 0.0, 0
        self.streaming = self.ended = False
        self.routed_at, self.predicted_ttft = 0.0, math.nan
        self.peer, self.recompute_blocks = "", 0.0


@given(
    st.lists(
        st.tuples(st.sampled_from(["end", "record", "tick"]), st.integers(0, 1), st.floats(0, 1.5)),
        max_size=80,
    )
)
def test_an_ended_request_counts_until_a_record_made_after_it_or_its_linger_ends(
    steps: list[tuple[str, int, float]],
) -> None:
    """Against a model: each worker's ended requests that count as in its record are
    those that ended at or after the latest made of its records so far, within
    ``linger``; records arrive in any order of their making."""
    clock = Clock()
    requests = RequestsInFlight(PrefixIndex(B), clock, linger=1.0)
    ends: list[list[float]] = [[], []]
    made_by = [-math.inf, -math.inf]
    for step, number, seconds in steps:
        if step == "end":
            request = _Ended(number)
            requests.assign(request)
            requests.finished(request)
            ends[number].append(clock.now)
        elif step == "record":
            made = clock.now - seconds
            requests.counted_until(number, made)
            made_by[number] = max(made_by[number], made)
        else:
            clock.now += seconds
            requests.expire(clock.now)
            for n in (0, 1):
                ends[n] = [e for e in ends[n] if e + 1.0 > clock.now]
        for n in (0, 1):
            expected = sum(1 for e in ends[n] if e >= made_by[n])
            assert requests.ended_since_record(n) == expected
            assert requests.ours(n) == expected
