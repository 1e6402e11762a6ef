"""``kvbus top``: the fleet's workers at a glance, from the kv and metrics streams.

One row per worker (a kvbus source, ``NAME/dp<rank>`` for vLLM engines): the block
copies it caches per medium, its prefix-cache hit rate over a recent window, its
running and waiting requests, KV cache usage, how long ago its newest KV event was
stamped, the messages announced lost for it, and the age of its newest load record
(the stat logger sends one at least every 2 s, so an old one means a dead engine).

`Fleet` folds both streams into O(1) state per worker (counters, not block sets: a
top must stay light with hundreds of engines); `Fleet.report` is the `TopReport`
that ``kvbus top --once --json`` prints; `render` draws it with rich, which is
imported only when drawing (``import kvbus`` and ``--json`` need none of it).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import logging
import math
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvbus.config import describe_bus, redact_url, resolve_command_url, resolve_stream
from kvbus.envelope import Kind
from kvbus.events import (
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
from kvbus.logs import MAX_SHOWN_NAME, LimitedLog, displayable, shown, terminal_safe_json
from kvbus.metrics import add_counts
from kvbus.subscribe import (
    DEFAULT_MAX_SOURCES,
    Cursor,
    Item,
    Resync,
    ResyncReason,
    SubscriptionStats,
    subscribe,
)
from kvbus.transports import open_transport

if TYPE_CHECKING:
    from rich.console import RenderableType

_limited = LimitedLog(logging.getLogger("kvbus.top"))

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
        snapshot delivered (`SnapshotDeliveries`), which sets the worker's blocks but not
        its lag: the compactor, not the engine, stamped it."""
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


# --- reading the bus -------------------------------------------------------------------


class SnapshotDeliveries:
    """Which kv messages of a ``snapshot=True`` subscription stored snapshots delivered.

    Such a subscription delivers the snapshots it starts from before anything else
    (``stats.snapshots`` of them by the time its first item is out), and a snapshot
    that stands in for a gap right after its source's ``Resync`` with nothing lost
    (reason ``gap`` or ``joined``: every other such Resync declares seqs lost). O(1)
    per item; at most one name held per source awaiting its snapshot."""

    _STANDING_IN: Final = (ResyncReason.GAP, ResyncReason.JOINED)

    def __init__(self, stats: SubscriptionStats) -> None:
        self._stats = stats
        self._leading: int | None = None
        self._standing_in: set[str] = set()

    def came_from_snapshot(self, item: Item) -> bool:
        if self._leading is None:
            self._leading = self._stats.snapshots
        if isinstance(item, Resync):
            if item.lost is None and item.reason in self._STANDING_IN:
                self._standing_in.add(item.source)
            return False
        if item.kind != Kind.KV:
            return False
        if self._leading > 0:
            self._leading -= 1
            return True
        if item.source in self._standing_in:
            self._standing_in.discard(item.source)
            return True
        return False


class TopOptions(msgspec.Struct, kw_only=True):
    url: str
    kv_stream: str = "kv"
    metrics_stream: str = "metrics"
    window: float = DEFAULT_WINDOW
    stale_after: float = DEFAULT_STALE_AFTER


class Watcher:
    """Follows the kv and metrics streams of ``options.url`` into a `Fleet`."""

    def __init__(self, options: TopOptions) -> None:
        self.options = options
        self.fleet = Fleet(options.window, options.stale_after)
        self.stats: dict[str, list[SubscriptionStats]] = {"kv": [], "metrics": []}
        """Per stream (kv, metrics): the counters of each subscription it was read by."""

    async def read_history(self) -> tuple[Cursor, Cursor]:
        """Both streams to their end (the kv stream from its snapshots, the metrics
        stream from ``window`` seconds ago); the cursors after them."""
        since = await self._metrics_start()
        return await asyncio.gather(
            self._read("kv", None, follow=False, snapshot=True),
            self._read("metrics", since, follow=False, gap_timeout=0),
        )

    async def follow(self, cursors: tuple[Cursor, Cursor] | None = None) -> None:
        """Both streams from ``cursors`` (default: as `read_history` starts), for good."""
        kv, metrics = cursors or (None, await self._metrics_start())
        await asyncio.gather(
            self._read("kv", kv, follow=True, snapshot=kv is None),
            self._read("metrics", metrics, follow=True, gap_timeout=0),
        )

    async def _metrics_start(self) -> Cursor | None:
        """Where the metrics stream's last ``window`` seconds start: load records are
        state, older ones would only be replayed to be overwritten."""
        transport = open_transport(self.options.url)
        try:
            since = time.time() - self.options.window
            return Cursor(await transport.position_at(self.options.metrics_stream, since))
        except Exception:  # then read what is retained
            return None
        finally:
            await transport.aclose()

    async def _read(self, which: str, cursor: Cursor | None, **options: Any) -> Cursor:
        stream = self.options.kv_stream if which == "kv" else self.options.metrics_stream
        apply = self.fleet.apply_kv if which == "kv" else self.fleet.apply_metrics
        sub = subscribe(stream, self.options.url, cursor=cursor, **options)
        self.stats[which].append(sub.stats)
        snapshots = SnapshotDeliveries(sub.stats) if options.get("snapshot") else None
        async with sub:
            async for item in sub:
                try:
                    if snapshots is not None:
                        self.fleet.apply_kv(item, snapshots.came_from_snapshot(item))
                    else:
                        apply(item)
                except Exception as error:  # one bad item must not stop the view
                    self.fleet.bad_items += 1
                    source = shown(item.source)
                    _limited.warning("bad_item", "kvbus top: skipped %s's item: %r", source, error)
        return sub.cursor

    def stream_view(self, which: str) -> StreamView:
        name = self.options.kv_stream if which == "kv" else self.options.metrics_stream
        total = SubscriptionStats()
        for stats in self.stats[which]:
            total = add_counts(total, stats)
        return StreamView(name=name, stats=total)

    def report(self, sort: str = "source", rows: int | None = None) -> TopReport:
        return self.fleet.report(
            self.stream_view("kv"),
            self.stream_view("metrics"),
            url=self.options.url,
            sort=sort,
            rows=rows,
        )


# --- drawing ---------------------------------------------------------------------------


def _count(value: int) -> str:
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if value >= 10 * scale:
            return f"{value // scale}{unit}"
    return str(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}s" if value < 100 else f"{value / 60:.0f}m"


def _media(report: TopReport) -> list[str]:
    """GPU, then every other medium some shown worker holds blocks in."""
    held = {m for v in report.workers for m, n in v.blocks.items() if n}
    extra = sorted(held - set(KNOWN_MEDIA))
    return [MEDIUM_GPU] + [m for m in KNOWN_MEDIA[1:] if m in held] + extra


def render(report: TopReport) -> RenderableType:
    """The report as two header lines, a table and what it leaves out (rich).

    Names (sources, media, the URL) come from the network or a user: each is drawn
    through `displayable`, as a `Text` (never parsed as markup)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    totals = report.totals
    malformed = sum(
        s.stats.malformed + s.stats.oversized + s.stats.implausible + s.stats.forged
        for s in (report.kv, report.metrics)
    )
    blocks = (
        "  ".join(f"{displayable(m)} {_count(n)}" for m, n in totals.blocks.items() if n) or "0"
    )
    title = Text.assemble(
        ("kvbus top  ", "bold"),
        f"{displayable(report.url, 256)}  {totals.workers} workers ({totals.stale} not up)  ",
        (f"drops {totals.drops}", "red" if totals.drops else ""),
        "  ",
        (f"malformed {malformed}", "red" if malformed else ""),
    )
    summary = Text(
        f"blocks {blocks}  running {totals.running} waiting {totals.waiting}  "
        f"hit {_percent(totals.hit_rate)} ({report.window_s:.0f}s)  "
        f"newest event {_seconds(totals.newest_event_age_s)} ago"
    )
    media = _media(report)
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("worker", no_wrap=True, overflow="ellipsis", max_width=40)
    for medium in media:
        table.add_column(Text(displayable(medium)), justify="right")
    for name in ("hit", "run", "wait", "KV use", "lag", "drops", "beat", "state"):
        table.add_column(name, justify="left" if name == "state" else "right")
    for view in report.workers:
        style = "" if view.state == "up" else "yellow"
        cells: list[RenderableType] = [Text(displayable(view.source))]
        cells += [_count(view.blocks.get(m, 0)) + ("" if view.blocks_exact else "~") for m in media]
        cells += [
            _percent(view.hit_rate),
            "-" if view.running is None else str(view.running),
            "-" if view.waiting is None else str(view.waiting),
            _percent(view.kv_cache_usage),
            _seconds(view.event_lag_s),
            str(view.drops),
            _seconds(view.heartbeat_age_s),
            view.state,
        ]
        table.add_row(*cells, style=style)
    hidden = totals.workers - len(report.workers)
    footer = Text(f"... {hidden} more workers (--rows, --sort)", style="dim") if hidden else ""
    return Group(title, summary, table, footer)


# --- the command -----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbus.cli import URL_HELP

    parser.add_argument("--url", help=URL_HELP)
    parser.add_argument(
        "--kv-stream", default=os.environ.get("KVBUS_STREAM", "kv"),
        help="KV events (default $KVBUS_STREAM, else kv)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-stream", default=os.environ.get("KVBUS_METRICS_STREAM", "metrics"),
        help="load records (default $KVBUS_METRICS_STREAM, else metrics)",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between redraws (default 1)"
    )
    parser.add_argument(
        "--window", type=float, default=DEFAULT_WINDOW,
        help="seconds of load records the hit rate covers (default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--stale-after", type=float, default=DEFAULT_STALE_AFTER,
        help="seconds without a load record before a worker is stale (default 5)",
    )  # fmt: skip
    parser.add_argument(
        "--sort", choices=sorted(SORTS), default="source",
        help="row order, the worst first (default: by name)",
    )  # fmt: skip
    parser.add_argument(
        "--rows", type=int, help="workers shown (default: what fits the terminal; --once: all)"
    )
    parser.add_argument(
        "--once", action="store_true", help="read the retained history, print once and exit"
    )
    parser.add_argument(
        "--settle", type=float, default=0.5,
        help="--once: seconds to follow the live streams after the history (default 0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=30.0,
        help="--once: give up after this many seconds without the history (default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true",
        help="JSON (TopReport) instead of a table: one document with --once, else one a line",
    )  # fmt: skip
    parser.add_argument("--schema", action="store_true", help="print the JSON Schema and exit")


_json = msgspec.json.Encoder()


async def run(args: argparse.Namespace) -> int:
    if args.schema:
        sys.stdout.buffer.write(_json.encode(msgspec.json.schema(TopReport)) + b"\n")
        return 0
    url, origin = resolve_command_url(args.url)
    try:
        options = TopOptions(
            url=url,
            kv_stream=resolve_stream(args.kv_stream),
            metrics_stream=resolve_stream(args.metrics_stream),
            window=args.window,
            stale_after=args.stale_after,
        )
    except ValueError as error:
        raise SystemExit(f"kvbus top: {error}") from None
    args.interval = max(0.05, args.interval)
    from kvbus.cli import say, say_if_unreachable

    say(
        f"kvbus top: reading streams {options.kv_stream} and {options.metrics_stream} "
        f"from {describe_bus(url, origin)}"
    )
    watcher = Watcher(options)
    watching = asyncio.create_task(
        say_if_unreachable("top", url, lambda: watcher.stats["kv"] + watcher.stats["metrics"])
    )
    try:
        if args.once:
            return await _once(watcher, args)
        if args.json:
            return await _json_lines(watcher, args)
        return await _live(watcher, args)
    finally:
        watching.cancel()


async def _once(watcher: Watcher, args: argparse.Namespace) -> int:
    try:
        cursors = await asyncio.wait_for(watcher.read_history(), args.timeout)
    except TimeoutError:
        url = redact_url(watcher.options.url)
        print(f"kvbus top: no history from {url} in {args.timeout} s", file=sys.stderr)
        return 1
    if args.settle > 0:
        following = asyncio.create_task(watcher.follow(cursors))
        await asyncio.wait([following], timeout=args.settle)
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
    report = watcher.report(args.sort, args.rows)
    if args.json:
        sys.stdout.buffer.write(terminal_safe_json(_json.encode(report)) + b"\n")
        return 0
    console = _console()
    console.print(render(report))
    return 0


async def _json_lines(watcher: Watcher, args: argparse.Namespace) -> int:
    def write() -> None:
        report = _json.encode(watcher.report(args.sort, args.rows))
        sys.stdout.buffer.write(terminal_safe_json(report) + b"\n")
        sys.stdout.flush()

    await _every(args.interval, watcher, write)
    return 0


def _console() -> Any:
    try:
        from rich.console import Console
    except ImportError:
        raise SystemExit(
            "kvbus top needs: pip install 'kvbus[top]' (--json needs nothing)"
        ) from None
    # Printed to a file or a pipe: as wide as the table is, not 80 columns.
    return Console(width=None if sys.stdout.isatty() else 200)


async def _live(watcher: Watcher, args: argparse.Namespace) -> int:
    console = _console()
    from rich.live import Live
    from rich.logging import RichHandler

    # Log lines above the live table, not through it.
    logging.getLogger().handlers = [RichHandler(console=console, show_path=False)]

    def frame() -> RenderableType:
        # What fits under the header lines, the table's own and the footer.
        rows = args.rows if args.rows is not None else max(3, console.height - 5)
        return render(watcher.report(args.sort, rows))

    with Live(frame(), console=console, auto_refresh=False) as live:
        await _every(args.interval, watcher, lambda: live.update(frame(), refresh=True))
    return 0


async def _every(interval: float, watcher: Watcher, draw: Callable[[], None]) -> None:
    """Follow the streams and ``draw()`` every ``interval`` s, until interrupted (or the
    following fails: then raise why)."""
    following = asyncio.create_task(watcher.follow())
    try:
        while not following.done():
            await asyncio.wait([following], timeout=interval)
            draw()
        following.result()
    finally:
        following.cancel()


__all__ = [
    "MAX_SHOWN_NAME",  # moved to kvbus.logs, with displayable and terminal_safe_json
    "Fleet",
    "FleetTotals",
    "StreamView",
    "TopOptions",
    "TopReport",
    "Watcher",
    "WorkerView",
    "displayable",
    "render",
    "terminal_safe_json",
]
