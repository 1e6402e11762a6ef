"""KV transfers of a vLLM KV connector: the scheduler-side bookkeeping that turns vLLM's
connector calls into `TransferEvent` records, and the Prometheus metrics made of them.

`TransferTracker` knows nothing of vLLM's classes: `kvbus.connectors.vllm_connector`
feeds it request ids, token counts and block ids from vLLM's calls, in the order the
engine-core thread makes them, so its logic is tested without an engine.

`ConnectorMetrics` exports the same ``kvbus_connector_*`` families off-engine, folded
from the ``connector`` stream (a router's or a bridge's ``/metrics``) as inside vLLM
(its own ``/metrics``, through the connector's ``build_prom_metrics``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from kvbus.bus.subscription import Message, Resync
from kvbus.logs import LimitedLog, shown
from kvbus.wire.envelope import Kind
from kvbus.wire.events import ConnectorBatch, TransferEvent, decode_raw

log = logging.getLogger("kvbus.routing.transfers")
_limited = LimitedLog(log)

LOAD: Final = "load"
SAVE: Final = "save"

MAX_TRACKED: Final = 100_000
"""Transfers remembered at once; beyond it the oldest is given up as failed
(``reason="untracked"``), so a connector that never reports cannot grow memory."""

_MAX_STEPS_IN_FLIGHT: Final = 16
"""Scheduled steps awaiting their output; vLLM keeps at most a few (async scheduling,
pipeline parallelism). More means a missed output: the oldest is taken as done."""


@dataclass
class _Transfer:
    direction: str
    tokens: int
    block_ids: Sequence[int]
    is_async: bool
    started: float
    started_step: int


@dataclass
class TransferTracker:
    """One engine's transfers, from plan to outcome.

    A synchronous load runs in the step that carries it, so it is finished when that
    step's output comes back without an invalid block of its own. An asynchronous load
    or save is finished when the workers' aggregated output says so (every worker
    reported it), failed when a worker failed it. A synchronous save runs inside the
    forward passes of its request, unseen from the scheduler: with ``sync_saves`` (a
    connector known to save every prompt it did not load, like vLLM's
    ExampleConnector) it is recorded when the request finishes, as the full-block
    prompt tokens this engine computed itself (neither a local prefix hit nor loaded
    from the connector; none for a request aborted before its prefill).
    """

    block_size: int
    sync_saves: bool
    clock: Callable[[], float] = time.monotonic
    step: int = 0
    """Steps whose output came back."""
    untracked: int = 0
    _looked_up: dict[str, int] = field(default_factory=dict)
    _transfers: OrderedDict[tuple[str, str], _Transfer] = field(default_factory=OrderedDict)
    _unscheduled: list[str] = field(default_factory=list)
    _steps: deque[list[str]] = field(default_factory=deque)
    _failed_saves: set[str] = field(default_factory=set)
    _loading: dict[int, str] = field(default_factory=dict)
    """block id -> the request loading into it (block ids are unique at a time)"""
    _external: dict[str, int] = field(default_factory=dict)
    _out: list[TransferEvent] = field(default_factory=list)

    # --- what vLLM's scheduler does, in its order --------------------------------------

    def looked_up(self, request_id: str, local_tokens: int) -> None:
        """The scheduler asked the connector about a request with ``local_tokens``
        already computed (its local prefix hit). Repeatable; the last call counts."""
        self._looked_up[request_id] = local_tokens
        while len(self._looked_up) > MAX_TRACKED:  # requests that never finished
            del self._looked_up[next(iter(self._looked_up))]

    def local_tokens(self, request_id: str) -> int:
        """The request's local prefix hit at its last lookup."""
        return self._looked_up.get(request_id, 0)

    def load_planned(
        self, request_id: str, tokens: int, block_ids: Sequence[int], is_async: bool
    ) -> None:
        """Blocks were allocated for ``tokens`` external tokens (vLLM calls this twice
        for an asynchronous load: the second call, with 0 tokens, is not a plan)."""
        if tokens <= 0:
            return
        self._external[request_id] = tokens  # a resumed request's load replaces the first
        blocks = list(block_ids)
        self._track(request_id, LOAD, _Transfer(LOAD, tokens, blocks, is_async, 0.0, 0))
        for block in blocks:
            self._loading[block] = request_id
        if not is_async:
            self._unscheduled.append(request_id)
        self._emit(request_id, LOAD, "planned", tokens, len(blocks), is_async)

    def step_scheduled(self) -> list[str]:
        """A step was scheduled; returns the synchronous loads it carries."""
        carried, self._unscheduled = self._unscheduled, []
        self._steps.append(carried)
        while len(self._steps) > _MAX_STEPS_IN_FLIGHT:
            self._finish_step(self._steps.popleft())
        return carried

    def workers_reported(
        self,
        finished_recving: Iterable[str] = (),
        finished_sending: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        failed_saves: Iterable[str] = (),
    ) -> None:
        """The workers' output of a step, aggregated over every worker by vLLM."""
        bad: dict[str, int] = {}
        for block in set(invalid_block_ids):
            request_id = self._loading.get(block)
            if request_id is not None:
                bad[request_id] = bad.get(request_id, 0) + 1
        for request_id, count in bad.items():
            self._end(request_id, LOAD, "invalid_blocks", count)
        failed = set(failed_recving)
        for request_id in finished_recving:
            self._end(request_id, LOAD, "failed_recving" if request_id in failed else "")
        for request_id in finished_sending:
            self._end(request_id, SAVE, "")
        for request_id in failed_saves:
            if (request_id, SAVE) in self._transfers:
                self._end(request_id, SAVE, "worker_error")
            else:
                self._failed_saves.add(request_id)

    def step_done(self) -> None:
        """A step's output came back: the synchronous loads it carried are done."""
        if self._steps:
            self._finish_step(self._steps.popleft())
        self.step += 1

    def request_finished(
        self,
        request_id: str,
        prompt_tokens: int,
        block_ids: Sequence[int],
        delay_free: bool,
        params: bytes = b"",
        computed_tokens: int | None = None,
    ) -> None:
        """The request finished; ``delay_free`` means the connector saves its blocks
        asynchronously and reports when done."""
        local = self._looked_up.pop(request_id, 0)
        external = self._external.pop(request_id, 0)
        failed = request_id in self._failed_saves
        self._failed_saves.discard(request_id)
        if delay_free:
            tokens = min(len(block_ids) * self.block_size, prompt_tokens) or prompt_tokens
            saved = _Transfer(SAVE, tokens, list(block_ids), True, 0.0, 0)
            self._track(request_id, SAVE, saved)
            self._emit(request_id, SAVE, "pending", tokens, len(block_ids), True, params)
            return
        if not self.sync_saves:
            return
        prefilled = (
            prompt_tokens if computed_tokens is None else min(computed_tokens, prompt_tokens)
        )
        full = min(prefilled, len(block_ids) * self.block_size) // self.block_size * self.block_size
        tokens = max(0, full - local - external) // self.block_size * self.block_size
        if tokens:
            self._emit(
                request_id,
                SAVE,
                "failed" if failed else "finished",
                tokens,
                tokens // self.block_size,
                False,
                params,
                reason="worker_error" if failed else "",
            )

    def failed(self, request_id: str, direction: str, reason: str) -> None:
        """A transfer failed outside the workers' reports (the inner connector raised)."""
        if (request_id, direction) in self._transfers:
            self._end(request_id, direction, reason)
        else:
            self._emit(request_id, direction, "failed", 0, 0, False, reason=reason)

    def take(self) -> list[TransferEvent]:
        """The records made since the last call."""
        out, self._out = self._out, []
        return out

    def pending(self) -> int:
        return len(self._transfers)

    # --- internals ---------------------------------------------------------------------

    def _track(self, request_id: str, direction: str, transfer: _Transfer) -> None:
        transfer.started, transfer.started_step = self.clock(), self.step
        self._transfers[(request_id, direction)] = transfer
        while len(self._transfers) > MAX_TRACKED:
            (old_id, old_direction), _ = next(iter(self._transfers.items()))
            self.untracked += 1
            self._end(old_id, old_direction, "untracked")
        while len(self._external) > MAX_TRACKED:  # requests that never finished
            del self._external[next(iter(self._external))]
        while len(self._failed_saves) > MAX_TRACKED:
            self._failed_saves.pop()

    def _finish_step(self, carried: list[str]) -> None:
        for request_id in carried:
            self._end(request_id, LOAD, "")

    def _end(self, request_id: str, direction: str, reason: str, invalid: int = 0) -> None:
        transfer = self._transfers.pop((request_id, direction), None)
        if transfer is None:
            return  # finished before (a sync load in a step also reported invalid), or unknown
        if direction == LOAD:
            for block in transfer.block_ids:
                if self._loading.get(block) == request_id:
                    del self._loading[block]
        self._emit(
            request_id,
            direction,
            "failed" if reason else "finished",
            transfer.tokens,
            len(transfer.block_ids),
            transfer.is_async,
            seconds=max(0.0, self.clock() - transfer.started),
            steps=self.step + 1 - transfer.started_step,  # this step's output included
            reason=reason,
            invalid_blocks=invalid,
        )

    def _emit(
        self,
        request_id: str,
        direction: str,
        phase: str,
        tokens: int,
        blocks: int,
        is_async: bool,
        params: bytes = b"",
        *,
        seconds: float = 0.0,
        steps: int = 0,
        reason: str = "",
        invalid_blocks: int = 0,
    ) -> None:
        self._out.append(
            TransferEvent(
                request_id=request_id,
                direction=direction,
                phase=phase,
                tokens=tokens,
                blocks=blocks,
                is_async=is_async,
                seconds=seconds,
                steps=steps,
                reason=reason,
                invalid_blocks=invalid_blocks,
                params=params,
            )
        )


# --- Prometheus --------------------------------------------------------------------------

OUTCOMES: Final = ("finished", "failed")

# name -> (type, help); labels: the exporter's own, then direction and outcome
# (the duration histogram: direction only, finished transfers only).
METRICS: Final = {
    "kvbus_connector_transfers": ("counter", "KV transfers that ended, by outcome"),
    "kvbus_connector_transfer_tokens": ("counter", "Tokens of KV transfers that ended"),
    "kvbus_connector_transfer_blocks": ("counter", "Blocks of KV transfers that ended"),
    "kvbus_connector_transfer_seconds": (
        "counter",
        "Seconds from plan to end of KV transfers (step-granular); divide by tokens",
    ),
    "kvbus_connector_transfer_duration_seconds": (
        "histogram",
        "Seconds from plan to end of finished KV transfers (step-granular)",
    ),
}
DURATION_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Outcome = tuple[str, str, int, int, float]
"""(direction, outcome, tokens, blocks, seconds) of one ended transfer."""


MAX_INCREMENT: Final = float(2**53)
"""The most one record may add to a counter (tokens, blocks, seconds, a stats field):
larger, negative or non-finite numbers from the network are refused (counted), so no
sequence of records (fewer than 2**970 of them) can drive a counter to infinity."""


def increment(value: Any) -> bool:
    """Whether ``value`` may be added to a counter: a finite number, not a bool, in
    ``[0, MAX_INCREMENT]``."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_INCREMENT
    )


def outcomes(events: Iterable[TransferEvent]) -> list[Outcome]:
    """The ended transfers among ``events``, as the metrics count them: an unknown
    direction or phase, or a number that is no `increment`, is left out."""
    return [
        (e.direction, e.phase, e.tokens, e.blocks, e.seconds)
        for e in events
        if e.phase in OUTCOMES
        and e.direction in (LOAD, SAVE)
        and increment(e.tokens)
        and increment(e.blocks)
        and increment(e.seconds)
    ]


class TransferCounters:
    """The ``kvbus_connector_*`` families built with given metric classes: prometheus
    client's, or the ones vLLM hands its connectors (``metric_types``)."""

    def __init__(
        self,
        counter: Any,
        histogram: Any,
        labelnames: Sequence[str],
        registry: Any = None,
    ) -> None:
        extra = {} if registry is None else {"registry": registry}
        names = [*labelnames, "direction", "outcome"]
        self.families: dict[str, Any] = {}
        for name, (kind, doc) in METRICS.items():
            if kind == "counter":
                self.families[name] = counter(f"{name}_total", doc, labelnames=names, **extra)
            else:
                self.families[name] = histogram(
                    name,
                    doc,
                    labelnames=[*labelnames, "direction"],
                    buckets=DURATION_BUCKETS,
                    **extra,
                )

    def observe(self, labels: Sequence[object], ended: Iterable[Outcome]) -> None:
        f = self.families
        for direction, outcome, tokens, blocks, seconds in ended:
            key = (*labels, direction, outcome)
            f["kvbus_connector_transfers"].labels(*key).inc()
            f["kvbus_connector_transfer_tokens"].labels(*key).inc(tokens)
            f["kvbus_connector_transfer_blocks"].labels(*key).inc(blocks)
            f["kvbus_connector_transfer_seconds"].labels(*key).inc(seconds)
            if outcome == "finished":
                f["kvbus_connector_transfer_duration_seconds"].labels(*labels, direction).observe(
                    seconds
                )


class ConnectorMetrics:
    """Off-engine Prometheus metrics of every engine's KV connector, folded from the
    ``connector`` stream: ``metrics.apply(item)`` for each item of
    ``kvbus.subscribe("connector")``. Labels: ``source`` (the engine) first.

    Besides the transfer families it sums the connector's own stats payloads where
    they are additive: a flat map of numbers (or of lists of samples) adds to
    ``kvbus_connector_stat_total{connector, name}``, and vLLM's self-describing
    offloading payload (``{"types": ..., "data": ...}``) adds its counters and its
    histograms' samples; gauges are not additive and are left out.

    A scrape costs O(series): past `MAX_SOURCES` engines, the others are summed under
    ``source="other"`` (`OTHER_SOURCES`; totals stay exact), and past `MAX_STAT_SERIES`
    stats series new ones are dropped.
    """

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        self.registry = REGISTRY if registry is None else registry
        self.transfers = TransferCounters(Counter, Histogram, ["source"], self.registry)
        self.stat = Counter(
            "kvbus_connector_stat",
            "Additive fields of KV connector stats payloads, summed",
            labelnames=["source", "connector", "name"],
            registry=self.registry,
        )
        self.digests = Counter(
            "kvbus_connector_block_digests",
            "KV block digests received (compare saved and loaded ones per request)",
            labelnames=["source", "direction"],
            registry=self.registry,
        )
        self.malformed = 0
        self.refused_values = 0
        """Numbers in records that are no `increment` (negative, non-finite, huge)."""
        self.dropped_series = 0
        self.dropped_sources = 0
        """Records of sources past `MAX_SOURCES`, counted under `OTHER_SOURCES`."""
        self._sources: set[str] = set()
        self._series: set[tuple[str, str, str]] = set()

    def _add_stat(self, source: str, connector: str, name: str, value: float) -> None:
        """Names come from the network: past `MAX_STAT_SERIES` new series are dropped
        (counted in ``dropped_series``), so a forged payload cannot grow memory."""
        key = (source, connector, name)
        if key not in self._series:
            if len(self._series) >= MAX_STAT_SERIES:
                self.dropped_series += 1
                return
            self._series.add(key)
        self.stat.labels(*key).inc(value)

    def _label(self, source: str) -> str:
        """The ``source`` label of ``source``'s series: itself for the first
        `MAX_SOURCES` sources (series outlive their source), `OTHER_SOURCES` for the
        rest (counted in ``dropped_sources``), so that a scrape stays O(MAX_SOURCES)."""
        if source in self._sources:
            return source
        if len(self._sources) >= MAX_SOURCES:
            self.dropped_sources += 1
            return OTHER_SOURCES
        self._sources.add(source)
        return source

    def apply(self, item: Message | Resync) -> None:
        if isinstance(item, Resync) or item.kind != Kind.CONNECTOR:
            return
        batch = item.body
        if not isinstance(batch, ConnectorBatch):
            return
        source = self._label(item.source)
        ended = outcomes(batch.transfers)
        self.refused_values += sum(
            1 for e in batch.transfers if e.phase in OUTCOMES and e.direction in (LOAD, SAVE)
        ) - len(ended)
        self.transfers.observe([source], ended)
        for direction in (LOAD, SAVE):
            count = sum(1 for d in batch.digests if d.direction == direction)
            if count:
                self.digests.labels(source, direction).inc(count)
        stats = batch.stats
        if stats is None:
            return
        for raw in (stats.workers, stats.scheduler):
            try:
                payload = decode_raw(raw)
                if payload is not None:
                    fields = additive_fields(payload)
                    for name, value in fields:
                        self._add_stat(source, stats.connector[:200], name[:200], value)
                    self.refused_values += fields.refused
            except (msgspec.DecodeError, RecursionError, TypeError, ValueError) as error:
                self.malformed += 1
                _limited.warning(
                    "connector_stats",
                    "kvbus: skipped connector stats of %s: %s",
                    shown(item.source),
                    shown(str(error)),
                )


_MAX_FIELDS: Final = 1024
MAX_STAT_SERIES: Final = 4096
"""``kvbus_connector_stat_total`` series at most (names come from the network)."""
MAX_SOURCES: Final = 256
"""Sources with series of their own in `ConnectorMetrics` (about 70 samples each per
scrape); the others are summed under `OTHER_SOURCES`."""
OTHER_SOURCES: Final = "other"


class Fields(list[tuple[str, float]]):
    """`additive_fields`' (name, value) pairs, and how many numbers were refused."""

    refused = 0


def additive_fields(payload: Any) -> Fields:
    """The additive numbers of a stats payload as (name, value) pairs (at most 1,024);
    a number that is no `increment` is left out (counted in ``refused``), and so is a
    sum that would exceed `MAX_INCREMENT`.

    vLLM's offloading shape ``{"types": {name: kind}, "data": {name: {labels: value}}}``
    gives its counters (summed over labels) and its histograms' ``<name>_count`` and
    ``<name>_sum``; any other map gives its numbers, and ``<name>_count``/``_sum`` of
    its lists of numbers.
    """
    out = Fields()
    if not isinstance(payload, dict):
        return out

    def add(name: str, values: list[Any], samples: bool) -> None:
        """``values``' numbers: their sum (``samples``: their count and sum)."""
        taken = [v for v in values if increment(v)]
        out.refused += len(values) - len(taken)
        if values and not taken and not samples:
            return  # nothing countable: no series made
        total = sum(taken)
        if not increment(total):  # finite parts, too large a whole
            out.refused += 1
            return
        if samples:
            out.extend([(f"{name}_count", len(taken)), (f"{name}_sum", total)])
        else:
            out.append((name, total))

    types, data = payload.get("types"), payload.get("data")
    if isinstance(types, dict) and isinstance(data, dict):
        for name, kind in list(types.items())[:_MAX_FIELDS]:
            series = data.get(name)
            if not isinstance(series, dict) or not isinstance(name, str):
                continue
            values = list(series.values())
            if kind == "counter":
                add(name, [v for v in values if not isinstance(v, list)], samples=False)
            elif kind == "histogram":
                add(name, [s for v in values if isinstance(v, list) for s in v], samples=True)
        return out
    for name, value in list(payload.items())[:_MAX_FIELDS]:
        if not isinstance(name, str):
            continue
        if isinstance(value, list):
            add(name, value, samples=True)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            add(name, [value], samples=False)
    return out
