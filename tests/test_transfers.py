"""TransferTracker's logic and ConnectorMetrics against hostile records (no engine:
tests/test_vllm_connector.py and test_connector_aggregation.py drive the real paths)."""

from __future__ import annotations

import math
import time

import msgspec
import prometheus_client as prom
import pytest

import kvbus.routing.transfers
from kvbus import Kind, Message
from kvbus.routing.transfers import (
    MAX_INCREMENT,
    MAX_SOURCES,
    MAX_STAT_SERIES,
    OTHER_SOURCES,
    ConnectorMetrics,
    TransferTracker,
    additive_fields,
)
from kvbus.wire.events import ConnectorBatch, ConnectorStats, TransferEvent, encode


def phases(tracker: TransferTracker) -> list[tuple[str, str, str, int]]:
    return [(t.request_id, t.direction, t.phase, t.tokens) for t in tracker.take()]


def test_a_sync_load_finishes_with_the_step_that_carried_it() -> None:
    tracker = TransferTracker(16, sync_saves=False)
    tracker.looked_up("r", 0)
    tracker.load_planned("r", 32, [4, 5], is_async=False)
    tracker.load_planned("r", 0, [4, 5, 6], is_async=False)  # vLLM's second call: no plan
    assert phases(tracker) == [("r", "load", "planned", 32)]
    assert tracker.step_scheduled() == ["r"]
    tracker.step_done()
    (done,) = tracker.take()
    assert (done.phase, done.blocks, done.steps) == ("finished", 2, 1)


def test_a_sync_load_with_an_invalid_block_fails_once() -> None:
    tracker = TransferTracker(16, sync_saves=False)
    tracker.load_planned("r", 32, [4, 5], is_async=False)
    tracker.step_scheduled()
    tracker.workers_reported(invalid_block_ids={5, 99})
    tracker.step_done()
    ended = [t for t in tracker.take() if t.phase != "planned"]
    assert [(t.phase, t.reason, t.invalid_blocks) for t in ended] == [
        ("failed", "invalid_blocks", 1)
    ]


def test_a_sync_save_counts_only_what_this_engine_computed() -> None:
    tracker = TransferTracker(16, sync_saves=True)
    tracker.looked_up("r", 16)  # one block hit locally
    tracker.request_finished("r", 70, [1, 2, 3, 4, 5], delay_free=False)
    assert phases(tracker) == [("r", "save", "finished", 48)]  # 4 full blocks - 1 local
    tracker.request_finished("aborted", 70, [1, 2, 3, 4, 5], delay_free=False, computed_tokens=0)
    assert tracker.take() == []  # aborted before its prefill: nothing was saved
    consumer = TransferTracker(16, sync_saves=False)
    consumer.request_finished("r", 70, [1, 2, 3, 4, 5], delay_free=False)
    assert consumer.take() == []  # a consumer-only connector saves nothing


def test_a_connector_that_never_reports_cannot_grow_the_tracker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvbus.routing.transfers, "MAX_TRACKED", 100)
    tracker = TransferTracker(16, sync_saves=False)
    for i in range(250):
        tracker.load_planned(f"r{i}", 16, [i], is_async=True)
    assert tracker.pending() == 100 and tracker.untracked == 150
    failed = [t for t in tracker.take() if t.phase == "failed"]
    assert {t.reason for t in failed} == {"untracked"} and len(failed) == 150


def message(stats: ConnectorStats | None, *transfers: TransferEvent) -> Message:
    body = ConnectorBatch(time.time(), 1, list(transfers), stats)
    return Message("e/dp0", 1, 1, Kind.CONNECTOR, 0.0, body, encode(body), 1)


def test_hostile_stats_cost_bounded_series() -> None:
    registry = prom.CollectorRegistry()
    metrics = ConnectorMetrics(registry)
    many = {f"name{i}": 1 for i in range(5000)}  # 1,024 read per payload
    for round_ in range(12):
        payload = msgspec.msgpack.encode({f"{k}-{round_}": v for k, v in many.items()})
        metrics.apply(message(ConnectorStats(connector="x", workers=payload)))
    assert len(metrics._series) == MAX_STAT_SERIES
    assert metrics.dropped_series == 12 * 1024 - MAX_STAT_SERIES
    deep = b"\x91" * 100_000 + b"\x00"  # nested arrays past the stack
    metrics.apply(message(ConnectorStats(connector="x", workers=deep)))
    assert metrics.malformed == 1
    infinite = TransferEvent(
        request_id="r", direction="load", phase="finished", tokens=1, seconds=float("inf")
    )
    metrics.apply(
        message(
            ConnectorStats(connector="x", workers=msgspec.msgpack.encode({"n": float("inf")})),
            infinite,
        )
    )
    ended = {"source": "e/dp0", "direction": "load", "outcome": "finished"}
    assert registry.get_sample_value("kvbus_connector_transfers_total", ended) is None
    assert metrics.refused_values == 2  # the transfer's seconds, the stat's value
    assert (
        registry.get_sample_value(
            "kvbus_connector_stat_total", {"source": "e/dp0", "connector": "x", "name": "n"}
        )
        is None
    )  # an infinite value is not a count
    forged = TransferEvent(request_id="r", direction="sideways", phase="finished", tokens=-5)
    metrics.apply(message(None, forged))  # an unknown direction is not counted
    assert (
        registry.get_sample_value(
            "kvbus_connector_transfers_total",
            {"source": "e/dp0", "direction": "sideways", "outcome": "finished"},
        )
        is None
    )


def test_additive_fields_of_vllm_offloading_stats() -> None:
    payload = {
        "types": {
            "vllm:kv_offload_load_bytes": "counter",
            "vllm:kv_offload_load_size": "histogram",
            "vllm:kv_offload_cpu_cache_usage_perc": "gauge",
        },
        "data": {
            "vllm:kv_offload_load_bytes": {("CPU_to_GPU",): 100, ("DISK",): 50},
            "vllm:kv_offload_load_size": {("CPU_to_GPU",): [10.0, 30.0]},
            "vllm:kv_offload_cpu_cache_usage_perc": {(): 0.5},
        },
    }
    assert dict(additive_fields(payload)) == {
        "vllm:kv_offload_load_bytes": 150,
        "vllm:kv_offload_load_size_count": 2,
        "vllm:kv_offload_load_size_sum": 40.0,
    }
    assert dict(additive_fields({"num_bytes": [1, 2], "n": 3, "flag": True})) == {
        "num_bytes_count": 2,
        "num_bytes_sum": 3,
        "n": 3,
    }


def test_hostile_digests_and_sources_cost_bounded_series(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbus.wire.events import BlockDigest

    monkeypatch.setattr(kvbus.routing.transfers, "MAX_SOURCES", 3)
    registry = prom.CollectorRegistry()
    metrics = ConnectorMetrics(registry)
    digests = [BlockDigest("r", f"dir{i}", 0, 0, b"") for i in range(1000)]
    digests.append(BlockDigest("r", "load", 0, 0, b""))
    for n in range(5):
        body = ConnectorBatch(time.time(), 1, [], None, digests)
        metrics.apply(Message(f"e{n}/dp0", 1, 1, Kind.CONNECTOR, 0.0, body, encode(body), 1))
    families = {f.name: f for f in registry.collect()}
    samples = [
        s for s in families["kvbus_connector_block_digests"].samples if s.name.endswith("_total")
    ]
    assert {(s.labels["source"], s.labels["direction"], s.value) for s in samples} == {
        *((f"e{n}/dp0", "load", 1.0) for n in range(3)),
        (OTHER_SOURCES, "load", 2.0),  # the sources past the cap, summed
    }
    assert metrics.dropped_sources == 2


def test_no_record_drives_a_counter_to_infinity() -> None:
    """1,024 finite values of 1e308 in one stats payload summed to +Inf, and a counter at
    +Inf stays there; so did two transfers of 1e308 seconds. Each number from the
    network is now an increment in [0, 2**53] or refused (counted), and so is a sum."""
    registry = prom.CollectorRegistry()
    metrics = ConnectorMetrics(registry)
    huge = {"types": {"n": "counter"}, "data": {"n": {(f"l{i}",): 1e308 for i in range(1024)}}}
    slow = TransferEvent(request_id="r", direction="load", phase="finished", seconds=1e308)
    for _ in range(2):
        stats = ConnectorStats(connector="x", workers=msgspec.msgpack.encode(huge))
        metrics.apply(message(stats, slow))
        largest = msgspec.msgpack.encode({"m": 1.7976931348623157e308})  # finite
        metrics.apply(message(ConnectorStats(connector="x", workers=largest)))
    each_fine = {("a",): MAX_INCREMENT, ("b",): MAX_INCREMENT}  # their sum is not
    capped = {"types": {"n": "counter"}, "data": {"n": each_fine}}
    metrics.apply(message(ConnectorStats(connector="x", workers=msgspec.msgpack.encode(capped))))
    metrics.apply(message(ConnectorStats(connector="x", workers=msgspec.msgpack.encode({"n": 3}))))
    values = [s.value for f in registry.collect() for s in f.samples]
    assert all(math.isfinite(v) for v in values)
    stat = {"source": "e/dp0", "connector": "x", "name": "n"}
    assert registry.get_sample_value("kvbus_connector_stat_total", stat) == 3
    assert metrics.refused_values == 2 * (1024 + 1 + 1) + 1  # values, seconds, m; a sum
    ended = {"source": "e/dp0", "direction": "load", "outcome": "finished"}
    assert registry.get_sample_value("kvbus_connector_transfers_total", ended) is None


def test_a_scrape_stays_bounded_whatever_the_number_of_sources() -> None:
    """Every source got its own ~70 series: 10,000 sources made a scrape take 5.4 s and
    64 MiB. Past `MAX_SOURCES`, sources share one label (totals exact): a scrape's
    samples are bounded however many sources send (counted here, not timed)."""
    registry = prom.CollectorRegistry()
    metrics = ConnectorMetrics(registry)
    done = TransferEvent(request_id="r", direction="load", phase="finished", tokens=16, blocks=1)
    saved = TransferEvent(request_id="r", direction="save", phase="failed", tokens=16, blocks=1)

    def send(source: str) -> None:
        body = ConnectorBatch(time.time(), 1, [done, saved], None)
        metrics.apply(Message(source, 1, 1, Kind.CONNECTOR, 0.0, body, encode(body), 1))

    def samples() -> int:
        return sum(len(f.samples) for f in registry.collect())

    send("e0")
    per_source = samples()
    sources = 4 * MAX_SOURCES
    for n in range(1, sources):
        send(f"e{n}")
    assert samples() <= (MAX_SOURCES + 1) * per_source
    assert metrics.dropped_sources == sources - MAX_SOURCES
    total = sum(
        s.value
        for f in registry.collect()
        for s in f.samples
        if s.name == "kvbus_connector_transfer_tokens_total"
    )
    assert total == 2 * 16 * sources  # nothing lost: the others are summed
