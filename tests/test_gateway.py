"""The router service's start-up on a real bus (memory://, in this process): ready only
once the kv history and the metrics stream's recent past are applied, without waiting
for any new record. Real engines and NATS: test_router_e2e."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestServer
from cluster import free_port, make_model
from kvbus.transports import Record
from kvbus.transports.memory import MemoryTransport
from prometheus_client.parser import text_string_to_metric_families

import kvbus
from kvbus import BlockStored, Kind, KVEventBatch, LoadMetrics
from kvbus.ops.compact import Compactor
from kvbus.routing.router import Router
from kvbus.service.gateway import RouterApp
from kvbus.wire.envelope import SCHEMA_VERSION, Envelope, encode_envelope
from kvbus.wire.events import encode

TOKENS = list(range(5, 5 + 96))  # 3 blocks of 32


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tokenizer")
    make_model(model)
    return model


async def health(server: TestServer) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session:
        async with session.get(server.make_url("/health")) as response:
            return response.status, await response.json()


async def wait_ready(server: TestServer) -> tuple[int, dict[str, object]]:
    """/health until it says ready (5 s at most); 503 only while not ready."""
    for _ in range(100):
        status, state = await health(server)
        if status == 200:
            break
        assert state["ready"] is False
        await asyncio.sleep(0.05)
    return status, state


async def test_ready_from_the_bus_history_alone(memory_url: str, tokenizer: Path) -> None:
    # Before the router starts: engine a's blocks and load, and a load record of engine
    # b that was already a minute old when it was stored.
    kv = kvbus.Publisher(memory_url, stream="kv", source="a/dp0")
    stored = BlockStored(list(range(1, 4)), None, TOKENS, 32, None, "GPU", None)
    kv.publish(KVEventBatch(time.time(), [stored]))
    metrics = kvbus.Publisher(memory_url, stream="metrics", source="a/dp0")
    record = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
    metrics.publish(record, Kind.METRICS)
    assert kv.flush() and metrics.flush()
    old = time.time() - 60
    envelope = Envelope(SCHEMA_VERSION, Kind.METRICS, "b/dp0", 1, 1, old, encode(record))
    await MemoryTransport(memory_url).append(
        "metrics", [Record("b/dp0", envelope.msg_id, encode_envelope(envelope))]
    )

    dead = f"http://127.0.0.1:{free_port()}"  # /v1/models never answers: not needed
    app = RouterApp({"a": dead, "b": dead}, Router(), memory_url, str(tokenizer))
    server = TestServer(app.app())
    await server.start_server()
    try:
        status, state = await wait_ready(server)
        assert (status, state["eligible"]) == (200, ["a/dp0"])  # b's record was stale
        assert app.router.index.match(TOKENS) == {"a/dp0": 96}
    finally:
        await server.close()
        kv.close()
        metrics.close()


async def test_ready_from_snapshots_after_the_history_was_trimmed(
    memory_url: str, tokenizer: Path
) -> None:
    """The bus keeps 5 messages; kvbus compact ran; a router started afterwards knows
    every block engine a holds."""
    url = f"{memory_url}?maxlen=5"
    kv = kvbus.Publisher(url, stream="kv", source="a/dp0", max_batch=1)
    stored = BlockStored(list(range(1, 4)), None, TOKENS, 32, None, "GPU", None)
    kv.publish(KVEventBatch(time.time(), [stored]))
    assert kv.flush()
    await Compactor(url, "kv").run(follow=False)
    for _ in range(10):  # later engine steps that store nothing: the first is trimmed
        kv.publish(KVEventBatch(time.time(), []))
        assert kv.flush()
    await Compactor(url, "kv").run(follow=False)
    metrics = kvbus.Publisher(url, stream="metrics", source="a/dp0")
    metrics.publish(
        LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0), Kind.METRICS
    )
    assert metrics.flush()
    dead = f"http://127.0.0.1:{free_port()}"
    app = RouterApp({"a": dead}, Router(), url, str(tokenizer))
    server = TestServer(app.app())
    await server.start_server()
    try:
        status, _ = await wait_ready(server)
        assert status == 200
        assert app.router.index.match(TOKENS) == {"a/dp0": 96}
    finally:
        await server.close()
        kv.close()
        metrics.close()


async def test_metrics_export_the_engines_connector_transfers(
    memory_url: str, tokenizer: Path
) -> None:
    """With --connector-stream, /metrics sums each engine's connector records: transfer
    counts, tokens and seconds by outcome, and the additive fields of its stats."""
    from kvbus.wire.events import ConnectorBatch, ConnectorStats, TransferEvent

    def ended(direction: str, phase: str, tokens: int, seconds: float) -> TransferEvent:
        return TransferEvent(
            request_id="r", direction=direction, phase=phase, tokens=tokens, seconds=seconds
        )

    connector = kvbus.Publisher(memory_url, stream="connector", source="a/dp0")
    stats = ConnectorStats(connector="m:C", workers=msgspec.msgpack.encode({"bytes": 4096}))
    connector.publish(
        ConnectorBatch(time.time(), 1, [ended("load", "finished", 64, 0.5)], stats),
        Kind.CONNECTOR,
    )
    connector.publish(
        ConnectorBatch(
            time.time(),
            2,
            [ended("load", "finished", 32, 0.25), ended("save", "failed", 32, 0.0)],
            ConnectorStats(connector="m:C", workers=b"\xc1"),  # malformed: skipped
        ),
        Kind.CONNECTOR,
    )
    assert connector.flush()
    dead = f"http://127.0.0.1:{free_port()}"
    app = RouterApp({"a": dead}, Router(), memory_url, str(tokenizer), connector_stream="connector")
    server = TestServer(app.app())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                async with session.get(server.make_url("/metrics")) as response:
                    text = await response.text()
                if 'direction="save"' in text:
                    break
                await asyncio.sleep(0.05)

        def value(metric: str, **labels: str) -> float:
            return sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == metric and sample.labels == {"source": "a/dp0", **labels}
            )

        load = {"direction": "load", "outcome": "finished"}
        assert value("kvbus_connector_transfers_total", **load) == 2
        assert value("kvbus_connector_transfer_tokens_total", **load) == 96
        assert value("kvbus_connector_transfer_seconds_total", **load) == 0.75
        save = {"direction": "save", "outcome": "failed"}
        assert value("kvbus_connector_transfers_total", **save) == 1
        assert value("kvbus_connector_stat_total", connector="m:C", name="bytes") == 4096
        assert app.connector_metrics is not None and app.connector_metrics.malformed == 1
    finally:
        await server.close()
        connector.close()
