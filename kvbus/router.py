"""`Router`: picks the worker for each request from the prefix it holds, the room in
its cache and its load.

Feed it every item of two subscriptions, the kv stream (`Router.apply_kv`) and the
metrics stream (`Router.apply_metrics`); ask `Router.route` for a prompt's token ids. A
worker is a kvbus source (``NAME/dp<rank>`` for vLLM engines).

Cost of a worker for a request, in blocks of prefill (lowest wins; ties drawn by a
seeded generator, so the same inputs give the same decisions)::

    prefill  * blocks it would compute + queued * blocks queued ahead of them there
  + eviction * blocks it would newly cache * its excess share of recent insertions
  + running  * requests of this router decoding there
  + waiting  * other requests there (the engine's running + waiting, less this router's)
  + kv_usage * its KV cache usage (0..1)

Load is counted in the same unit as the prefix: a request this router sent that has not
started streaming yet (the caller says when it does: `Router.started`) still has its
uncached blocks to prefill, and the new request would wait for them; one that is
streaming costs a decode slot. Requests the router did not send (other routers, direct
clients) come from the engine's latest `LoadMetrics`, less this router's own (those that
ended within ``linger`` seconds included: the engine's record may predate their end).

The eviction term keeps the fleet's caches working as one. Every block a worker newly
caches evicts its least recently used one, so a worker that caches more than its share
(its KV capacity over the fleet's) of what the fleet cached lately keeps its blocks for a
shorter time than the others: its cache thrashes while theirs sit idle. Its *excess*
(its share of the fleet's newly cached blocks, over the last fleet-capacity of them,
divided by its capacity share, less one; zero at or below its share) makes its new blocks
dearer, so a new conversation goes where it evicts least while a conversation whose
prefix a worker holds stays there. Insertions are counted from the engines' own
``BlockStored`` events (decode blocks and other routers' traffic included) plus the
blocks of requests this router sent that have not ended. Capacity is each engine's
``LoadMetrics.kv_cache_blocks`` (or the most blocks it was seen holding).

A request just routed adds its prompt's blocks to that worker's prefix at once
(until it finishes, plus ``linger`` seconds), so a burst of similar requests does not
all miss before the engine's events arrive. A worker stops receiving traffic when its
metrics are older than ``stale_after`` seconds (the stat logger beats every 2 s), when
it stops (`SourceStopped`), or for ``seconds`` after `mark_down`.

When the bus tells nothing of a worker (the bus is down, or its engine publishes under
another name), its load can come from its own endpoint instead: `apply_engine_load`
takes a record read from the engine's ``/metrics`` as the bus's would be taken, and the
worker stays eligible while its endpoint answers (`load_age` says whose bus record is
getting old; `Decision.engine_load` marks decisions made on such a record).

Every `Decision` carries its terms and the runner-up (`Decision.explain`).

Requires numpy (the ``router`` extra): one vectorised pass over every worker keeps a
decision at a few tens of microseconds beyond the index lookup with 1,000 workers.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvbus.envelope import Kind
from kvbus.events import LoadMetrics, RouteEvent, SourceStopped
from kvbus.index import DEFAULT_MEDIUM_WEIGHTS, PrefixIndex, mask_numbers
from kvbus.logs import LimitedLog, shown
from kvbus.subscribe import Message, Resync, ResyncReason

log = logging.getLogger("kvbus.router")
_limited = LimitedLog(log)
_MASK_CACHE: Final = 256
_FEW: Final = 64
MAX_PEER_REQUESTS: Final = 100_000
"""Other replicas' requests in flight kept at most (all replicas together)."""
MAX_PEER_KEYS: Final = 16_384
"""Blocks of one peer request kept at most (a 512k-token prompt of 32-token blocks)."""
MAX_PEERS: Final = 1024
"""Other replicas with requests in flight kept at most: a request routed by one more is
refused (``Router.peer_rejected``). A replica whose requests all ended takes no room."""
MAX_KV_CACHE_BLOCKS: Final = 1 << 24
"""The most KV cache blocks a worker's load record may claim (vLLM's largest caches hold
a few million); a larger claim counts as this many (``Router.load_clamped``)."""


class Policy(str, enum.Enum):
    KV = "kv"
    """Lowest cost: prefix held and load (see the module docstring)."""
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


class CostWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Weights of the routing cost, in blocks of prefill."""

    prefill: float = 1.0
    queued: float = 0.1
    """Per block still to prefill for requests of this router queued on the worker. 1
    would minimise each request's own TTFT; lower keeps conversations where their
    prefix is, which saves the fleet the recompute (on a busy fleet, where queues form,
    that compute delays every request)."""
    eviction: float = 0.5
    """Per block newly cached, per unit of the worker's excess share of insertions (a
    block evicted from a cache's tail is rarely worth a whole block of prefill)."""
    waiting: float = 4.0
    """Per request on the worker that this router did not send."""
    running: float = 0.5
    """Per request of this router that is streaming there (decoding): a decode step
    costs the next prefill little."""
    kv_usage: float = 8.0


class Decision(msgspec.Struct, kw_only=True):
    """Where one request goes and what the router expects the engine to find cached."""

    worker: str
    policy: Policy
    prompt_tokens: int
    matched_tokens: int
    """Prefix tokens the worker holds (by the index, plus requests just routed there)."""
    predicted_cached_tokens: int
    """What the engine should report as ``cached_tokens``: the matched full blocks, less
    the last one when the whole prompt matched (vLLM always computes one token)."""
    cost: float
    prefill_blocks: float = 0.0
    """Blocks the worker would compute (held ones off the GPU count in part)."""
    new_blocks: int = 0
    """Blocks the worker would newly cache."""
    excess: float = 0.0
    """The worker's share of recent insertions over its capacity share, less one."""
    load: float = 0.0
    """The load part of ``cost``."""
    runner_up: str | None = None
    runner_up_cost: float = math.inf
    streaming: bool = False
    """Whether `Router.started` was told the response is streaming."""
    keys: list[int] = []
    """The prompt's block keys, added to the worker's prefix while the request runs."""
    number: int = -1
    request: int = 0
    """This router's number for the request, when it shares its routes (``share``)."""
    peer: str = ""
    """The replica that routed it, for another replica's request; "" for this one's."""
    engine_load: bool = False
    """The worker's load came from its own endpoint (`Router.apply_engine_load`), not
    from the bus: the bus was down or told nothing of it."""

    def explain(self) -> str:
        """One line: the pick, its terms and the runner-up."""
        why = (
            f"{self.policy.value} -> {self.worker}: cost {self.cost:.2f} = prefill "
            f"{self.prefill_blocks:.2f} of {self.prompt_tokens} tokens (holds "
            f"{self.matched_tokens}) + evicting {self.new_blocks} at excess "
            f"{self.excess:.2f} + load {self.load:.2f}"
        )
        if self.runner_up is not None:
            why += f"; runner-up {self.runner_up} at {self.runner_up_cost:.2f}"
        return why


class Router:
    def __init__(
        self,
        policy: Policy | str = Policy.KV,
        weights: CostWeights | None = None,
        block_size: int | None = None,
        stale_after: float = 5.0,
        linger: float = 1.0,
        medium_weights: dict[str, float] | None = None,
        seed: int | None = 0,
        clock: Callable[[], float] = time.monotonic,
        share: Callable[[RouteEvent], object] | None = None,
        replica: str | None = None,
        peer_timeout: float = 600.0,
    ) -> None:
        self.policy = Policy(policy)
        self.share = share
        """Called with each `RouteEvent` of this router's requests (replicas: publish
        them on the routes stream for the others' `apply_routes`)."""
        self.replica = replica
        """This router's source on the routes stream (its own events are skipped)."""
        self.peer_timeout = peer_timeout
        """Seconds another replica's request counts at most (its end may be lost)."""
        self.peer_rejected = 0
        """Peer events refused: unknown worker, too many keys, requests in flight or
        peers (`MAX_PEER_KEYS`, `MAX_PEER_REQUESTS`, `MAX_PEERS`)."""
        self.load_clamped = 0
        """Load records with a figure out of range (`MAX_KV_CACHE_BLOCKS`, a KV usage
        outside 0..1 or not a number), applied with it clamped."""
        self._requests = itertools.count(1)
        self._peer_requests: dict[str, dict[int, Decision]] = {}
        """peer -> its requests in flight (only peers that have some)"""
        self._peer_count = 0
        self._peer_deadlines: OrderedDict[tuple[str, int], float] = OrderedDict()
        """(peer, request) -> when it stops counting, soonest first (one timeout for
        all, so arrival order is deadline order); an ended request leaves at once."""
        self._load_workers: dict[str, int] = {}
        """Workers that sent load records: only these may appear in peers' events."""
        self.weights = weights or CostWeights()
        self.index = PrefixIndex(block_size, medium_weights or DEFAULT_MEDIUM_WEIGHTS)
        self.stale_after = stale_after
        self.linger = linger
        self._rng = random.Random(seed)
        self._clock = clock
        # Per worker number (the index's), so the index's holder masks address these.
        self._load: npt.NDArray[np.float64] = np.full(16, np.inf)
        """load cost of each worker; inf: not eligible"""
        self._capacity = np.zeros(16)
        """KV cache blocks of each worker (reported, else the most seen held)"""
        self._fresh = np.zeros(16)
        """until when each worker's latest load record counts (0: none, or it stopped)"""
        self._inserted = np.zeros(16)
        """blocks each worker newly cached lately (the window below, plus in flight)"""
        self._window: deque[tuple[int, int]] = deque()
        """(worker, blocks) newly cached, oldest first, about a fleet capacity of them"""
        self._window_blocks = 0
        self._stored_seen: dict[int, int] = {}
        self._metrics: dict[int, LoadMetrics] = {}
        self._heard: dict[int, float] = {}
        """worker -> when (clock) its latest load record on the bus was made"""
        self._from_engine: set[int] = set()
        """workers whose latest load record came from their own endpoint"""
        self._down_until: dict[int, float] = {}
        self._queued: dict[int, list[float]] = {}
        """worker -> [requests of this router not streaming yet, their blocks to prefill]"""
        self._streaming: dict[int, int] = {}
        """worker -> requests of this router streaming (decoding)"""
        self._pending: dict[int, dict[int, int]] = {}
        """worker -> {block key of a request in flight -> requests}"""
        self._pending_masks: dict[int, int] = {}
        """block key -> mask of the workers it is pending on (index-style, for matching)"""
        self._finishing: deque[tuple[float, Decision]] = deque()
        self._ended: deque[tuple[float, int]] = deque()
        """(until, worker) of requests of this router that ended less than ``linger``
        ago: the engine's next load record may still count them"""
        self._ended_count: dict[int, int] = {}
        self._members: dict[int, npt.NDArray[np.intp]] = {}
        self._turn = 0

    # --- feeding ---------------------------------------------------------------------

    def apply_kv(self, item: Message | Resync) -> None:
        """Apply one item of the kv stream (blocks held; restarts and losses clear)."""
        self.index.apply(item)
        if isinstance(item, Resync):
            return
        if item.kind == Kind.KV:  # its body left undecoded: the index read its payload
            self._count_insertions(item.source)
        elif isinstance(item.body, SourceStopped):
            self._stopped(item)

    def _count_insertions(self, worker: str) -> None:
        number = self.index.worker_number(worker)
        self._grow(number)
        stored = self.index.stored(number)
        added = stored - self._stored_seen.get(number, 0)
        self._stored_seen[number] = stored
        self._capacity[number] = max(self._capacity[number], self.index.resident(worker))
        if added <= 0:
            return
        self._window.append((number, added))
        self._window_blocks += added
        self._inserted[number] += added
        # The window spans about one fleet capacity of insertions: what an LRU cache as
        # large as the whole fleet would still hold. The fleet is the workers whose load
        # is fresh: a worker gone (or a source that sent one record) widens it no more.
        span = max(float(self._capacity[self._fresh > self._clock()].sum()), 1.0)
        while self._window_blocks - self._window[0][1] >= span:
            old, blocks = self._window.popleft()
            self._window_blocks -= blocks
            self._inserted[old] -= blocks

    def apply_metrics(self, item: Message | Resync, age: float = 0.0) -> None:
        """Apply one item of the metrics stream (load; liveness). ``age``: seconds the
        record had already waited (a record read back from history), less freshness."""
        if not isinstance(item, Message):
            return  # lost load records: the next one replaces them anyway
        if isinstance(item.body, LoadMetrics):
            metrics = self._checked(item.source, item.body)
            number = self.index.worker_number(item.source)
            self._load_workers[item.source] = number
            self._grow(number)
            self._metrics[number] = metrics
            heard = self._clock() - max(0.0, age)
            self._heard[number] = heard
            self._from_engine.discard(number)
            self._fresh[number] = heard + self.stale_after
            if metrics.kv_cache_blocks > 0:
                self._capacity[number] = metrics.kv_cache_blocks
                # The index then holds no more of this worker's blocks than its engine can.
                self.index.set_capacity(item.source, metrics.kv_cache_blocks)
            self._refresh(number)
        elif isinstance(item.body, SourceStopped):
            self._stopped(item)

    def apply_engine_load(self, worker: str, metrics: LoadMetrics) -> None:
        """A load record of ``worker`` read from its own endpoint (its engine's
        ``/metrics``), for when the bus tells nothing of it: taken as a bus record would
        be (fresh for ``stale_after`` seconds), its capacity left as the bus last said.
        The next record on the bus replaces it."""
        number = self.index.worker_number(worker)
        self._load_workers[worker] = number
        self._grow(number)
        self._metrics[number] = self._checked(worker, metrics)
        self._from_engine.add(number)
        self._fresh[number] = self._clock() + self.stale_after
        self._refresh(number)

    def load_age(self, worker: str) -> float:
        """Seconds since ``worker``'s latest load record on the bus was made (inf: none
        ever came), whatever its endpoint said since."""
        number = self._load_workers.get(worker)
        heard = None if number is None else self._heard.get(number)
        return math.inf if heard is None else self._clock() - heard

    def engine_loaded(self) -> list[str]:
        """Workers that may get traffic now on a load record from their own endpoint."""
        now = self._clock()
        return sorted(
            self.index.worker_name(n)
            for n in self._from_engine
            if self._fresh[n] > now and np.isfinite(self._load[n])
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

    def _stopped(self, item: Message) -> None:
        """The worker's engine stopped: no traffic until its next load record. A stop
        older than the latest record (a past run's, replayed from history) is news of
        nothing."""
        number = self.index.worker_number(item.source)
        metrics = self._metrics.get(number)
        if metrics is not None and metrics.ts > item.ts:
            return
        self._grow(number)
        self._fresh[number] = 0.0
        self._refresh(number)

    def mark_down(self, worker: str, seconds: float) -> None:
        """Send ``worker`` nothing for ``seconds`` (it refused a connection, say)."""
        number = self.index.worker_number(worker)
        self._down_until[number] = self._clock() + seconds
        self._refresh(number)

    def _grow(self, number: int) -> None:
        """Make room for worker ``number`` in the per-worker arrays."""
        size = len(self._load)
        if number < size:
            return
        size = max(number + 1, 2 * size)
        self._load = np.concatenate([self._load, np.full(size - len(self._load), np.inf)])
        self._capacity = np.concatenate([self._capacity, np.zeros(size - len(self._capacity))])
        self._fresh = np.concatenate([self._fresh, np.zeros(size - len(self._fresh))])
        self._inserted = np.concatenate([self._inserted, np.zeros(size - len(self._inserted))])

    def _refresh(self, number: int) -> None:
        """Recompute one worker's load cost (inf when it may not get traffic)."""
        self._grow(number)
        now = self._clock()
        metrics = self._metrics.get(number)
        if metrics is None or self._fresh[number] <= now or self._down_until.get(number, 0.0) > now:
            self._load[number] = np.inf
            return
        w = self.weights
        queued, queued_blocks = self._queued.get(number) or (0, 0.0)
        streaming = self._streaming.get(number, 0)
        ours = int(queued) + streaming + self._ended_count.get(number, 0)
        others = max(0, metrics.running + metrics.waiting - ours)
        self._load[number] = (
            w.queued * queued_blocks
            + w.running * streaming
            + w.waiting * others
            + w.kv_usage * metrics.kv_cache_usage
        )

    # --- routing ---------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        exclude: Collection[str] = (),
    ) -> Decision | None:
        """The worker for a prompt (``None``: no worker may get traffic). Call
        `finished` with the decision when the request ends."""
        now = self._clock()
        self._expire(now)
        keys = self.index.keys(token_ids, lora_name, extra_keys)
        # A worker whose metrics went stale since they arrived is out, of the pick and
        # of the fleet the eviction term compares with, until its next record.
        load = np.where(self._fresh > now, self._load, np.inf)
        for name in exclude:
            number = self.index.worker_number(name)
            if number < len(load):
                load[number] = np.inf
        decision = self._choose(load, keys, len(token_ids))
        if decision is None:
            return None
        self._assign(decision)
        if self.share is not None:
            decision.request = next(self._requests)
            self.share(
                RouteEvent(
                    ts=time.time(),
                    request=decision.request,
                    phase="routed",
                    worker=decision.worker,
                    keys=keys,
                    prefill_blocks=decision.prefill_blocks,
                    new_blocks=decision.new_blocks,
                )
            )
        return decision

    def _assign(self, decision: Decision) -> None:
        """Count ``decision``'s request on its worker until it finishes: queued for
        prefill, its blocks about to be cached there."""
        number = decision.number
        queued = self._queued.setdefault(number, [0, 0.0])
        queued[0] += 1
        queued[1] += decision.prefill_blocks
        self._inserted[number] += decision.new_blocks
        pending = self._pending.setdefault(number, {})
        masks, bit = self._pending_masks, 1 << number
        for key in decision.keys:
            count = pending.get(key, 0)
            if not count:
                masks[key] = masks.get(key, 0) | bit
            pending[key] = count + 1
        self._refresh(number)

    def _choose(
        self, load: npt.NDArray[np.float64], keys: list[int], prompt_tokens: int
    ) -> Decision | None:
        eligible = np.flatnonzero(np.isfinite(load))
        if not len(eligible):
            return None
        if self.policy is not Policy.KV:
            if self.policy is Policy.ROUND_ROBIN:
                self._turn += 1
                number = int(eligible[self._turn % len(eligible)])
            else:
                number = int(self._rng.choice(eligible))
            held = self._depth(number, keys)
            return self._decide(number, keys, held, prompt_tokens, float(load[number]))
        depth = self._depths(keys, len(load))
        saved = self._weighted(depth, keys) if self.index.offloaded else depth
        w = self.weights
        new = len(keys) - depth
        excess = self._excess(eligible, len(load))
        cost = load + w.prefill * (len(keys) - saved) + w.eviction * new * excess
        best = float(cost.min())
        ties = np.flatnonzero(cost <= best + 1e-9)
        number = int(ties[0] if len(ties) == 1 else self._rng.choice(ties))
        decision = self._decide(number, keys, int(depth[number]), prompt_tokens, best)
        decision.prefill_blocks = float(len(keys) - saved[number])
        decision.excess = float(excess[number])
        cost[number] = np.inf
        second = int(cost.argmin())
        if np.isfinite(cost[second]):
            decision.runner_up = self.index.worker_name(second)
            decision.runner_up_cost = float(cost[second])
        return decision

    def _excess(self, eligible: npt.NDArray[np.intp], size: int) -> npt.NDArray[np.float64]:
        """Per worker: its share of the blocks the eligible workers newly cached lately,
        over its share of their capacity, less one (zero when at or below its share);
        scaled down while those blocks would not yet fill the fleet's caches (a block
        cached into free room evicts nothing)."""
        excess = np.zeros(size)
        inserted = self._inserted[eligible]
        total = float(inserted.sum())
        if total <= 0:
            return excess
        capacity = self._capacity[eligible]
        known = capacity > 0
        # A worker of unknown capacity counts as the average known one (or all equal).
        capacity = np.where(known, capacity, capacity[known].mean() if known.any() else 1.0)
        fleet = float(capacity.sum())
        share = (inserted / total) / (capacity / fleet)
        excess[eligible] = np.maximum(share - 1.0, 0.0) * min(1.0, total / fleet)
        return excess

    def _depths(self, keys: list[int], size: int) -> npt.NDArray[np.float64]:
        """Leading blocks of ``keys`` each worker holds or is about to (requests just
        routed to it)."""
        depth = np.zeros(size)
        for mask, blocks in self.index.match_masks(keys, self._pending_masks):
            depth[self._numbers(mask)] = blocks  # shallowest first: deeper overwrite
        return depth

    def _weighted(self, depth: npt.NDArray[np.float64], keys: list[int]) -> npt.NDArray[np.float64]:
        """``depth`` with blocks held only off the GPU counted at their medium's weight,
        for the few deepest workers (enough to rank the best candidates)."""
        saved = depth.copy()
        top = int(depth.max())
        deepest = np.flatnonzero(depth == top)
        if top and len(deepest) <= _FEW:
            for number in deepest:
                pending = self._pending.get(int(number), {})
                name = self.index.worker_name(int(number))
                stored = [k for k in keys[:top] if k not in pending]
                saved[number] = top - len(stored) + self.index.weighted_blocks(name, stored)
        return saved

    def _depth(self, number: int, keys: list[int]) -> int:
        """Leading blocks of ``keys`` one worker holds or is about to."""
        groups = self.index.match_masks(keys, self._pending_masks)
        return next((blocks for mask, blocks in reversed(groups) if mask >> number & 1), 0)

    def _numbers(self, mask: int) -> npt.NDArray[np.intp]:
        """The worker numbers in a holder mask (large ones recur: cached)."""
        if mask.bit_count() <= _FEW:
            return np.array(mask_numbers(mask), dtype=np.intp)
        found = self._members.get(mask)
        if found is None:
            if len(self._members) >= _MASK_CACHE:
                self._members.clear()
            raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
            found = self._members[mask] = np.flatnonzero(np.unpackbits(raw, bitorder="little"))
        return found

    def _decide(
        self, number: int, keys: list[int], blocks: int, prompt_tokens: int, cost: float
    ) -> Decision:
        block_size = self.index.block_size or 0
        matched = blocks * block_size
        # vLLM computes at least the last prompt token, so a fully cached prompt reports
        # its last block as computed (whole blocks only).
        cap = (prompt_tokens - 1) // block_size * block_size if block_size else 0
        return Decision(
            worker=self.index.worker_name(number),
            policy=self.policy,
            prompt_tokens=prompt_tokens,
            matched_tokens=matched,
            predicted_cached_tokens=min(matched, max(cap, 0)),
            cost=cost,
            prefill_blocks=float(len(keys) - blocks),
            new_blocks=len(keys) - blocks,
            load=float(self._load[number]),
            keys=keys,
            number=number,
            engine_load=number in self._from_engine,
        )

    def started(self, decision: Decision) -> None:
        """The request of ``decision`` started streaming: its prefill is done."""
        if decision.streaming:
            return
        decision.streaming = True
        number = decision.number
        queued = self._queued[number]
        queued[0] -= 1
        queued[1] = max(0.0, queued[1] - decision.prefill_blocks)
        self._streaming[number] = self._streaming.get(number, 0) + 1
        self._refresh(number)
        self._tell(decision, "started")

    def _tell(self, decision: Decision, phase: str) -> None:
        if self.share is not None and decision.request and not decision.peer:
            self.share(RouteEvent(ts=time.time(), request=decision.request, phase=phase))

    def finished(self, decision: Decision) -> None:
        """The request of ``decision`` ended (any way): its load goes now, its prefix
        blocks stay assumed for ``linger`` seconds, until the engine's events tell."""
        self._tell(decision, "finished")
        number = decision.number
        if decision.streaming:
            self._streaming[number] -= 1
        else:
            queued = self._queued[number]
            queued[0] -= 1
            queued[1] = max(0.0, queued[1] - decision.prefill_blocks)
        # Its new blocks are in the engine's events by now (or were never cached).
        self._inserted[number] = max(0.0, self._inserted[number] - decision.new_blocks)
        decision.new_blocks = 0
        now = self._clock()
        self._ended.append((now + self.linger, number))
        self._ended_count[number] = self._ended_count.get(number, 0) + 1
        self._refresh(number)
        # Blocks the engine's events already reported are the index's business from now
        # on (they may be evicted as soon as the request ends); the rest linger.
        held: list[int] = []
        unconfirmed: list[int] = []
        for key in decision.keys:
            (held if self.index.holds(decision.worker, key) else unconfirmed).append(key)
        self._release(number, held)
        if unconfirmed:
            decision.keys = unconfirmed
            self._finishing.append((now + self.linger, decision))

    # --- other replicas ----------------------------------------------------------------

    def apply_routes(self, item: Message | Resync) -> None:
        """Apply one item of the routes stream: another replica's request routed,
        started or finished counts as if this router had routed it. A replica that
        restarted or stopped takes its requests with it; one whose end was lost counts
        for ``peer_timeout`` seconds at most."""
        if item.source == self.replica:
            return
        # Expiry runs here too, not only when routing: a replica that routes nothing
        # would keep every peer request's blocks (and their lingering ends) for good.
        self._expire(self._clock())
        if isinstance(item, Resync):
            if item.reason is ResyncReason.NEW_EPOCH:
                self._forget_peer(item.source)
            return
        body = item.body
        if isinstance(body, SourceStopped):
            self._forget_peer(item.source)
            return
        if not isinstance(body, RouteEvent):
            return
        if body.phase == "routed":
            self._add_peer_request(item.source, body)
            return
        decision = self._peer_requests.get(item.source, {}).get(body.request)
        if decision is None:
            return
        if body.phase == "started":
            self.started(decision)
        elif body.phase == "finished":
            self._drop_peer_request(decision)
            self.finished(decision)

    def _add_peer_request(self, peer: str, event: RouteEvent) -> None:
        number = self._load_workers.get(event.worker)
        requests = self._peer_requests.get(peer)
        if (
            number is None
            or len(event.keys) > MAX_PEER_KEYS
            or self._peer_count >= MAX_PEER_REQUESTS
            or (requests is None and len(self._peer_requests) >= MAX_PEERS)
            or (requests is not None and event.request in requests)
        ):
            self.peer_rejected += 1
            return
        blocks = len(event.keys)
        prefill = event.prefill_blocks if math.isfinite(event.prefill_blocks) else 0.0
        decision = Decision(
            worker=event.worker,
            policy=self.policy,
            prompt_tokens=0,
            matched_tokens=0,
            predicted_cached_tokens=0,
            cost=0.0,
            prefill_blocks=min(max(prefill, 0.0), float(blocks)),
            new_blocks=min(max(event.new_blocks, 0), blocks),
            keys=event.keys,
            number=number,
            request=event.request,
            peer=peer,
        )
        if requests is None:
            requests = self._peer_requests[peer] = {}
        requests[event.request] = decision
        self._peer_count += 1
        self._peer_deadlines[(peer, event.request)] = self._clock() + self.peer_timeout
        self._assign(decision)

    def _drop_peer_request(self, decision: Decision) -> None:
        """A peer's request no longer in flight: out of every peer map (a peer left
        with none goes too); the caller ends it (`finished`)."""
        requests = self._peer_requests[decision.peer]
        del requests[decision.request]
        if not requests:
            del self._peer_requests[decision.peer]
        del self._peer_deadlines[(decision.peer, decision.request)]
        self._peer_count -= 1

    def _forget_peer(self, peer: str) -> None:
        for decision in list(self._peer_requests.get(peer, {}).values()):
            self._drop_peer_request(decision)
            self.finished(decision)

    def _expire(self, now: float) -> None:
        deadlines = self._peer_deadlines
        while deadlines:
            (peer, request), deadline = next(iter(deadlines.items()))
            if deadline > now:
                break
            decision = self._peer_requests[peer][request]
            self._drop_peer_request(decision)
            self.finished(decision)
        while self._finishing and self._finishing[0][0] <= now:
            _, decision = self._finishing.popleft()
            self._release(decision.number, decision.keys)
        while self._ended and self._ended[0][0] <= now:
            _, number = self._ended.popleft()
            self._ended_count[number] -= 1
            self._refresh(number)

    def _release(self, number: int, keys: list[int]) -> None:
        pending = self._pending.get(number)
        if pending is None:
            return
        masks, bit = self._pending_masks, 1 << number
        for key in keys:
            left = pending.get(key, 0) - 1
            if left > 0:
                pending[key] = left
            elif pending.pop(key, None) is not None:
                mask = masks.get(key, 0) & ~bit
                if mask:
                    masks[key] = mask
                else:
                    masks.pop(key, None)
        if not pending:
            del self._pending[number]

    # --- introspection ---------------------------------------------------------------

    @property
    def peer_requests(self) -> int:
        """Other replicas' requests in flight, counted here."""
        return self._peer_count

    @property
    def peers(self) -> int:
        """Other replicas with requests in flight counted here (at most `MAX_PEERS`)."""
        return len(self._peer_requests)

    def eligible(self) -> list[str]:
        """Workers that may get traffic now."""
        now = self._clock()
        return [
            self.index.worker_name(int(n))
            for n in np.flatnonzero(np.isfinite(self._load))
            if self._fresh[n] > now
        ]
