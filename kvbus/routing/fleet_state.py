"""What `kvbus.routing.router.Router` knows of its workers: load, freshness, capacity, recent
insertions and the requests in flight. The cost model (`kvbus.routing.cost`) reads it;
nothing here decides where a request goes.

Load is counted in the same unit as the prefix: a request this router sent that has not
started streaming yet (the caller says when it does: `Router.started`) still has its
uncached blocks to prefill, and the new request would wait for them; one that is
streaming costs a decode slot. Requests the router did not send (other routers, direct
clients) come from the engine's latest `LoadMetrics`, less this router's own: those in
flight, and those that ended after the record was made (its ``ts``, on the wall clock;
within ``linger`` seconds), which the record still counts. Those that ended before it
are in no record from then on: counting them as this router's would hide as many of
the others' (at a few of its requests a second, all of them).

Insertions feed the cost's eviction term: they are counted from the engines' own
``BlockStored`` events (decode blocks and other routers' traffic included) plus the
blocks of requests this router sent that have not ended, over a window of about one
fleet capacity of them. Capacity is each engine's ``LoadMetrics.kv_cache_blocks`` (or
the most blocks it was seen holding).

A request just routed adds its prompt's blocks to that worker's prefix at once
(until it finishes, then until the engine's events report them, ``linger`` seconds at
most, or until the engine's cache empties), so a
burst of similar requests does not all miss before the engine's events arrive. A worker
stops receiving traffic when its metrics are older than ``stale_after`` seconds (the
stat logger beats every 2 s), when it stops (`SourceStopped`), or for ``seconds`` after
`FleetState.mark_down`.

When the bus tells nothing of a worker (the bus is down, or its engine publishes under
another name), its load can come from its own endpoint instead (`apply_engine_load`),
taken as the bus's would be.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvbus.logs import LimitedLog, shown
from kvbus.routing.in_flight import RequestsInFlight, Routed
from kvbus.routing.index import MAX_BLOCK_SIZE, PrefixIndex
from kvbus.routing.pace import WorkerPace
from kvbus.wire.events import LoadMetrics

_limited = LimitedLog(logging.getLogger("kvbus.routing.router"))
MAX_KV_CACHE_BLOCKS: Final = 1 << 24
"""The most KV cache blocks a worker's load record may claim (vLLM's largest caches hold
a few million); a larger claim counts as this many (``Router.load_clamped``)."""

CLOCK_SKEW: Final = 0.05
"""Seconds: a request of this router that ended this long before a load record was made
(by the engine's wall clock against this host's) may still be in it. Hosts under NTP
agree to a few milliseconds; one host, exactly."""

LoadCost = Callable[[float, int, int, float], float]
"""A worker's load cost from (blocks this router's queued requests still prefill there,
its requests streaming there, other requests there, KV cache usage): the cost model's."""


class FleetState:
    """Per worker (by the index's number, so the index's holder masks address the
    arrays): its load cost, freshness, capacity and recent insertions, and this
    router's requests on it. The clock is the caller's (a test's fake one, say)."""

    def __init__(
        self,
        index: PrefixIndex,
        clock: Callable[[], float],
        stale_after: float,
        linger: float,
        load_cost: LoadCost,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.stale_after = stale_after
        self.load_clamped = 0
        """Load records with a figure out of range (`MAX_KV_CACHE_BLOCKS`, a KV usage
        outside 0..1 or not a number), applied with it clamped."""
        self._clock = clock
        self._wall = wall
        """the clock engines stamp their load records with (``LoadMetrics.ts``)"""
        self._load_cost = load_cost
        self.load_workers: dict[str, int] = {}
        """Workers that sent load records: only these may appear in peers' events."""
        self.load: npt.NDArray[np.float64] = np.full(16, np.inf)
        """load cost of each worker; inf: not eligible"""
        self.capacity = np.zeros(16)
        """KV cache blocks of each worker (reported, else the most seen held)"""
        self.fresh = np.zeros(16)
        """until when each worker's latest load record counts (0: none, or it stopped)"""
        self.inserted = np.zeros(16)
        """blocks each worker newly cached lately (the window below, plus in flight)"""
        self._window: deque[tuple[int, int]] = deque()
        """(worker, blocks) newly cached, oldest first, about a fleet capacity of them"""
        self._window_blocks = 0
        self._windowed: dict[int, int] = {}
        """worker -> its blocks in the window that still count in ``inserted``"""
        self._voided: dict[int, int] = {}
        """worker -> its oldest blocks in the window that no longer count (it emptied its
        cache since: blocks cached into free room evict nothing)"""
        self._stored_seen: dict[int, int] = {}
        self._metrics: dict[int, LoadMetrics] = {}
        self._heard: dict[int, float] = {}
        """worker -> when (clock) its latest load record on the bus was made"""
        self.from_engine: set[int] = set()
        """workers whose latest load record came from their own endpoint"""
        self._down_until: dict[int, float] = {}
        self.requests = RequestsInFlight(index, clock, linger)
        """this router's requests on each worker until they end, and their prompt blocks
        (``pending``, ``pending_masks``: what the cost model matches beside the index)"""
        self.pending = self.requests.pending
        self.pending_masks = self.requests.pending_masks
        self.window_pending_masks = self.requests.window_pending_masks
        self.pace = WorkerPace(clock=clock)
        """each worker's time to first token per block ahead, relative to the fleet's"""

    # --- what the engines say --------------------------------------------------------

    def count_insertions(self, worker: str) -> None:
        """``worker``'s kv batch was just applied to the index: count what it cached."""
        number = self.index.worker_number(worker)
        self._grow(number)
        stored = self.index.stored(number)
        added = stored - self._stored_seen.get(number, 0)
        self._stored_seen[number] = stored
        self.capacity[number] = max(self.capacity[number], self.index.resident(worker))
        if added <= 0:
            return
        self._window.append((number, added))
        self._window_blocks += added
        self._windowed[number] = self._windowed.get(number, 0) + added
        self.inserted[number] += added
        # The window spans about one fleet capacity of insertions: what an LRU cache as
        # large as the whole fleet would still hold. The fleet is the workers whose load
        # is fresh: a worker gone (or a source that sent one record) widens it no more.
        span = max(float(self.capacity[self.fresh > self._clock()].sum()), 1.0)
        while self._window_blocks - self._window[0][1] >= span:
            old, blocks = self._window.popleft()
            self._window_blocks -= blocks
            voided = self._voided.get(old, 0)
            if voided:  # its blocks from before a clear: no longer counted
                gone = min(voided, blocks)
                self._voided[old] = voided - gone
                blocks -= gone
            self._windowed[old] = self._windowed.get(old, 0) - blocks
            self.inserted[old] -= blocks

    def apply_load(self, worker: str, metrics: LoadMetrics, age: float) -> None:
        """A load record of ``worker`` from the bus, made ``age`` seconds ago."""
        metrics = self._checked(worker, metrics)
        number = self.index.worker_number(worker)
        self.load_workers[worker] = number
        self._grow(number)
        self._metrics[number] = metrics
        heard = self._clock() - max(0.0, age)
        self._heard[number] = heard
        self.from_engine.discard(number)
        self.fresh[number] = heard + self.stale_after
        self._made(number, metrics)
        if metrics.kv_cache_blocks > 0:
            self.capacity[number] = metrics.kv_cache_blocks
            # The index then holds no more of this worker's blocks than its engine can.
            self.index.set_capacity(worker, metrics.kv_cache_blocks)
        if 0 < metrics.block_size <= MAX_BLOCK_SIZE:
            # Prompts get keys before any engine's first store: else every worker ties
            # at 0 held and a first burst scatters before its blocks are pending anywhere.
            self.index.hint_block_size(metrics.block_size)
        self.refresh(number)

    def apply_engine_load(self, worker: str, metrics: LoadMetrics) -> None:
        """A load record of ``worker`` read from its own endpoint (see
        `kvbus.routing.router.Router.apply_engine_load`)."""
        number = self.index.worker_number(worker)
        self.load_workers[worker] = number
        self._grow(number)
        self._metrics[number] = self._checked(worker, metrics)
        self.from_engine.add(number)
        self.fresh[number] = self._clock() + self.stale_after
        self._made(number, metrics)
        self.refresh(number)

    def _made(self, number: int, metrics: LoadMetrics) -> None:
        """The worker's latest load record was made at ``metrics.ts`` (wall clock): this
        router's requests that ended before then no longer count as in it. A stamp in
        the future (a clock ahead) counts as now; one not a number, or far in the past
        (a replay, a forgery), lets go of none."""
        ago = self._wall() - metrics.ts
        if ago < math.inf:  # False for NaN
            made = self._clock() - max(ago, 0.0) - CLOCK_SKEW
            self.requests.counted_until(number, made)

    def load_age(self, worker: str) -> float:
        """Seconds since ``worker``'s latest load record on the bus was made (inf: none
        ever came), whatever its endpoint said since."""
        number = self.load_workers.get(worker)
        heard = None if number is None else self._heard.get(number)
        return math.inf if heard is None else self._clock() - heard

    def engine_loaded(self) -> list[str]:
        """Workers that may get traffic now on a load record from their own endpoint."""
        now = self._clock()
        return sorted(
            self.index.worker_name(n)
            for n in self.from_engine
            if self.fresh[n] > now and np.isfinite(self.load[n])
        )

    def _checked(self, worker: str, metrics: LoadMetrics) -> LoadMetrics:
        """``metrics`` with the figures the cost reads brought into range: a capacity
        past `MAX_KV_CACHE_BLOCKS` would widen the insertion window past any fleet's
        (it would never trim), a usage below 0 would draw every request, a NaN would
        make the cost NaN. Counted (`load_clamped`) and logged (rate-limited)."""
        blocks, usage = metrics.kv_cache_blocks, metrics.kv_cache_usage
        if blocks <= MAX_KV_CACHE_BLOCKS and 0.0 <= usage <= 1.0:  # False for NaN
            return metrics
        self.load_clamped += 1
        _limited.warning(
            "load",
            "load record of %s out of range (kv_cache_blocks %d, kv_cache_usage %r): clamped",
            shown(worker),
            blocks,
            usage,
        )
        return msgspec.structs.replace(
            metrics,
            kv_cache_blocks=min(blocks, MAX_KV_CACHE_BLOCKS),
            kv_cache_usage=1.0 if math.isnan(usage) else min(max(usage, 0.0), 1.0),
        )

    def stopped(self, worker: str, ts: float) -> None:
        """The worker's engine stopped (at ``ts``): no traffic until its next load
        record. A stop older than the latest record (a past run's, replayed from
        history) is news of nothing."""
        number = self.index.worker_number(worker)
        metrics = self._metrics.get(number)
        if metrics is not None and metrics.ts > ts:
            return
        self._grow(number)
        self.fresh[number] = 0.0
        self.pace.forget(number)  # a restarted engine may run on other hardware
        self.refresh(number)

    def mark_down(self, worker: str, seconds: float) -> None:
        """Send ``worker`` nothing for ``seconds``."""
        number = self.index.worker_number(worker)
        self._down_until[number] = self._clock() + seconds
        self.refresh(number)

    def _grow(self, number: int) -> None:
        """Make room for worker ``number`` in the per-worker arrays."""
        size = len(self.load)
        if number < size:
            return
        size = max(number + 1, 2 * size)
        self.load = np.concatenate([self.load, np.full(size - len(self.load), np.inf)])
        self.capacity = np.concatenate([self.capacity, np.zeros(size - len(self.capacity))])
        self.fresh = np.concatenate([self.fresh, np.zeros(size - len(self.fresh))])
        self.inserted = np.concatenate([self.inserted, np.zeros(size - len(self.inserted))])

    def refresh(self, number: int) -> None:
        """Recompute one worker's load cost (inf when it may not get traffic)."""
        self._grow(number)
        now = self._clock()
        metrics = self._metrics.get(number)
        if metrics is None or self.fresh[number] <= now or self._down_until.get(number, 0.0) > now:
            self.load[number] = np.inf
            return
        queued_blocks = self.queued_blocks(number)
        streaming = self.requests.streaming(number)
        self.load[number] = self._load_cost(
            queued_blocks, streaming, self._others(number, metrics), metrics.kv_cache_usage
        )

    def _others(self, number: int, metrics: LoadMetrics) -> int:
        """Requests on the worker that this router did not send (the engine's count,
        less this router's: its queued, streaming and ended since the record)."""
        return max(0, metrics.running + metrics.waiting - self.requests.ours(number))

    def busy(self, number: int) -> int:
        """Requests a new one would share the worker's steps with, besides the prefill
        queued ahead of it: this router's streaming there and everyone else's."""
        metrics = self._metrics.get(number)
        others = self._others(number, metrics) if metrics is not None else 0
        return self.requests.streaming(number) + others

    # --- who may get traffic ---------------------------------------------------------

    def eligible_load(self, now: float, exclude: Collection[str]) -> npt.NDArray[np.float64]:
        """Each worker's load cost, inf for those that may not get traffic now."""
        # A worker whose metrics went stale since they arrived is out, of the pick and
        # of the fleet the eviction term compares with, until its next record.
        load = np.where(self.fresh > now, self.load, np.inf)
        for name in exclude:
            number = self.index.worker_number(name)
            if number < len(load):
                load[number] = np.inf
        return load

    def eligible(self) -> list[str]:
        """Workers that may get traffic now."""
        now = self._clock()
        return [
            self.index.worker_name(int(n))
            for n in np.flatnonzero(np.isfinite(self.load))
            if self.fresh[n] > now
        ]

    # --- requests in flight ----------------------------------------------------------

    @property
    def linger(self) -> float:
        return self.requests.linger

    @linger.setter
    def linger(self, seconds: float) -> None:
        self.requests.linger = seconds

    def behind(self, number: int, now: float) -> tuple[float, float]:
        """How far a worker runs behind right now, from this router's oldest request
        there not yet started: its age (seconds; 0 for none), and the seconds it is
        late (its age less its `predicted_ttft`, once past it; 0 when not, or when
        nothing was predicted for it). A queue that grows faster than the pace's fit
        learns (it learns only from first tokens, which stop coming once the queue is
        past every client's patience) shows here at once. Late by seconds, not by a
        factor: a factor over a prediction of a few milliseconds (a young fit's) is
        noise, and would shed a healthy worker's traffic."""
        oldest = self.requests.oldest_unstarted(number)
        if oldest is None:
            return 0.0, 0.0
        age = now - oldest.routed_at
        late = age - oldest.predicted_ttft  # NaN when nothing was predicted
        return age, late if late > 0 else 0.0

    def queued_blocks(self, number: int) -> float:
        """Blocks this router's requests not streaming yet still prefill on a worker."""
        return self.requests.queued_blocks(number)

    def assign(self, request: Routed) -> None:
        """Count ``request`` on its worker until it finishes: queued for prefill, its
        blocks about to be cached there."""
        self.inserted[request.number] += request.new_blocks
        self.requests.assign(request)
        self.refresh(request.number)

    def prefilled_elsewhere(self, request: Routed) -> None:
        """``request`` has its prompt computed on another worker (P/D): no prefill of
        its own is queued on its worker."""
        self.requests.prefilled_elsewhere(request)
        self.refresh(request.number)

    def started(self, request: Routed) -> None:
        """``request`` started streaming (not yet marked so): its prefill is done."""
        self.requests.started(request)
        self.refresh(request.number)

    def finished(self, request: Routed) -> None:
        """``request`` ended (any way): its load goes now, its prefix blocks stay
        assumed for ``linger`` seconds, until the engine's events tell."""
        number = request.number
        # Its new blocks are in the engine's events by now (or were never cached).
        self.inserted[number] = max(0.0, self.inserted[number] - request.new_blocks)
        request.new_blocks = 0
        self.requests.finished(request)
        self.refresh(number)

    def expire(self, now: float) -> None:
        """Let go of what ended more than ``linger`` seconds before ``now``."""
        for number in self.requests.expire(now):
            self.refresh(number)

    def cleared(self, worker: str, preempted: bool = False) -> None:
        """``worker``'s engine emptied its cache (a reset, a restart): the blocks its
        finished requests left assumed there (``linger``) are gone, as its events say.
        Requests still in flight keep theirs: they cache them after the clear. Its
        recent insertions no longer count in the eviction term: its next blocks go into
        free room and evict nothing. ``preempted`` (a reset, the engine still up): its
        requests in flight compute their whole prompts again, queued ahead of new ones
        (`kvbus.routing.in_flight.RequestsInFlight.requeue`)."""
        number = self.index.worker_number(worker)
        self.requests.cleared(number, preempted)
        if preempted:
            self.refresh(number)
        windowed = self._windowed.pop(number, 0)
        if windowed:
            self._grow(number)
            self.inserted[number] = max(0.0, self.inserted[number] - windowed)
            self._voided[number] = self._voided.get(number, 0) + windowed
