"""The routing policy: the cost of each worker for a request, from the prefix it holds,
the room in its cache and its load (`CostModel`), and the `Decision` it makes.

Cost of a worker for a request, in blocks of prefill at the fleet's pace (lowest wins;
ties drawn by a seeded generator, so the same inputs give the same decisions)::

    pace * ( prefill  * blocks it would compute + queued * blocks queued ahead of them there
           + running  * requests of this router decoding there
           + waiting  * other requests there (the engine's running + waiting, less this router's)
           + kv_usage * its KV cache usage (0..1) )
  + eviction * blocks it would newly cache * its excess share of recent insertions
  + affinity * a number in [0, 1) hashed from the prompt's first block and its name

``pace`` is how long the worker takes to a first token per block ahead, over what the
fleet takes (`kvbus.routing.pace`: 1 until measured, and on a uniform fleet): a worker
twice as slow pays its prefill and its queue twice. The affinity term (rendezvous
hashing) breaks near-ties between workers the same way in every router replica, so a
new prefix's first requests, routed by several replicas before any hears of the others'
routes, land on one worker.

The eviction term keeps the fleet's caches working as one. Every block a worker newly
caches evicts its least recently used one, so a worker that caches more than its share
(its KV capacity over the fleet's) of what the fleet cached lately keeps its blocks for a
shorter time than the others: its cache thrashes while theirs sit idle. Its *excess*
(its share of the fleet's newly cached blocks, over the last fleet-capacity of them,
divided by its capacity share, less one; zero at or below its share) makes its new blocks
dearer, so a new conversation goes where it evicts least while a conversation whose
prefix a worker holds stays there.

The figures come from a `kvbus.routing.fleet_state.FleetState` (its load cost per worker is
`CostModel.load_cost`'s, kept current as requests come and go); the model holds only the
policy's own state (the weights, the tie-breaking generator, the round-robin turn).
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvbus.routing.fleet_state import FleetState
from kvbus.routing.index import PrefixIndex, mask_numbers

_MASK_CACHE: Final = 256
_FEW: Final = 64
_MASK64: Final = (1 << 64) - 1


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
    affinity: float = 1.0
    """At most this many blocks, by a hash of the prompt's first block and the worker's
    name (rendezvous hashing): near-equal workers are told apart the same way by every
    router replica, so a new prefix's requests routed by several replicas at once (before
    any hears of the others') land together, as do one router's."""
    pace: float = 1.0
    """Exponent on the worker's pace (`kvbus.routing.pace`): 1 charges a worker twice
    as slow twice; 0 ignores speed."""


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
    best_cached_tokens: int = 0
    """``predicted_cached_tokens`` of the eligible worker holding the longest prefix of
    the prompt: what the best placement for the cache alone would have found. Less
    ``predicted_cached_tokens``, the regret of the choice (load, pace or a policy that
    does not look at the cache traded it away)."""
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
    window_keys: list[int] = []
    """Of ``keys``, those a hybrid model's sliding-window and mamba groups keep once it
    ran (`kvbus.routing.in_flight.RequestsInFlight.assign`)."""
    window_ends: list[int] = []
    """Where, in blocks of the prompt, a hybrid model's sparse groups keep state once it
    ran. vLLM's sparse retention (``prefix_cache_retention_interval`` 0, its default)
    keeps a window (a mamba group: one state) ending on each boundary a later request
    can resume at: the replay boundary, ``(prompt_tokens - 1) // block_size`` blocks
    (a resent prompt recomputes its last token), and the junction where the full-
    attention group held more than the others let it reuse (the shared prefix a sibling
    will find). Empty: the prompt's last blocks."""
    number: int = -1
    request: int = 0
    """This router's number for the request, when it shares its routes (``share``)."""
    peer: str = ""
    """The replica that routed it, for another replica's request; "" for this one's."""
    engine_load: bool = False
    """The worker's load came from its own endpoint (`Router.apply_engine_load`), not
    from the bus: the bus was down or told nothing of it."""
    pace: float = 1.0
    """The worker's pace (`kvbus.routing.pace`): its prefill and load terms count this
    many times (2: it takes twice the fleet's time to a first token)."""
    affinity: float = 0.0
    """The affinity part of ``cost``."""
    routed_at: float = 0.0
    """When (the router's clock) it was routed."""
    kv_seq: int = -1
    """The seq of the worker's latest kv message applied when routed (-1: none yet): a
    prediction that missed what the engine found was made from the events up to it
    (``x-kvbus-kv-seq``); those published after it were still on their way."""
    recompute_blocks: float = 0.0
    """Blocks it computes again: it was streaming when its worker's cache was reset
    (`kvbus.routing.in_flight.RequestsInFlight.requeue`)."""
    ahead_blocks: float = 0.0
    """Blocks of prefill ahead of its first token when routed: its own, those of this
    router's requests queued there before it, and the one token always computed."""
    ahead_busy: int = 0
    """Other requests on the worker when routed, its steps shared with them
    (`kvbus.routing.fleet_state.FleetState.busy`)."""
    predicted_ttft: float = math.nan
    """Seconds to its first token the worker should take (`kvbus.routing.pace`; NaN
    until the router has seen enough first tokens)."""
    predicted_end: float = math.nan
    """Seconds to its last token: ``predicted_ttft`` and its expected output at the
    worker's recent seconds per token (`kvbus.routing.admission`); while either is not
    known, a lower bound (``predicted_ttft`` alone: no output timed yet)."""
    ended: bool = False
    """The request ended (`kvbus.routing.in_flight.RequestsInFlight.finished`)."""
    prefilled_elsewhere: bool = False
    """Its prompt was computed on a prefill worker whose KV this worker loads (P/D,
    `Router.prefilled_elsewhere`): what the engine reports cached depends on its
    connector, so it is left out of the accuracy metrics."""
    shed: bool = False
    """Not routed: ``predicted_ttft`` is over the router's ``shed_after``, or
    ``predicted_end`` over the request's deadline (it is to be refused at once, 503; it
    took nothing on the worker)."""
    shed_limit: str = ""
    """Which limit shed it: ``first_token`` or ``deadline`` ("" : not shed)."""
    choices: int = 1
    """The answers the request asks for (its ``n``): each step of its worker brings a
    token of each, so a stream's events are that many a step."""

    def explain(self) -> str:
        """One line: the pick, its terms and the runner-up."""
        why = (
            f"{self.policy.value} -> {self.worker}: cost {self.cost:.2f} = prefill "
            f"{self.prefill_blocks:.2f} of {self.prompt_tokens} tokens (holds "
            f"{self.matched_tokens}) + evicting {self.new_blocks} at excess "
            f"{self.excess:.2f} + load {self.load:.2f} + affinity {self.affinity:.2f}"
        )
        if self.pace != 1.0:
            why += f" (prefill and load x pace {self.pace:.2f})"
        if not math.isnan(self.predicted_ttft):
            why += f"; first token in {self.predicted_ttft:.3f} s"
        if not math.isnan(self.predicted_end):
            why += f", last in {self.predicted_end:.3f} s"
        if self.shed:
            why += " (over a limit: shed)"

        if self.runner_up is not None:
            why += f"; runner-up {self.runner_up} at {self.runner_up_cost:.2f}"
        return why


class CostModel:
    """Picks the worker for a request by ``policy`` from what a `FleetState` knows."""

    def __init__(
        self, policy: Policy, weights: CostWeights, index: PrefixIndex, seed: int | None
    ) -> None:
        self.policy = policy
        self.weights = weights
        self.index = index
        self._rng = random.Random(seed)
        self._members: dict[int, npt.NDArray[np.intp]] = {}
        self._name_hashes: list[int] = []
        """each worker's name hashed, by the index's number (`_rendezvous`)"""
        self._turn = 0

    def load_cost(
        self, queued_blocks: float, streaming: int, others: int, kv_usage: float
    ) -> float:
        """The load part of a worker's cost (`kvbus.routing.fleet_state.LoadCost`)."""
        w = self.weights
        return (
            w.queued * queued_blocks
            + w.running * streaming
            + w.waiting * others
            + w.kv_usage * kv_usage
        )

    def choose(
        self,
        state: FleetState,
        load: npt.NDArray[np.float64],
        keys: list[int],
        prompt_tokens: int,
        stay: tuple[int, float] | None = None,
    ) -> Decision | None:
        """The pick among the workers of finite ``load`` for a prompt of ``keys``
        (``None``: none may get traffic). ``stay`` (a worker's number, a slack in
        blocks): that worker, if it may get traffic and costs at most the slack over
        the best (any policy but kv: whenever it may get traffic)."""
        eligible = np.flatnonzero(np.isfinite(load))
        if not len(eligible):
            return None
        depth, full_depth = self._depths(state, keys, len(load), prompt_tokens)
        best_held = int(depth[eligible].max())
        home = stay[0] if stay is not None and stay[0] < len(load) else -1
        if home >= 0 and not np.isfinite(load[home]):
            home = -1  # down, stale or excluded: the session moves
        if self.policy is not Policy.KV:
            if home >= 0:
                number = home
            elif self.policy is Policy.ROUND_ROBIN:
                self._turn += 1
                number = int(eligible[self._turn % len(eligible)])
            else:
                number = int(self._rng.choice(eligible))
            held = int(depth[number])
            return self._decide(
                state, number, keys, held, prompt_tokens, float(load[number]), best_held,
                int(full_depth[number]),
            )  # fmt: skip
        saved = self._weighted(state, depth, keys) if self.index.offloaded else depth
        w = self.weights
        new = len(keys) - depth
        excess = self._excess(state, eligible, len(load))
        pace = state.pace.of(len(load)) ** w.pace if w.pace else np.ones(len(load))
        cost = pace * (load + w.prefill * (len(keys) - saved)) + w.eviction * new * excess
        affinity = (
            w.affinity * self._rendezvous(keys[0], len(load)) if w.affinity and keys else None
        )
        if affinity is not None:
            cost += affinity
        best = float(cost.min())
        if home >= 0 and stay is not None and cost[home] <= best + stay[1]:
            number, best = home, float(cost[home])
        else:
            ties = np.flatnonzero(cost <= best + 1e-9)
            number = int(ties[0] if len(ties) == 1 else self._rng.choice(ties))
        decision = self._decide(
            state, number, keys, int(depth[number]), prompt_tokens, best, best_held,
            int(full_depth[number]),
        )  # fmt: skip
        decision.prefill_blocks = float(len(keys) - saved[number])
        decision.excess = float(excess[number])
        decision.pace = float(pace[number])
        decision.affinity = float(affinity[number]) if affinity is not None else 0.0
        cost[number] = np.inf
        second = int(cost.argmin())
        if np.isfinite(cost[second]):
            decision.runner_up = self.index.worker_name(second)
            decision.runner_up_cost = float(cost[second])
        return decision

    def _rendezvous(self, key: int, size: int) -> npt.NDArray[np.float64]:
        """Per worker, a number in [0, 1) from ``key`` and the worker's name, the same
        in every process (the names' hashes are BLAKE2b, the key the index's stable one)."""
        names = self._name_hashes
        known = min(size, self.index.worker_count())
        while len(names) < known:
            name = self.index.worker_name(len(names)).encode()
            names.append(int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little"))
        hashes = np.zeros(size, dtype=np.uint64)  # numbers no worker has yet: never chosen
        hashes[:known] = names[:known]
        x = hashes ^ np.uint64(key & _MASK64)
        # splitmix64's finaliser: every bit of key and name moves every bit of the score.
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)

    def _excess(
        self, state: FleetState, eligible: npt.NDArray[np.intp], size: int
    ) -> npt.NDArray[np.float64]:
        """Per worker: its share of the blocks the eligible workers newly cached lately,
        over its share of their capacity, less one (zero when at or below its share);
        scaled down while those blocks would not yet fill the fleet's caches (a block
        cached into free room evicts nothing)."""
        excess = np.zeros(size)
        inserted = state.inserted[eligible]
        total = float(inserted.sum())
        if total <= 0:
            return excess
        capacity = state.capacity[eligible]
        known = capacity > 0
        # A worker of unknown capacity counts as the average known one (or all equal).
        capacity = np.where(known, capacity, capacity[known].mean() if known.any() else 1.0)
        fleet = float(capacity.sum())
        share = (inserted / total) / (capacity / fleet)
        excess[eligible] = np.maximum(share - 1.0, 0.0) * min(1.0, total / fleet)
        return excess

    def _depths(
        self, state: FleetState, keys: list[int], size: int, prompt_tokens: int
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Leading blocks of ``keys`` each worker holds or is about to (requests just
        routed to it); for a hybrid model's worker, those its engine can reuse. And
        those its full-attention group alone holds (the same array for a fleet without
        hybrid models)."""
        depth = np.zeros(size)
        groups = self.index.match_masks(keys, state.pending_masks)
        full = depth
        if self.index.window_mask and self.index.block_size:
            full = np.zeros(size)
            for mask, blocks in groups:
                full[self._numbers(mask)] = blocks
            most = (prompt_tokens - 1) // self.index.block_size
            groups = self.index.window_cut(groups, keys, most, state.window_pending_masks)
        for mask, blocks in groups:
            depth[self._numbers(mask)] = blocks  # shallowest first: deeper overwrite
        return depth, full

    def _weighted(
        self, state: FleetState, depth: npt.NDArray[np.float64], keys: list[int]
    ) -> npt.NDArray[np.float64]:
        """``depth`` with blocks held only off the GPU counted at their medium's weight,
        for the few deepest workers (enough to rank the best candidates)."""
        saved = depth.copy()
        top = int(depth.max())
        deepest = np.flatnonzero(depth == top)
        if top and len(deepest) <= _FEW:
            for number in deepest:
                pending = state.pending.get(int(number), {})
                name = self.index.worker_name(int(number))
                stored = [k for k in keys[:top] if k not in pending]
                saved[number] = top - len(stored) + self.index.weighted_blocks(name, stored)
        return saved

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
        self,
        state: FleetState,
        number: int,
        keys: list[int],
        blocks: int,
        prompt_tokens: int,
        cost: float,
        best_held: int,
        full_blocks: int,
    ) -> Decision:
        block_size = self.index.block_size or 0
        matched = blocks * block_size
        # vLLM computes at least the last prompt token, so a fully cached prompt reports
        # its last block as computed (whole blocks only).
        cap = max((prompt_tokens - 1) // block_size * block_size if block_size else 0, 0)
        ends: list[int] = []
        if self.index.window_mask and block_size:
            ends.append(cap // block_size)  # the replay boundary
            if full_blocks > blocks:  # the junction: shared blocks it cannot reuse
                ends.append(full_blocks)
        return Decision(
            worker=self.index.worker_name(number),
            policy=self.policy,
            prompt_tokens=prompt_tokens,
            matched_tokens=matched,
            predicted_cached_tokens=min(matched, cap),
            best_cached_tokens=min(best_held * block_size, cap),
            cost=cost,
            prefill_blocks=float(len(keys) - blocks),
            new_blocks=len(keys) - blocks,
            load=float(state.load[number]),
            keys=keys,
            window_ends=ends,
            number=number,
            engine_load=number in state.from_engine,
        )
