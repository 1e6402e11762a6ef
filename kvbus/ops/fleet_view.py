"""The model behind ``kvbus top``: every worker's state folded from the kv and metrics
streams, and the `TopReport` built from it (the JSON schema of ``kvbus top --json``).

`Fleet` keeps O(1) state per worker (counters, not block sets: a top must stay light
with hundreds of engines); `Fleet.report` takes a snapshot of it as plain Structs.
Nothing here reads the bus or draws: `kvbus.ops.top` feeds a `Fleet` from subscriptions and
renders its reports, and a test or a bench can feed one items by hand.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import msgspec

from kvbus.bus.subscription import (
    DEFAULT_MAX_SOURCES,
    Item,
    Resync,
    ResyncReason,
    SubscriptionStats,
)
from kvbus.config import redact_url
from kvbus.wire.envelope import Kind
from kvbus.wire.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LoadMetrics,
    PackedBlockStored,
    SourceStarted,
    SourceStopped,
)

DEFAULT_WINDOW: Final = 60.0
DEFAULT_STALE_AFTER: Final = 5.0
KNOWN_MEDIA: Final = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
OTHER_MEDIUM: Final = "OTHER"
"""Where blocks of further media go once a worker has named `_MAX_MEDIA` of them (or
a medium name longer than `_MAX_MEDIUM_NAME`): medium names come from the network."""
_MAX_MEDIA: Final = 8
_MAX_MEDIUM_NAME: Final = 16
_DIGITS: Final = re.compile(r"(\d+)")
_MAX_WINDOW_RECORDS: Final = 4096
"""Load records kept per worker for the hit-rate window (the stat logger sends at most
4 a second: 17 minutes of them)."""


# --- the report (the JSON schema of `kvbus top --once --json`) -------------------------


class WorkerView(msgspec.Struct, kw_only=True):
    """One worker (a source on the kv or the metrics stream)."""

    source: str
    state: str
    """``up``; ``stale`` (no load record for ``stale_after`` s); ``stopped`` (its
    publisher closed cleanly); ``no-load`` (KV events but never a load record)."""
    blocks: dict[str, int]
    """Cached block copies per medium (``GPU``, ``CPU``, ``STORAGE``, ...), as the
    engine counts them: stored minus removed since its cache was last known empty."""
    blocks_exact: bool
    """False when kv messages of this worker were lost since then (a gap, a drop, or
    joining after its history was trimmed): ``blocks`` is then a lower bound."""
    hit_rate: float | None
    """Prefix-cache hits / queries (tokens) over the last ``window_s``; None: no query."""
    prefix_cache_queries: int
    prefix_cache_hits: int
    running: int | None
    """From the newest load record (None: none yet), as are the next three."""
    waiting: int | None
    kv_cache_usage: float | None
    """Fraction of the KV cache in use, 0 to 1."""
    kv_cache_blocks: int | None
    """The engine's KV cache capacity in blocks (None: not reported)."""
    event_lag_s: float | None
    """Now minus the engine's timestamp on its newest KV batch read from the stream
    (grows while it is idle); None until one is read. A batch a snapshot delivered
    (``kvbus compact``) does not count: it was stamped by the compactor."""
    heartbeat_age_s: float | None
    """Now minus the timestamp of its newest load record."""
    drops: int
    """Messages announced lost (dropped by the publisher, gaps history no longer had,
    undecodable payloads), kv and metrics streams together."""
    resyncs: int


class FleetTotals(msgspec.Struct, kw_only=True):
    workers: int
    stale: int
    """Workers not ``up``."""
    blocks: dict[str, int]
    running: int
    waiting: int
    hit_rate: float | None
    prefix_cache_queries: int
    prefix_cache_hits: int
    drops: int
    newest_event_age_s: float | None
    """Now minus the newest KV batch's timestamp over all workers."""


class StreamView(msgspec.Struct, kw_only=True):
    name: str
    stats: SubscriptionStats
    """What the subscription counted: delivered, resyncs, malformed, oversized, ..."""


class TopReport(msgspec.Struct, kw_only=True):
    """What ``kvbus top --once --json`` prints (``kvbus top --schema``: its JSON Schema)."""

    ts: float
    """When it was taken (seconds since the epoch)."""
    url: str
    """The bus, its password redacted."""
    window_s: float
    totals: FleetTotals
    """Over every worker, shown or not."""
    workers: list[WorkerView]
    """Sorted as asked (``--sort``), at most ``--rows`` of them."""
    kv: StreamView
    metrics: StreamView
    bad_items: int = 0
    """Items this view failed to apply (a kvbus bug: logged, skipped)."""


# --- folding the streams ---------------------------------------------------------------


def _finite(value: float) -> float | None:
    """``value`` unless it is NaN or infinite (msgpack carries both)."""
    return value if math.isfinite(value) else None


def _lost(item: Resync) -> int:
    """Messages a Resync announces lost (joining late loses nothing that was sent to us)."""
    if item.lost is None or item.reason is ResyncReason.JOINED:
        return 0
    return max(0, item.lost[1] - item.lost[0] + 1)


class _Worker:
    __slots__ = (
        "batch_ts",
        "blocks",
        "drops",
        "exact",
        "hits",
        "load",
        "load_ts",
        "queries",
        "resyncs",
        "seen",
        "stopped",
        "window",
    )

    def __init__(self) -> None:
        self.blocks: dict[str, int] = {}
        self.exact = True
        self.batch_ts: float | None = None
        self.load: LoadMetrics | None = None
        self.load_ts: float | None = None
        self.window: deque[tuple[float, int, int]] = deque()
        """(ts, prefix-cache queries, hits) of recent load records, oldest first"""
        self.queries = 0
        """Sums over ``window``."""
        self.hits = 0
        self.drops = 0
        self.resyncs = 0
        self.stopped = {"kv": False, "metrics": False}
        """Per stream: whether its newest message was the publisher's SourceStopped."""
        self.seen = 0
        """When last touched (a counter: the idlest are forgotten first)."""

    def reset_blocks(self) -> None:
        self.blocks = {}
        self.exact = True

    def count(self, medium: str | None, change: int) -> None:
        name = medium or MEDIUM_GPU
        blocks = self.blocks
        if name not in blocks and (len(blocks) >= _MAX_MEDIA or len(name) > _MAX_MEDIUM_NAME):
            name = OTHER_MEDIUM
        total = blocks.get(name, 0) + change
        if total < 0:  # removals of blocks stored before what we saw
            total, self.exact = 0, False
        blocks[name] = total

    def add_hits(self, ts: float, queries: int, hits: int) -> None:
        queries = max(0, queries)
        hits = min(max(0, hits), queries)
        if len(self.window) >= _MAX_WINDOW_RECORDS:
            self._drop_oldest()
        self.window.append((ts, queries, hits))
        self.queries += queries
        self.hits += hits

    def expire(self, since: float) -> None:
        while self.window and self.window[0][0] < since:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, queries, hits = self.window.popleft()
        self.queries -= queries
        self.hits -= hits


class Fleet:
    """Every worker's state from the items of the kv and metrics subscriptions.

    Each item costs O(1) whatever it claims; at most ``max_workers`` workers are kept
    (beyond that the idlest eighth is forgotten, as a subscription forgets sources)."""

    def __init__(
        self,
        window: float = DEFAULT_WINDOW,
        stale_after: float = DEFAULT_STALE_AFTER,
        max_workers: int = DEFAULT_MAX_SOURCES,
    ) -> None:
        self.window = window
        self.stale_after = stale_after
        self.max_workers = max(1, max_workers)
        self.workers: dict[str, _Worker] = {}
        self.bad_items = 0
        """Items that made `apply_kv`/`apply_metrics` fail (a bug: counted, skipped)."""
        self._touches = 0

    def _worker(self, source: str) -> _Worker:
        worker = self.workers.get(source)
        if worker is None:
            if len(self.workers) >= self.max_workers:
                idlest = heapq.nsmallest(
                    max(1, len(self.workers) // 8), self.workers.items(), key=lambda i: i[1].seen
                )
                for name, _ in idlest:
                    del self.workers[name]
            worker = self.workers[source] = _Worker()
        self._touches += 1
        worker.seen = self._touches
        return worker

    def _resync(self, worker: _Worker, item: Resync) -> None:
        worker.resyncs += 1
        worker.drops += _lost(item)

    def apply_kv(self, item: Item, from_snapshot: bool = False) -> None:
        """Apply one item of the kv stream; ``from_snapshot``: a batch a stored
        snapshot delivered (`kvbus.ops.top.SnapshotDeliveries`), which sets the worker's
        blocks but not its lag: the compactor, not the engine, stamped it."""
        worker = self._worker(item.source)
        if isinstance(item, Resync):
            self._resync(worker, item)
            if item.reason is ResyncReason.NEW_EPOCH or item.lost is None:
                # A restart, or a snapshot standing in for what is missing: exact state
                # follows.
                worker.reset_blocks()
            else:
                worker.exact = False
            return
        if item.kind == Kind.KV:
            worker.stopped["kv"] = False
            # Top counts blocks and never reads tokens: the batch packed, where it can be,
            # makes no int object per token id.
            batch: Any = item.packed
            if batch is None:
                batch = item.body
            if not from_snapshot:
                worker.batch_ts = _finite(batch.ts) or worker.batch_ts
            for event in batch.events:
                if isinstance(event, BlockStored | PackedBlockStored):
                    worker.count(event.medium, len(event.block_hashes))
                elif isinstance(event, BlockRemoved):
                    worker.count(event.medium, -len(event.block_hashes))
                elif isinstance(event, AllBlocksCleared):
                    worker.reset_blocks()
            return
        body = item.body
        worker.stopped["kv"] = isinstance(body, SourceStopped)
        if isinstance(body, SourceStarted):
            worker.reset_blocks()

    def apply_metrics(self, item: Item) -> None:
        worker = self._worker(item.source)
        if isinstance(item, Resync):
            self._resync(worker, item)
            return
        worker.stopped["metrics"] = isinstance(item.body, SourceStopped)
        load = item.body
        if not isinstance(load, LoadMetrics):
            return
        worker.load = load
        ts = _finite(load.ts) or _finite(item.ts)
        if ts is not None:
            worker.load_ts = ts
            worker.add_hits(ts, load.prefix_cache_queries, load.prefix_cache_hits)

    # --- reporting -------------------------------------------------------------------

    def view(self, source: str, worker: _Worker, now: float) -> WorkerView:
        worker.expire(now - self.window)
        load = worker.load
        usage = _finite(load.kv_cache_usage) if load is not None else None
        age = _age(now, worker.load_ts)
        if any(worker.stopped.values()):
            state = "stopped"
        elif age is None:
            state = "no-load"
        else:
            state = "up" if age <= self.stale_after else "stale"
        return WorkerView(
            source=source,
            state=state,
            blocks=dict(worker.blocks),
            blocks_exact=worker.exact,
            hit_rate=_ratio(worker.hits, worker.queries),
            prefix_cache_queries=worker.queries,
            prefix_cache_hits=worker.hits,
            running=max(0, load.running) if load is not None else None,
            waiting=max(0, load.waiting) if load is not None else None,
            kv_cache_usage=min(1.0, max(0.0, usage)) if usage is not None else None,
            kv_cache_blocks=max(0, load.kv_cache_blocks) or None if load is not None else None,
            event_lag_s=_age(now, worker.batch_ts),
            heartbeat_age_s=age,
            drops=worker.drops,
            resyncs=worker.resyncs,
        )

    def report(
        self,
        kv: StreamView,
        metrics: StreamView,
        *,
        url: str = "",
        sort: str = "source",
        rows: int | None = None,
        now: float | None = None,
    ) -> TopReport:
        """Every worker's view now, totals over all of them, ``rows`` of them sorted."""
        now = time.time() if now is None else now
        views = [self.view(source, worker, now) for source, worker in self.workers.items()]
        blocks: dict[str, int] = {}
        for view in views:
            for medium, count in view.blocks.items():
                blocks[medium] = blocks.get(medium, 0) + count
        queries = sum(v.prefix_cache_queries for v in views)
        hits = sum(v.prefix_cache_hits for v in views)
        lags = [v.event_lag_s for v in views if v.event_lag_s is not None]
        totals = FleetTotals(
            workers=len(views),
            stale=sum(v.state != "up" for v in views),
            blocks=blocks,
            running=sum(v.running or 0 for v in views),
            waiting=sum(v.waiting or 0 for v in views),
            hit_rate=_ratio(hits, queries),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            drops=sum(v.drops for v in views),
            newest_event_age_s=min(lags, default=None),
        )
        key, descending = SORTS[sort]
        # None sorts last either way.
        views.sort(key=lambda v: _natural(v.source))
        views.sort(key=lambda v: _none_last(key(v), descending))
        shown = views if rows is None else views[: max(0, rows)]
        return TopReport(
            ts=now,
            url=redact_url(url),
            window_s=self.window,
            totals=totals,
            workers=shown,
            kv=kv,
            metrics=metrics,
            bad_items=self.bad_items,
        )


def _age(now: float, ts: float | None) -> float | None:
    return None if ts is None else round(max(0.0, now - ts), 3)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole > 0 else None


def _natural(name: str) -> list[Any]:
    """``engine-2`` before ``engine-10``: digit runs compare as numbers."""
    # The split alternates text and digit runs, so lists compare like with like.
    return [int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(name))]


def _none_last(value: Any, descending: bool) -> tuple[bool, Any]:
    if value is None:
        return (True, 0)
    return (False, -value if descending else value)


SORTS: Final[dict[str, tuple[Callable[[WorkerView], Any], bool]]] = {
    # name: (key, descending)
    "source": (lambda v: None, False),  # the tie-break order alone
    "gpu": (lambda v: v.blocks.get(MEDIUM_GPU, 0), True),
    "hit": (lambda v: v.hit_rate, False),
    "running": (lambda v: v.running, True),
    "waiting": (lambda v: v.waiting, True),
    "usage": (lambda v: v.kv_cache_usage, True),
    "lag": (lambda v: v.event_lag_s, True),
    "drops": (lambda v: v.drops, True),
    "heartbeat": (lambda v: v.heartbeat_age_s, True),
}
"""``--sort`` keys: the worst first (lowest hit rate, most load, oldest heartbeat)."""
