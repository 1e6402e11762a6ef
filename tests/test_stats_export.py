"""Issue 28, what the subscriber counts reaches Prometheus: every `SubscriptionStats`
counter is served, each limit hit by a real subscription shows in a scrape, and the
report files of ``KVBUS_METRICS_DIR`` carry them between processes (one of another
kvbus version is skipped and counted, never a failed scrape). Also: what `shown` puts in
a log line is inert on a terminal, like what `displayable` draws."""

from __future__ import annotations

import importlib
import itertools
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvbus.transports.memory import MemoryTransport
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvbus
import kvbus.metrics
from kvbus import Message, Resync
from kvbus.logs import LimitedLog, displayable, shown
from kvbus.wire.snapshot import CURSOR_NAME, Snapshot, encode_snapshot

from .conftest import append_raw, envelope, kv_payload, read_until

# The module, not the function `kvbus.subscribe` that its name is shadowed by.
subscribe_module = importlib.import_module("kvbus.bus.subscription")
EPOCH = time.time_ns() - 3600 * 10**9  # a source that started an hour ago
_streams = itertools.count()

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(directory: Path | None = None) -> Series:
    registry = CollectorRegistry()
    registry.register(kvbus.metrics.collector(directory))
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def of_stream(series: Series, stream: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {key: v for key, v in series.items() if ("stream", stream) in key[1]}


def own_stream() -> str:
    """A stream name no other test's subscription counts into (series are by stream)."""
    return f"stats-{next(_streams)}-{time.monotonic_ns()}"


# --- every counter is served -------------------------------------------------------


async def test_every_subscription_counter_reaches_a_scrape(memory_url: str) -> None:
    """Each counter of SubscriptionStats, given a value of its own, is some series of
    the subscription's stream: a counter added to the stats and not to the export fails
    here. (``resyncs`` is the sum of ``resyncs_total`` by reason.)"""
    stream = own_stream()
    sub = kvbus.subscribe(stream, memory_url)
    counters = [
        name
        for name, field_type in zip(
            kvbus.SubscriptionStats.__struct_fields__,
            msgspec.structs.fields(kvbus.SubscriptionStats),
            strict=True,
        )
        if field_type.type is int
    ]
    values = {name: 1000 + 7 * n for n, name in enumerate(counters)}
    for name, count in values.items():
        setattr(sub.stats, name, count)
    sub.stats.resyncs_by_reason = {"gap": values["resyncs"]}
    served = of_stream(scrape(), stream)
    try:
        missing = [name for name, count in values.items() if count not in served.values()]
        assert not missing, f"SubscriptionStats counters not exported: {missing}"
    finally:
        await sub.aclose()


# --- each limit, hit by a real subscription, shows in a scrape -------------------------


async def limit_scenario(
    case: str, url: str, stream: str, monkeypatch: pytest.MonkeyPatch
) -> kvbus.Subscription:
    """A subscription of ``stream`` that has hit ``case``'s limit once, read to the end
    of what it was given."""
    options: dict[str, Any] = {}
    done = lambda got: any(isinstance(i, Resync) for i in got)  # noqa: E731
    if case == "evicted_sources":  # max_sources=2, a third source
        data = [envelope(name, EPOCH, 1) for name in ("a", "b", "c")]
        options["max_sources"] = 2
        done = lambda got: len(got) == 3  # noqa: E731
    elif case == "gaps_declared_early":  # seq 2 missing, seq 3 over max_held_bytes
        data = [envelope("a", EPOCH, 1), envelope("a", EPOCH, 3, kv_payload(0, blocks=200))]
        options.update(max_held_bytes=1024, gap_timeout=3600)
    elif case == "repairs_limited":  # the search for seq 2 runs past its budget
        monkeypatch.setattr(subscribe_module, "_REPAIR_ALLOWANCE", 16, raising=False)
        filler = [envelope("f", EPOCH, s) for s in range(1, 41)]
        data = [envelope("a", EPOCH, 1), *filler, envelope("a", EPOCH, 3)]
        options["gap_timeout"] = 0.05
    elif case == "skipped_events":  # a batch holding an event type nobody knows
        unknown = msgspec.msgpack.encode([1.0, [{"type": "BlockTeleported"}]])
        data = [envelope("a", EPOCH, 1, unknown)]
        done = lambda got: len(got) == 1  # noqa: E731
    elif case == "implausible":
        data = [envelope("a", EPOCH, 1), envelope("b", 2**62, 1)]  # b: an epoch far ahead
        done = lambda got: len(got) == 1  # noqa: E731
    else:  # snapshots: one stored snapshot, read at the start
        transport = MemoryTransport(url)
        snapshot = Snapshot("a", EPOCH, 10, None, 0.0, kv_payload(0))
        await transport.put_snapshot(stream, "a", encode_snapshot(snapshot))
        await transport.put_snapshot(stream, CURSOR_NAME, kvbus.Cursor().to_bytes())
        data = []
        options["snapshot"] = True
        done = lambda got: len(got) == 1  # noqa: E731
    await append_raw(url, data, stream=stream)
    sub = kvbus.subscribe(stream, url, **options)
    items = await read_until(sub, done)
    for item in items:
        if isinstance(item, Message):
            assert item.body is not None  # read: a batch's events are counted when read
    await sub.aclose()
    return sub


@pytest.mark.parametrize(
    ("case", "series", "labels"),
    [
        ("evicted_sources", "kvbus_subscriber_evicted_sources_total", {}),
        ("gaps_declared_early", "kvbus_subscriber_gaps_declared_early_total", {}),
        ("repairs_limited", "kvbus_subscriber_repairs_limited_total", {}),
        ("repairs_limited", "kvbus_subscriber_repair_entries_total", {}),
        ("skipped_events", "kvbus_subscriber_skipped_events_total", {}),
        ("snapshots", "kvbus_subscriber_snapshot_reads_total", {}),
        ("snapshots", "kvbus_subscriber_snapshots_total", {}),
        ("implausible", "kvbus_subscriber_rejected_total", {"reason": "implausible"}),
    ],
)
async def test_a_limit_hit_shows_in_a_scrape(
    memory_url: str,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    series: str,
    labels: dict[str, str],
) -> None:
    stream = own_stream()
    before = scrape()
    key = (series, frozenset({"stream": stream, **labels}.items()))
    assert key not in before
    sub = await limit_scenario(case, memory_url, stream, monkeypatch)
    after = scrape()
    stat = series.removeprefix("kvbus_subscriber_").removesuffix("_total")
    expected = getattr(sub.stats, labels.get("reason", stat))
    assert expected >= 1, f"the scenario did not hit {case}"
    assert after[key] == expected


# --- reports between processes ---------------------------------------------------------


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of a live process other than this one."""
    child = subprocess.Popen(["sleep", "120"])
    yield child.pid
    child.kill()
    child.wait()


def subscriber_sample(stream: str, **counts: int) -> kvbus.metrics.SubscriberSample:
    fields = {
        name: 0 for name in kvbus.metrics.SubscriberSample.__struct_fields__ if name != "stream"
    }
    fields.update(resyncs={}, rejected={}, lag_seconds=0.0, **counts)
    return kvbus.metrics.SubscriberSample(stream=stream, **fields)


def skipped(series: Series, reason: str) -> float:
    return series.get(("kvbus_metrics_reports_skipped_total", frozenset({("reason", reason)})), 0)


def test_a_report_of_another_process_carries_the_limit_counters(
    tmp_path: Path, live_pid: int
) -> None:
    stream = own_stream()
    sample = subscriber_sample(stream, evicted_sources=5, repairs_limited=3, snapshot_reads=2)
    report = kvbus.metrics.Report(live_pid, [], [sample])
    (tmp_path / f"{live_pid}.msgpack").write_bytes(msgspec.msgpack.encode(report))
    series = of_stream(scrape(tmp_path), stream)
    labels = frozenset({("stream", stream)})
    assert series[("kvbus_subscriber_evicted_sources_total", labels)] == 5
    assert series[("kvbus_subscriber_repairs_limited_total", labels)] == 3
    assert series[("kvbus_subscriber_snapshot_reads_total", labels)] == 2


def older_report(pid: int, stream: str) -> dict[str, Any]:
    """A report as kvbus wrote them before the subscriber's limit counters: no format,
    fewer subscriber fields."""
    subscriber = {
        "stream": stream, "delivered": 3, "resyncs": {}, "gaps_repaired": 0, "gaps_lost": 0,
        "duplicates": 0, "rejected": {}, "transport_errors": 0, "lag_seconds": 0.0,
        "lag_messages": 0,
    }  # fmt: skip
    return {"pid": pid, "publishers": [], "subscribers": [subscriber]}


def newer_report(pid: int, stream: str) -> dict[str, Any]:
    """A report of a later format (whatever it may have added)."""
    report = kvbus.metrics.Report(pid, [], [subscriber_sample(stream, delivered=3)])
    newer: dict[str, Any] = msgspec.to_builtins(report)
    newer.update(format=kvbus.metrics.REPORT_FORMAT + 1, publishers={"changed": "shape"})
    return newer


@pytest.mark.parametrize("written", [older_report, newer_report])
def test_a_report_of_another_format_is_skipped_and_counted(
    tmp_path: Path, live_pid: int, written: Any
) -> None:
    stream = own_stream()
    path = tmp_path / f"{live_pid}.msgpack"
    path.write_bytes(msgspec.msgpack.encode(written(live_pid, stream)))
    before = skipped(scrape(), "mismatched")
    series = scrape(tmp_path)  # does not raise
    assert skipped(series, "mismatched") == before + 1
    assert not of_stream(series, stream)  # nothing of it served
    assert path.exists()  # its process lives: it may write its next one


# --- log lines: what came from the network is inert -----------------------------------

HOSTILE = [
    "clip\x1b]52;c;ZWNobyBwd25lZA==\x07board",  # OSC 52: writes the clipboard
    "clear\x1b[2J\x1b[Hscreen",
    "c1\x9b2Jcsi",  # the 8-bit CSI
    "bidi\u202egnp.exe",
    "line\nbreak: kvbus: a forged log line",
]


def printable(text: str) -> bool:
    return all(c.isprintable() for c in text)


class Raw:
    """An object whose repr is raw text (a third-party error, say)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


@pytest.mark.parametrize("name", HOSTILE)
def test_shown_escapes_what_a_repr_leaves_raw(name: str) -> None:
    assert printable(shown(name))
    assert printable(shown(Raw(name)))
    assert shown(Raw(name)) == displayable(name, 120)


def test_shown_is_bounded_keeps_both_ends_and_names_apart() -> None:
    long = shown("engine-" + "x" * 1_000_000 + "/dp7")
    assert len(long) <= 120 and long.startswith("'engine-") and long.endswith("/dp7'")
    assert len(shown("\x1b" * 1_000_000)) <= 120
    assert shown("a\x1bb") != shown("ab")
    assert shown("engine-1/dp0") == "'engine-1/dp0'"


async def test_log_lines_about_hostile_sources_are_inert(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each hostile source is forgotten (max_sources=1) and its gap declared early: both
    warnings name it, and no line carries a control or format character."""
    monkeypatch.setattr(subscribe_module, "_limited", LimitedLog(subscribe_module.log, 0.0))
    stream = own_stream()
    data = [envelope(name, EPOCH, 2, kv_payload(0, blocks=100)) for name in HOSTILE]
    await append_raw(memory_url, data, stream=stream)
    with caplog.at_level(logging.WARNING, logger="kvbus"):
        sub = kvbus.subscribe(stream, memory_url, max_sources=1, max_held_bytes=1024)
        await read_until(sub, lambda got: len(got) == 2 * len(HOSTILE))
        await sub.aclose()
    lines = [record.getMessage() for record in caplog.records]
    assert sub.stats.evicted_sources == len(HOSTILE) - 1
    assert sub.stats.gaps_declared_early == len(HOSTILE)
    assert len(lines) >= 2 * len(HOSTILE) - 1
    assert all(printable(line) for line in lines), [line for line in lines if not printable(line)]
