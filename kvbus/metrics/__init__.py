"""Bus metrics: what this process's publishers and subscriptions count, as Prometheus
series named ``kvbus_publisher_*`` and ``kvbus_subscriber_*``.

Every `kvbus.Publisher` and `kvbus.Subscription` is tracked (weakly) from its creation,
in the bus's own registry (`kvbus.bus.instruments`, which this module reads and the bus
never imports), so any consumer exposes the bus by registering one collector::

    kvbus.metrics.register()             # into prometheus_client's default REGISTRY
    kvbus.metrics.register(my_registry)  # or another one

``kvbus router`` and ``kvbus bridge --metrics-port`` serve them on their ``/metrics``;
inside vLLM the kvbus stat logger registers them on vLLM's own endpoint. vLLM publishes
KV events from its engine-core process while its ``/metrics`` is served by the front
end, so processes given ``KVBUS_METRICS_DIR`` (set by the vLLM plugin) write a `Report`
of their bus objects there once a second, and the collector adds the reports of the
other live processes to its own.

Series (labels ``stream`` and ``source`` for publishers, ``stream`` for subscribers):

- ``kvbus_publisher_published_total``, ``_sent_total``, ``_dropped_total``,
  ``_send_errors_total``, ``_reconnects_total`` (appends that succeeded after failures:
  the backend came back), ``_queue_messages`` and ``_queue_bytes`` (waiting to be sent),
  ``_append_seconds`` (histogram: one append from its first try to its acknowledgement).
- ``kvbus_metrics_reports_skipped_total{reason}``: files in ``KVBUS_METRICS_DIR`` this
  process did not read, and why (see `skipped_reports`).
- ``kvbus_subscriber_delivered_total``, ``_resyncs_total{reason}``,
  ``_gaps_total{outcome="repaired"|"lost"}``, ``_duplicates_total``,
  ``_rejected_total{reason}`` (malformed, oversized, future_version, unknown_kind,
  implausible, forged, stale), ``_skipped_events_total`` (events inside good batches),
  ``_transport_errors_total``, ``_lag_seconds`` (age of the oldest message read from
  the transport and not yet delivered: how far behind the live edge the consumer
  reads; 0 when it keeps up) and ``_lag_messages`` (messages read from the transport
  and not yet delivered to the consumer).
- The subscriber's limits, each counted when hit: ``_evicted_sources_total`` (more
  than ``max_sources`` tracked), ``_gaps_declared_early_total`` (too much held back
  for a gap: 65,536 messages of one source, or ``max_held_bytes``),
  ``_repairs_limited_total`` (history searches cut short or skipped: the history-read
  budget was spent); and the work they bound: ``_repair_entries_total`` (history
  entries read for gaps), ``_snapshot_reads_total`` and ``_snapshots_total``
  (snapshot mode: reads of the stored snapshots, snapshots delivered).

Every counter of `kvbus.SubscriptionStats` is served (``resyncs`` as the sum of
``_resyncs_total``), so that a limit being hit shows on a dashboard, not only in a
rate-limited log line.

Importing this module imports no Prometheus code; `collector` does, on first use.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgspec

from kvbus.bus import instruments
from kvbus.bus.instruments import APPEND_BUCKETS as APPEND_BUCKETS
from kvbus.bus.instruments import LatencyHistogram as LatencyHistogram
from kvbus.bus.instruments import add_counts as add_counts
from kvbus.bus.instruments import track_publisher as track_publisher
from kvbus.bus.instruments import track_subscription as track_subscription
from kvbus.logs import LimitedLog, shown

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from kvbus.bus.publisher_stats import PublisherStats
    from kvbus.bus.sequencer import SubscriptionStats

log = logging.getLogger("kvbus.metrics")
_limited = LimitedLog(log)
_S = TypeVar("_S", bound=msgspec.Struct)

METRICS_DIR_ENV: Final = "KVBUS_METRICS_DIR"
REPORT_INTERVAL: Final = 1.0
REPORT_FORMAT: Final = 2
"""The layout of a `Report` file: bumped whenever a field is added, removed or changes
meaning (2: the subscriber's limit counters, and this number; 1: files without it).
A reader skips a report of another format (``mismatched``): a process of another kvbus
version may share ``KVBUS_METRICS_DIR`` for the length of an upgrade."""
MAX_REPORT_BYTES: Final = 1 << 20
"""A report file larger than this is not read (they are a few hundred bytes per object)."""
MAX_REPORT_FILES: Final = 1024
"""Report files read per scrape at most (one per process that publishes or subscribes:
a vLLM server has a handful); the rest are skipped and counted."""


class PublisherSample(msgspec.Struct, frozen=True):
    stream: str
    source: str
    published: int
    sent: int
    dropped: int
    send_errors: int
    reconnects: int
    queue_messages: int
    queue_bytes: int
    append_counts: list[int]
    """Per bucket of `APPEND_BUCKETS`, then +Inf; not cumulative."""
    append_sum: float


class SubscriberSample(msgspec.Struct, frozen=True):
    stream: str
    delivered: int
    resyncs: dict[str, int]
    gaps_repaired: int
    gaps_lost: int
    duplicates: int
    rejected: dict[str, int]
    transport_errors: int
    lag_seconds: float
    lag_messages: int
    skipped_events: int
    evicted_sources: int
    gaps_declared_early: int
    repair_entries: int
    repairs_limited: int
    snapshot_reads: int
    snapshots: int


class Report(msgspec.Struct, frozen=True):
    """What one process's bus objects counted, as written to ``KVBUS_METRICS_DIR``."""

    pid: int
    publishers: list[PublisherSample]
    subscribers: list[SubscriberSample]
    format: int = REPORT_FORMAT


class _ReportFormat(msgspec.Struct):
    """Only the format of a report file (the rest of it is skipped unread), so that one
    of another kvbus version is told apart from a malformed one."""

    format: int = 1  # the files written before the field existed


def _publisher_sample(
    stream: str,
    source: str,
    stats: PublisherStats,
    latency: LatencyHistogram,
    queue_messages: int,
    queue_bytes: int,
) -> PublisherSample:
    return PublisherSample(
        stream=stream,
        source=source,
        published=stats.published,
        sent=stats.sent,
        dropped=stats.dropped,
        send_errors=stats.send_errors,
        reconnects=stats.reconnects,
        queue_messages=queue_messages,
        queue_bytes=queue_bytes,
        append_counts=list(latency.counts),
        append_sum=latency.sum,
    )


_REJECTIONS: Final = (
    "malformed",
    "oversized",
    "future_version",
    "unknown_kind",
    "implausible",
    "forged",
    "stale",
)


def _subscriber_sample(
    stream: str, stats: SubscriptionStats, backlog: int, lag: float
) -> SubscriberSample:
    return SubscriberSample(
        stream=stream,
        delivered=stats.delivered,
        resyncs=dict(stats.resyncs_by_reason),
        gaps_repaired=stats.gaps_repaired,
        gaps_lost=stats.gaps_lost,
        duplicates=stats.duplicates,
        rejected={name: getattr(stats, name) for name in _REJECTIONS},
        transport_errors=stats.transport_errors,
        lag_seconds=lag,
        lag_messages=backlog,
        skipped_events=stats.skipped_events,
        evicted_sources=stats.evicted_sources,
        gaps_declared_early=stats.gaps_declared_early,
        repair_entries=stats.repair_entries,
        repairs_limited=stats.repairs_limited,
        snapshot_reads=stats.snapshot_reads,
        snapshots=stats.snapshots,
    )


def report() -> Report:
    """This process's bus objects, now, with what collected ones had counted."""
    publishers = [
        _publisher_sample(
            p.stream, p.source, p.stats, p.append_latency, p.queue_messages, p.queue_bytes
        )
        for p in list(instruments.publishers)
    ]
    publishers += [
        _publisher_sample(stream, source, stats, latency, 0, 0)
        for stream, source, stats, latency in instruments.retired_publishers()
    ]
    subscribers = [
        _subscriber_sample(s.stream, s.stats, s.backlog, s.lag_seconds)
        for s in list(instruments.subscriptions)
    ]
    subscribers += [
        _subscriber_sample(stream, stats, 0, 0.0)
        for stream, stats in instruments.retired_subscriptions()
    ]
    return Report(os.getpid(), publishers, subscribers)


# --- reports between processes ----------------------------------------------------------

_report_decoder: Final = msgspec.msgpack.Decoder(Report)
_format_decoder: Final = msgspec.msgpack.Decoder(_ReportFormat)
_reporter_started: set[str] = set()
_reporter_lock = threading.Lock()


def start_reporting(directory: str | os.PathLike[str]) -> None:
    """Write this process's `report` to ``directory`` every `REPORT_INTERVAL` seconds
    (a daemon thread; once per directory and process)."""
    path = Path(directory)
    with _reporter_lock:
        key = f"{os.getpid()}:{path}"
        if key in _reporter_started:
            return
        _reporter_started.add(key)
    thread = threading.Thread(
        target=_report_forever, args=(path,), name="kvbus-metrics-report", daemon=True
    )
    thread.start()


def _report_forever(directory: Path) -> None:
    target = directory / f"{os.getpid()}.msgpack"
    while True:
        try:
            write_report(target)
        except OSError as error:  # the directory went away: the front end stopped
            log.debug("kvbus: cannot write metrics report %s: %s", target, error)
        time.sleep(REPORT_INTERVAL)


def write_report(target: Path) -> None:
    data = msgspec.msgpack.encode(report())
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".tmp") as f:
        f.write(data)
    os.replace(f.name, target)  # readers see the old report or the new one, never half


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_REPORT_SUFFIX: Final = ".msgpack"
_PID_NAME: Final = re.compile(r"[0-9]{1,10}")
_MAX_PID: Final = 2**31 - 1
"""A pid_t is an int32: a larger number names no process (and os.kill cannot take it)."""

skipped_reports: dict[str, int] = {}
"""Report files in ``KVBUS_METRICS_DIR`` skipped, by reason (this process's count, served
as ``kvbus_metrics_reports_skipped_total``): ``name`` (not ``<pid>.msgpack`` with a pid
in range), ``not_file`` (a FIFO, a link, a directory...), ``oversized`` (over
`MAX_REPORT_BYTES`), ``malformed`` (unreadable or not a `Report`), ``mismatched`` (a
pid other than its name's, or another `REPORT_FORMAT` or number of histogram buckets:
another kvbus version), ``too_many`` (past `MAX_REPORT_FILES`)."""
_skipped_lock = threading.Lock()


def _skip(reason: str, name: str, detail: object = "") -> None:
    with _skipped_lock:
        skipped_reports[reason] = skipped_reports.get(reason, 0) + 1
    _limited.warning(
        f"report_{reason}",
        "kvbus: metrics report %s skipped (%s) %s",
        shown(name),
        reason,
        shown(str(detail)) if detail else "",
    )


def reports_in(directory: str | os.PathLike[str]) -> Iterator[Report]:
    """The reports of other live processes in ``directory``; those of dead processes are
    removed. Any other file is skipped and counted (`skipped_reports`), whatever it is
    or holds: one bad file costs what reading `MAX_REPORT_BYTES` does, never a scrape."""
    own = os.getpid()
    read = 0
    try:
        listing = os.scandir(directory)
    except OSError as error:  # not made yet, or gone with the front end
        _limited.warning("report_dir", "kvbus: no metrics reports read: %s", error)
        return
    with listing as entries:
        for entry in entries:
            name = entry.name
            if not name.endswith(_REPORT_SUFFIX):
                continue  # the temporary files of `write_report`
            stem = name[: -len(_REPORT_SUFFIX)]
            pid = int(stem) if _PID_NAME.fullmatch(stem) else 0
            if not 0 < pid <= _MAX_PID:
                _skip("name", name)
                continue
            if pid == own:
                continue
            if not _alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            if read >= MAX_REPORT_FILES:
                _skip("too_many", name)
                continue
            read += 1
            found = _read_report(entry)
            if found is None:
                continue
            if found.pid != pid or not _histograms_match(found):
                _skip("mismatched", name)
                continue
            yield found


def _read_report(entry: os.DirEntry[str]) -> Report | None:
    """The report in ``entry``, if it is a regular file of at most `MAX_REPORT_BYTES`
    holding one. A FIFO is never opened for blocking reads (open would wait for a
    writer), and a link is not followed."""
    if not entry.is_file(follow_symlinks=False):
        _skip("not_file", entry.name)
        return None
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(entry.path, flags)
    except OSError as error:
        _skip("not_file" if error.errno == errno.ELOOP else "malformed", entry.name, error)
        return None
    with open(descriptor, "rb", closefd=True) as file:
        try:
            # What it is now, not when listed: it may have been replaced since.
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                _skip("not_file", entry.name)
                return None
            data = file.read(MAX_REPORT_BYTES + 1)
        except OSError as error:
            _skip("malformed", entry.name, error)
            return None
    if len(data) > MAX_REPORT_BYTES:
        _skip("oversized", entry.name)
        return None
    try:
        found_format = _format_decoder.decode(data).format
        if found_format != REPORT_FORMAT:
            _skip("mismatched", entry.name, f"format {found_format}, not {REPORT_FORMAT}")
            return None
        return _report_decoder.decode(data)
    except msgspec.DecodeError as error:
        _skip("malformed", entry.name, error)
        return None


def _histograms_match(found: Report) -> bool:
    """Whether every publisher of ``found`` has this version's histogram buckets."""
    buckets = len(APPEND_BUCKETS) + 1
    return all(len(p.append_counts) == buckets for p in found.publishers)


# --- Prometheus -------------------------------------------------------------------------


def collector(directory: str | os.PathLike[str] | None = None) -> Any:
    """A prometheus_client collector of this process's bus objects, plus the reports
    of other processes in ``directory`` (default ``$KVBUS_METRICS_DIR``, if set)."""
    from kvbus.metrics.prometheus import BusCollector

    if directory is None:
        directory = os.environ.get(METRICS_DIR_ENV) or None
    return BusCollector(lambda: _reports(directory))


def _reports(directory: str | os.PathLike[str] | None) -> list[Report]:
    reports = [report()]
    if directory is not None:
        reports.extend(reports_in(directory))
    return reports


_registered: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register(
    registry: CollectorRegistry | None = None, directory: str | os.PathLike[str] | None = None
) -> None:
    """Register the bus collector in ``registry`` (default: prometheus_client's
    REGISTRY) once; later calls for the same registry do nothing."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    with _reporter_lock:
        if registry in _registered:
            return
        bus = collector(directory)
        registry.register(bus)
        _registered[registry] = bus


def serve_http(port: int, host: str = "127.0.0.1") -> int:
    """Serve the bus series on ``http://host:port/metrics`` from a daemon thread (for
    processes with no HTTP server of their own, such as ``kvbus bridge``); returns the
    port (``port=0`` picks a free one)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    register(registry)
    server, _ = start_http_server(port, host, registry)
    return int(server.server_port)


_K = TypeVar("_K")


def add_into(merged: dict[_K, _S], key: _K, sample: _S) -> None:
    """Add ``sample`` to ``merged[key]`` (two objects with the same labels are summed)."""
    seen = merged.get(key)
    merged[key] = sample if seen is None else add_counts(seen, sample)


def merge_publishers(samples: Iterable[PublisherSample]) -> dict[tuple[str, str], PublisherSample]:
    """Samples by their labels (stream, source)."""
    merged: dict[tuple[str, str], PublisherSample] = {}
    for sample in samples:
        add_into(merged, (sample.stream, sample.source), sample)
    return merged


def merge_subscribers(samples: Iterable[SubscriberSample]) -> dict[str, SubscriberSample]:
    """Samples by their label (stream)."""
    merged: dict[str, SubscriberSample] = {}
    for sample in samples:
        add_into(merged, sample.stream, sample)
    return merged
