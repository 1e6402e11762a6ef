"""``kvbus top``: the fleet's workers at a glance, from the kv and metrics streams.

One row per worker (a kvbus source, ``NAME/dp<rank>`` for vLLM engines): the block
copies it caches per medium, its prefix-cache hit rate over a recent window, its
running and waiting requests, KV cache usage, how long ago its newest KV event was
stamped, the messages announced lost for it, and the age of its newest load record
(the stat logger sends one at least every 2 s, so an old one means a dead engine).

The model, `Fleet` and the `TopReport` it builds (what ``kvbus top --once --json``
prints), is `kvbus.ops.fleet_view`; this module feeds it from the bus (`Watcher`), draws
its reports (`render`, with rich, imported only when drawing: ``import kvbus`` and
``--json`` need none of it) and runs the command (`run`: once, JSON lines or live).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvbus.bus.follow import Follower
from kvbus.bus.subscription import (
    Cursor,
    Item,
    Resync,
    ResyncReason,
    Subscription,
    SubscriptionStats,
)
from kvbus.config import describe_bus, redact_url, resolve_command_url, resolve_stream
from kvbus.logs import MAX_SHOWN_NAME, LimitedLog, displayable, shown, terminal_safe_json
from kvbus.metrics import add_counts
from kvbus.ops.console import URL_HELP, say, say_if_unreachable
from kvbus.ops.fleet_view import (
    DEFAULT_STALE_AFTER,
    DEFAULT_WINDOW,
    KNOWN_MEDIA,
    OTHER_MEDIUM,
    SORTS,
    Fleet,
    FleetTotals,
    StreamView,
    TopReport,
    WorkerView,
)
from kvbus.transports import open_transport
from kvbus.wire.envelope import Kind
from kvbus.wire.events import MEDIUM_GPU

if TYPE_CHECKING:
    from rich.console import RenderableType

_limited = LimitedLog(logging.getLogger("kvbus.ops.top"))


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

    async def _read(
        self, which: str, cursor: Cursor | None, *, follow: bool, **options: Any
    ) -> Cursor:
        """``which`` stream from ``cursor`` to its end, or for good with ``follow`` (a
        failure of the bus is raised)."""
        kv = which == "kv"
        stream = self.options.kv_stream if kv else self.options.metrics_stream
        apply = self.fleet.apply_kv if kv else self.fleet.apply_metrics
        reader = Follower(
            stream, self.options.url, apply, start=cursor, on_bad_item=self._skip, **options
        )

        def opened(sub: Subscription) -> None:
            self.stats[which].append(sub.stats)
            if reader.snapshot:  # the fleet marks what stored snapshots delivered
                came_from_snapshot = SnapshotDeliveries(sub.stats).came_from_snapshot
                reader.apply = lambda item: self.fleet.apply_kv(item, came_from_snapshot(item))

        reader.on_open = opened
        async with reader:
            return await (reader.follow() if follow else reader.replay())

    def _skip(self, item: Item, error: Exception) -> None:
        self.fleet.bad_items += 1  # one bad item must not stop the view
        _limited.warning("bad_item", "kvbus top: skipped %s's item: %r", shown(item.source), error)

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
    "DEFAULT_STALE_AFTER",  # the model's names moved to kvbus.ops.fleet_view
    "DEFAULT_WINDOW",
    "KNOWN_MEDIA",
    "MAX_SHOWN_NAME",  # moved to kvbus.logs, with displayable and terminal_safe_json
    "OTHER_MEDIUM",
    "SORTS",
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
