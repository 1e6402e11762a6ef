"""`Router`: picks the worker for each request from the prefix it holds, the room in
its cache and its load.

Feed it every item of two subscriptions, the kv stream (`Router.apply_kv`) and the
metrics stream (`Router.apply_metrics`); ask `Router.route` for a prompt's token ids. A
worker is a kvbus source (``NAME/dp<rank>`` for vLLM engines). Replicas of the router
share their requests on the routes stream (``share``, `Router.apply_routes`).

`Router` is the facade over three parts, each readable alone:

- `kvbus.routing.fleet_state.FleetState`: what it knows of the workers (load, freshness,
  capacity, recent insertions, this router's requests in flight, their lingering
  prefix blocks), and when a worker may get traffic;
- `kvbus.routing.cost.CostModel`: the policy (cost of each worker: prefill, eviction and
  load terms, `CostWeights`), which makes the `Decision` (`Decision.explain`);
- `kvbus.routing.peers.PeerRequests`: other replicas' requests in flight and their expiry.

When the bus tells nothing of a worker (the bus is down, or its engine publishes under
another name), its load can come from its own endpoint instead: `apply_engine_load`
takes a record read from the engine's ``/metrics`` as the bus's would be taken, and the
worker stays eligible while its endpoint answers (`load_age` says whose bus record is
getting old; `Decision.engine_load` marks decisions made on such a record).

Requires numpy (the ``router`` extra): one vectorised pass over every worker keeps a
decision at a few tens of microseconds beyond the index lookup with 1,000 workers.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvbus.bus.subscription import Message, Resync, ResyncReason
from kvbus.routing.admission import Admission
from kvbus.routing.cost import CostModel, CostWeights, Decision, Policy
from kvbus.routing.fleet_state import MAX_KV_CACHE_BLOCKS, FleetState
from kvbus.routing.index import DEFAULT_MEDIUM_WEIGHTS, PrefixIndex
from kvbus.routing.peers import MAX_PEER_KEYS, MAX_PEER_REQUESTS, MAX_PEERS, PeerRequests
from kvbus.routing.sessions import Sessions
from kvbus.wire.envelope import Kind
from kvbus.wire.events import LoadMetrics, RouteEvent, SourceStopped


class Router:
    """Routes requests (`route`) and counts them until they end (`started`,
    `finished`), from the items of the kv, metrics and routes streams."""

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
        shed_after: float | None = None,
        deadline: float | None = None,
        session_slack: float = 64.0,
        session_ttl: float = 600.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.admission = Admission(shed_after, deadline)
        """Which requests are shed (`kvbus.routing.admission`)."""
        self.session_slack = session_slack
        """Blocks of prefill: a session's request goes where its last one went unless
        that worker may not get traffic or costs more than this over the best worker
        (overloaded, or its cache lost the prefix); inf: wherever it may get traffic."""
        self.sessions = Sessions(session_ttl)
        """Where each session's requests went (this router's and its replicas')."""
        self.share = share
        """Called with each `RouteEvent` of this router's requests (replicas: publish
        them on the routes stream for the others' `apply_routes`)."""
        self.replica = replica
        """This router's source on the routes stream (its own events are skipped)."""
        self.index = PrefixIndex(block_size, medium_weights or DEFAULT_MEDIUM_WEIGHTS)
        self._clock = clock
        self.cost = CostModel(Policy(policy), weights or CostWeights(), self.index, seed)
        self.state = FleetState(self.index, clock, stale_after, linger, self.cost.load_cost, wall)
        self.replica_requests = PeerRequests(peer_timeout)
        self._requests = itertools.count(1)
        self.kv_seq: dict[str, int] = {}
        """source -> seq of its latest kv batch applied, in its current epoch
        (`Decision.kv_seq`)"""

    # --- settings and counters (kept by the parts) -----------------------------------

    @property
    def policy(self) -> Policy:
        return self.cost.policy

    @policy.setter
    def policy(self, policy: Policy | str) -> None:
        self.cost.policy = Policy(policy)

    @property
    def weights(self) -> CostWeights:
        return self.cost.weights

    @weights.setter
    def weights(self, weights: CostWeights) -> None:
        self.cost.weights = weights

    @property
    def shed_after(self) -> float | None:
        """Seconds: a request whose worker should take longer than this to its first
        token (`Decision.predicted_ttft`) is not routed but shed (`Decision.shed`): past
        the TTFT SLO it would count for nothing and only take the engine's time from
        others. None: never."""
        return self.admission.shed_after

    @shed_after.setter
    def shed_after(self, seconds: float | None) -> None:
        self.admission.shed_after = seconds

    @property
    def deadline(self) -> float | None:
        """Seconds: a request whose worker should take longer than this to its last
        token (`Decision.predicted_end`) is shed, unless it gave its own to `route`.
        None: only by its own."""
        return self.admission.deadline

    @deadline.setter
    def deadline(self, seconds: float | None) -> None:
        self.admission.deadline = seconds

    @property
    def stale_after(self) -> float:
        """Seconds a load record counts: a worker with none newer gets no traffic."""
        return self.state.stale_after

    @stale_after.setter
    def stale_after(self, seconds: float) -> None:
        self.state.stale_after = seconds

    @property
    def linger(self) -> float:
        """Seconds an ended request's prefix blocks stay assumed on its worker at most
        (until the engine's events report them)."""
        return self.state.linger

    @linger.setter
    def linger(self, seconds: float) -> None:
        self.state.linger = seconds

    @property
    def peer_timeout(self) -> float:
        """Seconds another replica's request counts at most (its end may be lost)."""
        return self.replica_requests.timeout

    @peer_timeout.setter
    def peer_timeout(self, seconds: float) -> None:
        self.replica_requests.timeout = seconds

    @property
    def load_clamped(self) -> int:
        """Load records with a figure out of range (`MAX_KV_CACHE_BLOCKS`, a KV usage
        outside 0..1 or not a number), applied with it clamped."""
        return self.state.load_clamped

    @property
    def peer_rejected(self) -> int:
        """Peer events refused: unknown worker, too many keys, requests in flight or
        peers (`MAX_PEER_KEYS`, `MAX_PEER_REQUESTS`, `MAX_PEERS`)."""
        return self.replica_requests.rejected

    @property
    def peer_requests(self) -> int:
        """Other replicas' requests in flight, counted here."""
        return self.replica_requests.count

    @property
    def peers(self) -> int:
        """Other replicas with requests in flight counted here (at most `MAX_PEERS`)."""
        return self.replica_requests.peers

    # What tests look into: the prompt blocks assumed on each worker while requests run.
    @property
    def _pending(self) -> dict[int, dict[int, int]]:
        return self.state.pending

    @property
    def _pending_masks(self) -> dict[int, int]:
        return self.state.pending_masks

    # --- feeding ---------------------------------------------------------------------

    def apply_kv(self, item: Message | Resync) -> None:
        """Apply one item of the kv stream (blocks held; restarts and losses clear).
        An engine whose cache emptied (a restart, an ``AllBlocksCleared``) no longer
        holds what this router's finished requests left assumed there."""
        clears = self.index.clears
        try:
            self.index.apply(item)
        finally:  # stores that end requests' lingering (a batch that failed half-way too)
            if self.index.arrived:
                self.state.requests.stored(self.index.take_arrived())
        if isinstance(item, Resync):
            if item.reason is ResyncReason.NEW_EPOCH:  # restarted: maybe elsewhere
                self.kv_seq.pop(item.source, None)
                number = self.index.worker_number(item.source)
                self.state.pace.forget(number)
                self.admission.decode_times.forget(number)
                self.state.cleared(item.source)
            return
        if item.kind == Kind.KV:  # its body left undecoded: the index read its payload
            self.kv_seq[item.source] = item.seq
            if self.index.clears != clears:  # an AllBlocksCleared: a reset, still up
                self.state.cleared(item.source, preempted=True)
            self.state.count_insertions(item.source)
        elif isinstance(item.body, SourceStopped):
            self.state.stopped(item.source, item.ts)

    def apply_metrics(self, item: Message | Resync, age: float = 0.0) -> None:
        """Apply one item of the metrics stream (load; liveness). ``age``: seconds the
        record had already waited (a record read back from history), less freshness."""
        if not isinstance(item, Message):
            return  # lost load records: the next one replaces them anyway
        if isinstance(item.body, LoadMetrics):
            self.state.apply_load(item.source, item.body, age)
        elif isinstance(item.body, SourceStopped):
            self.state.stopped(item.source, item.ts)

    def apply_engine_load(self, worker: str, metrics: LoadMetrics) -> None:
        """A load record of ``worker`` read from its own endpoint (its engine's
        ``/metrics``), for when the bus tells nothing of it: taken as a bus record would
        be (fresh for ``stale_after`` seconds), its capacity left as the bus last said.
        The next record on the bus replaces it."""
        self.state.apply_engine_load(worker, metrics)

    def load_age(self, worker: str) -> float:
        """Seconds since ``worker``'s latest load record on the bus was made (inf: none
        ever came), whatever its endpoint said since."""
        return self.state.load_age(worker)

    def engine_loaded(self) -> list[str]:
        """Workers that may get traffic now on a load record from their own endpoint."""
        return self.state.engine_loaded()

    def mark_down(self, worker: str, seconds: float) -> None:
        """Send ``worker`` nothing for ``seconds`` (it refused a connection, say)."""
        self.state.mark_down(worker, seconds)

    def eligible(self) -> list[str]:
        """Workers that may get traffic now."""
        return self.state.eligible()

    # --- routing ---------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        exclude: Collection[str] = (),
        session: int = 0,
        max_tokens: int | None = None,
        ignores_eos: bool = False,
        deadline: float | None = None,
    ) -> Decision | None:
        """The worker for a prompt (``None``: no worker may get traffic); a ``session``
        (`kvbus.routing.sessions.session_key`; 0: none) stays where it went (see
        ``session_slack``). Call `finished` with the decision when the request ends,
        unless it is `Decision.shed` (see ``shed_after`` and ``deadline``): then it was
        not routed. ``max_tokens``: its output limit (None: not said), which it runs to
        when ``ignores_eos``; ``deadline``: seconds left to its last token, over the
        router's own ``deadline``."""
        now = self._clock()
        self._expire(now)
        keys = self.index.keys(token_ids, lora_name, extra_keys)
        load = self.state.eligible_load(now, exclude)
        home = self.sessions.worker(session, now) if session else None
        number = None if home is None else self.state.load_workers.get(home)
        stay = None if number is None else (number, self.session_slack)
        decision = self.cost.choose(self.state, load, keys, len(token_ids), stay)
        if decision is None:
            return None
        decision.routed_at = now
        decision.kv_seq = self.kv_seq.get(decision.worker, -1)
        decision.ahead_blocks = (
            self.state.queued_blocks(decision.number) + decision.prefill_blocks + 1
        )
        decision.ahead_busy = self.state.busy(decision.number)
        # The fit's seconds for the work ahead, plus how late the worker runs behind it
        # now; at least the age of the oldest request still waiting there (in a steady
        # queue every request waits about as long).
        age, late = self.state.behind(decision.number, now)
        predicted = self.state.pace.predict(
            decision.number, decision.ahead_blocks, len(keys), decision.ahead_busy
        )
        decision.predicted_ttft = age if math.isnan(predicted) else max(predicted + late, age)
        admission = self.admission
        decision.predicted_end = admission.predicted_end(
            decision.number, decision.predicted_ttft, max_tokens, ignores_eos, now
        )
        passed = admission.sheds(decision.predicted_ttft, decision.predicted_end, deadline)
        if passed is not None:
            decision.shed, decision.shed_limit = True, passed  # nothing assigned
            return decision
        self.state.assign(decision)
        if session:
            self.sessions.assign(session, decision.worker, now)
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
                    session=session,
                    window_ends=decision.window_ends,
                )
            )
        return decision

    def prefilled_elsewhere(self, decision: Decision) -> None:
        """The prompt of ``decision`` (routed, not started) is computed on another
        worker, whose KV its worker loads (P/D's prefill hop): it queues no prefill
        there, and its first token waits on the other worker, so its time says nothing
        of its worker's pace. It finds the moved blocks cached."""
        self.state.prefilled_elsewhere(decision)
        decision.ahead_blocks = 0.0
        decision.prefilled_elsewhere = True

    def started(self, decision: Decision) -> None:
        """The request of ``decision`` started streaming: its prefill is done."""
        if decision.streaming:
            return
        if not decision.peer and decision.ahead_blocks:
            seconds = self._clock() - decision.routed_at
            self.state.pace.observe(
                decision.number,
                seconds,
                decision.ahead_blocks,
                decision.ahead_busy,
                len(decision.keys),
            )
        self.state.started(decision)
        self._tell(decision, "started")

    def stepped(self, decision: Decision, seconds: float) -> None:
        """The stream answering ``decision`` brought a token ``seconds`` after the one
        before (its worker's time per token, `deadline`)."""
        number = decision.number
        streams = self.state.requests.streaming(number)
        self.admission.decode_times.step(number, seconds, self._clock(), streams)

    def answered(self, tokens: float) -> None:
        """An answer ended with ``tokens`` output tokens a choice (the output
        `deadline` expects of a request that may stop before its ``max_tokens``)."""
        self.admission.decode_times.answered(tokens)

    def seconds_per_token(self, worker: str) -> float:
        """``worker``'s own seconds per output token after the first, from its streams'
        recent steps (NaN: none lately; `deadline` then counts the fleet's median)."""
        number = self.state.load_workers.get(worker, -1)
        return self.admission.decode_times.own(number, self._clock())

    def _tell(self, decision: Decision, phase: str) -> None:
        if self.share is not None and decision.request and not decision.peer:
            self.share(RouteEvent(ts=time.time(), request=decision.request, phase=phase))

    def finished(self, decision: Decision) -> None:
        """The request of ``decision`` ended (any way): its load goes now, its prefix
        blocks stay assumed for ``linger`` seconds, until the engine's events tell."""
        self._tell(decision, "finished")
        self.state.finished(decision)

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
        peers = self.replica_requests
        if body.phase == "routed":
            number = self.state.load_workers.get(body.worker)
            if body.session and number is not None:
                self.sessions.assign(body.session, body.worker, self._clock())
            added = peers.add(item.source, body, number, self.policy, self._clock())
            if added is not None:
                self.state.assign(added)
            return
        decision = peers.get(item.source, body.request)
        if decision is None:
            return
        if body.phase == "started":
            self.started(decision)
        elif body.phase == "finished":
            peers.drop(decision)
            self.finished(decision)

    def _forget_peer(self, peer: str) -> None:
        for decision in self.replica_requests.forget(peer):
            self.finished(decision)

    def _expire(self, now: float) -> None:
        for decision in self.replica_requests.expire(now):
            self.finished(decision)
        self.state.expire(now)


__all__ = [
    "MAX_KV_CACHE_BLOCKS",
    "MAX_PEERS",
    "MAX_PEER_KEYS",
    "MAX_PEER_REQUESTS",
    "CostWeights",
    "Decision",
    "Policy",
    "Router",
]
