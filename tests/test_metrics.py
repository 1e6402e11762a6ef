"""Bus metrics (`kvbus.metrics`) read the way Prometheus reads them, against known
traffic: a publisher through a real Redis outage, and the router's /metrics over a
crafted kv stream (gaps, a restart, a malformed message, a duplicate). The bridge's
/metrics: test_cli; vLLM's own endpoint: test_vllm_serve."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from cluster import free_port, make_model
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvbus
import kvbus.metrics
from kvbus.routing.router import Router
from kvbus.service.gateway import RouterApp

from .conftest import append_raw, envelope, kv_payload
from .servers import CuttableProxy, RedisServer

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Series:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(series: Series, name: str, **labels: str) -> float:
    return series[(name, frozenset(labels.items()))]


async def until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_publisher_series_through_a_redis_outage(redis_server: RedisServer) -> None:
    proxy = CuttableProxy(redis_server.port)
    await proxy.start()
    stream, source = "metrics-outage", "engine-outage"
    publisher = kvbus.Publisher(f"redis://127.0.0.1:{proxy.port}", stream=stream, source=source)
    registry = CollectorRegistry()
    kvbus.metrics.register(registry)
    try:
        assert await publisher.aflush()  # SourceStarted is stored
        proxy.cut()
        payloads = [kv_payload(i) for i in range(5)]
        publisher.publish(payloads[0])  # taken by the sender, which now retries it
        await until(lambda: publisher.stats.send_errors > 0)
        for payload in payloads[1:]:
            publisher.publish(payload)
        during = parse(generate_latest(registry).decode())
        labels = {"stream": stream, "source": source}
        assert value(during, "kvbus_publisher_queue_messages", **labels) == 4
        assert value(during, "kvbus_publisher_queue_bytes", **labels) == sum(
            len(p) for p in payloads[1:]
        )
        assert value(during, "kvbus_publisher_reconnects_total", **labels) == 0

        proxy.heal()
        assert await publisher.aflush(30)
        after = parse(generate_latest(registry).decode())
        assert value(after, "kvbus_publisher_published_total", **labels) == 6
        assert value(after, "kvbus_publisher_sent_total", **labels) == 6
        assert value(after, "kvbus_publisher_dropped_total", **labels) == 0
        assert value(after, "kvbus_publisher_reconnects_total", **labels) == 1
        errors = value(after, "kvbus_publisher_send_errors_total", **labels)
        assert errors == publisher.stats.send_errors >= 1
        assert value(after, "kvbus_publisher_queue_messages", **labels) == 0
        appends = value(after, "kvbus_publisher_append_seconds_count", **labels)
        assert appends >= 3  # SourceStarted, the one retried, the four queued behind it
        assert value(after, "kvbus_publisher_append_seconds_bucket", le="+Inf", **labels) == (
            appends
        )
        # The retried append lasted the outage: it is in a bucket above the first.
        assert value(after, "kvbus_publisher_append_seconds_bucket", le="0.0005", **labels) < (
            appends
        )
    finally:
        publisher.close()
        await proxy.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tokenizer")
    make_model(model)
    return model


async def test_router_metrics_count_the_subscribers_traffic(
    memory_url: str, tokenizer: Path
) -> None:
    stream = "kv-metrics-test"  # this process's other tests' subscribers read "kv"
    await append_raw(
        memory_url,
        [
            *(envelope("a", 1, seq) for seq in range(1, 6)),
            envelope("a", 1, 3),  # a duplicate
            envelope("a", 1, 8, lost_from=6),  # the publisher dropped 6 and 7
            b"\xc1 not msgpack",  # malformed
            envelope("b", 1, 1),
            envelope("b", 2, 1),  # b restarted
        ],
        stream=stream,
    )
    dead = f"http://127.0.0.1:{free_port()}"
    app = RouterApp({"a": dead}, Router(), memory_url, str(tokenizer), kv_stream=stream)
    server = TestServer(app.app())
    await server.start_server()
    try:
        await until(lambda: app.kv_replayed)
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/metrics")) as response:
                series = parse(await response.text())
    finally:
        await server.close()
    kv = {"stream": stream}
    assert value(series, "kvbus_subscriber_delivered_total", **kv) == 8
    assert value(series, "kvbus_subscriber_duplicates_total", **kv) == 1
    assert value(series, "kvbus_subscriber_resyncs_total", reason="dropped", **kv) == 1
    assert value(series, "kvbus_subscriber_resyncs_total", reason="new_epoch", **kv) == 1
    assert value(series, "kvbus_subscriber_gaps_total", outcome="lost", **kv) == 1
    assert value(series, "kvbus_subscriber_gaps_total", outcome="repaired", **kv) == 0
    assert value(series, "kvbus_subscriber_rejected_total", reason="malformed", **kv) == 1
    assert value(series, "kvbus_subscriber_rejected_total", reason="forged", **kv) == 0
    assert value(series, "kvbus_subscriber_lag_messages", **kv) == 0
    assert 0 <= value(series, "kvbus_subscriber_lag_seconds", **kv) < 3600


def test_reports_of_other_processes_are_added_and_dead_ones_removed(tmp_path: Path) -> None:
    """vLLM's engine-core process writes its report; the front end's collector adds it
    to its own objects and forgets a report whose process is gone."""
    import os
    import subprocess
    import sys

    script = (
        "import os, pathlib, sys, kvbus, kvbus.metrics as m\n"
        "p = kvbus.Publisher('memory://x', stream='kv', source='engine-core')\n"
        "p.flush()\n"
        "m.write_report(pathlib.Path(sys.argv[1]) / f'{os.getpid()}.msgpack')\n"
        "print('written', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"
        (tmp_path / "999999999.msgpack").write_bytes(b"stale")  # no such process
        (tmp_path / f"{os.getpid()}.msgpack").write_bytes(b"not read: this process's own")
        registry = CollectorRegistry()
        registry.register(kvbus.metrics.collector(tmp_path))
        series = parse(generate_latest(registry).decode())
        labels = {"stream": "kv", "source": "engine-core"}
        assert value(series, "kvbus_publisher_sent_total", **labels) == 1  # SourceStarted
        assert not (tmp_path / "999999999.msgpack").exists()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    series = parse(generate_latest(registry).decode())
    assert ("kvbus_publisher_sent_total", frozenset(labels.items())) not in series


def test_the_bus_does_not_import_its_metrics_and_kvbus_metrics_still_resolves() -> None:
    """Publishers and subscriptions register in `kvbus.bus.instruments`; `kvbus.metrics`
    (operations) reads it and is imported only when used, also as ``kvbus.metrics``
    after a bare ``import kvbus`` (as the README writes it); what it reports then
    includes the objects made before it was imported."""
    import subprocess
    import sys

    script = (
        "import asyncio, sys, kvbus\n"
        "async def main():\n"
        "    with kvbus.Publisher('memory://early', stream='kv', source='early'):\n"
        "        async with kvbus.subscribe('kv', 'memory://early'):\n"
        "            assert 'kvbus.metrics' not in sys.modules, 'the bus imported it'\n"
        "            report = kvbus.metrics.report()\n"
        "    assert [x.source for x in report.publishers] == ['early'], report\n"
        "    assert [x.stream for x in report.subscribers] == ['kv'], report\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def test_a_subscription_collected_while_the_counts_are_read_neither_hangs_nor_is_lost() -> None:
    """The garbage collector may run a finalizer inside a reader of the retired counts,
    on the same thread, while the reader holds their lock (found as a hang of the suite:
    a scrape's list comprehension set off a collection). The finalizer must not wait for
    that lock, and what the collected object counted must still reach the next read."""
    import gc
    import threading

    from kvbus.bus import instruments
    from kvbus.bus.subscription_stats import SubscriptionStats

    class Cyclic:  # freed only by the collector, like a subscription in a cycle
        def __init__(self) -> None:
            self.stream = "collected-while-read"
            self.stats = SubscriptionStats(delivered=7)
            self.backlog = 0
            self.lag_seconds = 0.0
            self.cycle = self

    before = dict(instruments.retired_subscriptions()).get("collected-while-read")
    instruments.track_subscription(Cyclic())

    def read_while_collecting() -> None:
        with instruments._retired_lock:  # as retired_subscriptions() holds it
            gc.collect()  # the finalizer runs here, on this thread

    reader = threading.Thread(target=read_while_collecting, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a finalizer waited for the lock its own thread holds"
    counted = dict(instruments.retired_subscriptions())["collected-while-read"]
    assert counted.delivered == (before.delivered if before else 0) + 7
