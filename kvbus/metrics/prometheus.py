"""The Prometheus side of `kvbus.metrics` (imported only when a collector is built)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvbus import metrics
from kvbus.metrics import (
    APPEND_BUCKETS,
    PublisherSample,
    Report,
    SubscriberSample,
    merge_publishers,
    merge_subscribers,
)

_PUBLISHER_COUNTERS = (
    ("published", "Messages accepted by publish()."),
    ("sent", "Messages the transport accepted."),
    ("dropped", "Messages lost: queue full, closed, oversized or unsent at close."),
    ("send_errors", "Failed append attempts (each is retried)."),
    ("reconnects", "Appends that succeeded after failed attempts: the backend came back."),
)
_PUBLISHER_GAUGES = (
    ("queue_messages", "Messages queued, not yet sent."),
    ("queue_bytes", "Payload bytes queued, not yet sent."),
)
_SUBSCRIBER_COUNTERS = (
    ("delivered", "Messages delivered to the consumer."),
    ("duplicates", "Copies dropped."),
    ("transport_errors", "Reads that failed and were retried."),
    (
        "skipped_events",
        "Events skipped inside KV batches: unknown type or malformed (counted when a "
        "batch is first read).",
    ),
    (
        "evicted_sources",
        "Sources forgotten because more than max_sources were tracked (one that comes "
        "back starts over with a joined resync).",
    ),
    (
        "gaps_declared_early",
        "Gaps declared lost before gap_timeout: too much was held back for them "
        "(65,536 messages of one source, or max_held_bytes in all).",
    ),
    ("repair_entries", "History entries read searching for missing seqs."),
    (
        "repairs_limited",
        "History searches cut short or skipped: the subscription had read as many "
        "history entries as it may (one per entry read live, beyond 65,536).",
    ),
    ("snapshot_reads", "Reads of the stored snapshots (snapshot mode)."),
    ("snapshots", "Snapshots delivered (snapshot mode)."),
)
"""Subscriber counters served as ``kvbus_subscriber_<name>_total{stream}``; the others
(resyncs, gaps, rejections) have a label of their own."""


class BusCollector(Collector):
    def __init__(self, reports: Callable[[], list[Report]]) -> None:
        self._reports = reports

    def collect(self) -> Iterator[Metric]:
        reports = self._reports()
        publishers = merge_publishers(p for r in reports for p in r.publishers)
        yield from _publisher_metrics(list(publishers.values()))
        subscribers = merge_subscribers(s for r in reports for s in r.subscribers)
        yield from _subscriber_metrics(list(subscribers.values()))
        skipped = CounterMetricFamily(
            "kvbus_metrics_reports_skipped",
            "Files in KVBUS_METRICS_DIR not read, by reason (see kvbus.metrics).",
            labels=["reason"],
        )
        # A copy (atomic): another scrape's thread may be adding a reason.
        for reason, count in sorted(dict(metrics.skipped_reports).items()):
            skipped.add_metric([reason], count)
        yield skipped


def _publisher_metrics(samples: list[PublisherSample]) -> Iterator[Metric]:
    labels = ["stream", "source"]
    for name, doc in _PUBLISHER_COUNTERS:
        counter = CounterMetricFamily(f"kvbus_publisher_{name}", doc, labels=labels)
        for s in samples:
            counter.add_metric([s.stream, s.source], getattr(s, name))
        yield counter
    for name, doc in _PUBLISHER_GAUGES:
        gauge = GaugeMetricFamily(f"kvbus_publisher_{name}", doc, labels=labels)
        for s in samples:
            gauge.add_metric([s.stream, s.source], getattr(s, name))
        yield gauge
    histogram = HistogramMetricFamily(
        "kvbus_publisher_append_seconds",
        "Time from an append's first try to the transport's acknowledgement.",
        labels=labels,
    )
    for s in samples:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, APPEND_BUCKETS), "+Inf"), s.append_counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        histogram.add_metric([s.stream, s.source], buckets, s.append_sum)
    yield histogram


def _subscriber_metrics(samples: list[SubscriberSample]) -> Iterator[Metric]:
    stream = ["stream"]
    for name, doc in _SUBSCRIBER_COUNTERS:
        counter = CounterMetricFamily(f"kvbus_subscriber_{name}", doc, labels=stream)
        for s in samples:
            counter.add_metric([s.stream], getattr(s, name))
        yield counter
    resyncs = CounterMetricFamily(
        "kvbus_subscriber_resyncs",
        "Resyncs delivered, by reason (new_epoch, gap, dropped, joined, malformed).",
        labels=["stream", "reason"],
    )
    gaps = CounterMetricFamily(
        "kvbus_subscriber_gaps",
        "Gaps in a source's seqs: repaired from history, or declared lost.",
        labels=["stream", "outcome"],
    )
    rejected = CounterMetricFamily(
        "kvbus_subscriber_rejected",
        "Messages counted and skipped, by reason.",
        labels=["stream", "reason"],
    )
    lag_seconds = GaugeMetricFamily(
        "kvbus_subscriber_lag_seconds",
        "Age of the oldest message read and not yet delivered (0: keeping up).",
        labels=stream,
    )
    lag_messages = GaugeMetricFamily(
        "kvbus_subscriber_lag_messages",
        "Messages read from the transport, not yet delivered to the consumer.",
        labels=stream,
    )
    for s in samples:
        for reason, count in sorted(s.resyncs.items()):
            resyncs.add_metric([s.stream, reason], count)
        gaps.add_metric([s.stream, "repaired"], s.gaps_repaired)
        gaps.add_metric([s.stream, "lost"], s.gaps_lost)
        for reason, count in sorted(s.rejected.items()):
            rejected.add_metric([s.stream, reason], count)
        lag_seconds.add_metric([s.stream], s.lag_seconds)
        lag_messages.add_metric([s.stream], s.lag_messages)
    yield from (resyncs, gaps, rejected, lag_seconds, lag_messages)
