"""The router without its bus: NATS killed under load, a worker no engine publishes as,
and the load read from the engines' own ``/metrics`` instead (kvbus.service.gateway).

The outage test runs the real parts: nats-server (kill -9 and a restart on the same
store), one real vLLM engine with the kvbus plugin, and ``kvbus router`` in its own
process; the second worker is a small aiohttp engine of the test's own whose load the
test sets, on the bus and at its endpoint. The rest run the router in this process on a
memory:// bus with such engines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cluster import NatsServer, RouterProcess, VllmServer, free_port, make_model
from prometheus_client.parser import text_string_to_metric_families
from router_demo import WARM_UP

import kvbus
from kvbus import Kind, LoadMetrics
from kvbus.routing.router import Router
from kvbus.service.gateway import ENGINE_METRICS_MAX_BYTES, RouterApp, engine_loads

PROMPT = " ".join(f"w{i}" for i in range(30, 40))  # 10 tokens: no full block, load decides


class FakeEngine:
    """An OpenAI server's surface as vLLM shows it: ``/health``, ``/metrics`` (vLLM's
    gauges, with the figures the test sets), ``/v1/models`` and ``/v1/completions``."""

    def __init__(self, model: str = "m") -> None:
        self.model = model
        self.running = 0
        self.waiting = 0
        self.metrics_text: bytes | None = None
        """Served as /metrics instead of the gauges, when set."""
        self.metrics_delay = 0.0
        self.completions = 0
        self.server: TestServer | None = None

    def gauges(self) -> bytes:
        labels = f'engine="0",model_name="{self.model}"'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}\n"
            f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} 99.0\n'
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.25\n"
        ).encode()

    async def _metrics(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.metrics_delay)
        return web.Response(body=self.metrics_text or self.gauges(), content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.Response:
        self.completions += 1
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": self.model,
                "choices": [{"index": 0, "text": " w5", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12},
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.model, "root": self.model}]})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


async def beat(publisher: kvbus.Publisher, load: dict[str, int], every: float = 0.5) -> None:
    """An engine's stat logger: its load on the metrics stream, every ``every`` s,
    while ``load["on"]``."""
    while True:
        if load.get("on", 1):
            record = LoadMetrics(
                ts=time.time(), running=0, waiting=load.get("waiting", 0), kv_cache_usage=0.1
            )
            publisher.publish(record, Kind.METRICS)
        await asyncio.sleep(every)


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as response:
        return response.status, await response.json(content_type=None)


async def complete(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, response.headers.get("x-kvbus-worker", ""), await response.json()


async def until(check: Any, timeout: float = 30.0, every: float = 0.1) -> Any:
    """Await ``check()`` until it returns something truthy (bounded)."""
    async with asyncio.timeout(timeout):
        while not (found := await check()):  # noqa: ASYNC110 - polls another process
            await asyncio.sleep(every)
        return found


# --- parsing an engine's /metrics --------------------------------------------------------


def test_engine_loads_reads_vllms_gauges_per_engine() -> None:
    text = b"\n".join(
        [
            b"# HELP vllm:num_requests_running Number of requests in model execution batches.",
            b'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            b'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
            b'vllm:num_requests_waiting{engine="1",model_name="m"} -7.0',  # clamped to 0
            b'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 50.0',
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            b'vllm:num_requests_running{engine="2",model_name="m"} NaN',  # not a number
            b'vllm:num_requests_waiting{engine="2",model_name="m"} 1.0',
            b'vllm:num_requests_running{engine="3"} 1e30',  # capped
            b'vllm:num_requests_waiting{engine="3"} 0',
            b"vllm:num_requests_running_total 5.0",  # another series
            b'vllm:num_requests_running{model_name="m",engine="4"',  # cut off
        ]
    )
    loads = engine_loads(text, 123.0)
    assert sorted(loads) == [0, 1, 3]
    assert (loads[0].running, loads[0].waiting, loads[0].kv_cache_usage) == (2, 3, 0.5)
    assert (loads[1].running, loads[1].waiting, loads[1].engine_index) == (1, 0, 1)
    assert loads[3].running == 2**31 and loads[0].ts == 123.0
    unlabelled = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 4"
    assert engine_loads(unlabelled, 0)[0].waiting == 4
    assert engine_loads(b"", 0) == {} and engine_loads(b"\x00" * 1000, 0) == {}


# --- a worker no engine publishes as ---------------------------------------------------------


@pytest.fixture
async def engines() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    a, b = FakeEngine(), FakeEngine()
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tokenizer")
    make_model(model)
    return model


@contextlib.asynccontextmanager
async def serving(app: RouterApp) -> AsyncIterator[str]:
    server = TestServer(app.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_a_worker_no_engine_publishes_as_is_named_and_still_routed(
    memory_url: str,
    tokenizer: Path,
    engines: tuple[FakeEngine, FakeEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--worker a=...`` while engine a publishes as ``worker-a/dp0``: /health says so
    (still ready), one log line says so, and a gets traffic by its own endpoint's load
    (b, on the bus, is busy)."""
    a, b = engines
    workers = {"a": await a.start(), "b": await b.start()}
    publishers = [
        kvbus.Publisher(memory_url, stream="metrics", source=s) for s in ("worker-a/dp0", "b/dp0")
    ]
    beats = [
        asyncio.create_task(beat(publishers[0], {})),
        asyncio.create_task(beat(publishers[1], {"waiting": 20})),
    ]
    app = RouterApp(
        workers, Router(stale_after=1.0), memory_url, str(tokenizer), engine_poll_interval=0.1
    )
    caplog.set_level(logging.WARNING, "kvbus.routing.router")
    try:
        async with serving(app) as url, aiohttp.ClientSession() as session:

            async def named() -> Any:
                status, state = await get(session, f"{url}/health")
                return state if status == 200 and state["problems"] else None

            state = await until(named)
            assert state["problems"] == [
                "no engine publishes as `a`; sources seen: `worker-a/dp0` "
                "(set KVBUS_SOURCE=a on that engine, or --worker worker-a=URL)"
            ]
            assert state["bus"] == "up" and state["routing"] == "degraded (load from engines)"
            assert state["engine_load"] == ["a/dp0"] and "b/dp0" in state["eligible"]
            answers = [await complete(session, url, "m") for _ in range(5)]
            assert [(s, w) for s, w, _ in answers] == [(200, "a/dp0")] * 5
            assert a.completions == 5
            await asyncio.sleep(0.5)  # several more checks: still one line
            told = [r for r in caplog.records if "no engine publishes as" in r.getMessage()]
            assert len(told) == 1
    finally:
        for task in beats:
            task.cancel()
        for publisher in publishers:
            await publisher.aclose()


async def test_the_503_says_which_names_the_bus_carries(
    memory_url: str, tokenizer: Path, engines: tuple[FakeEngine, FakeEngine]
) -> None:
    """Worker a's endpoint does not answer and no engine publishes as a: the 503 says what
    to set. A name from the bus is shown escaped (it comes from the network)."""
    publisher = kvbus.Publisher(memory_url, stream="metrics", source="evil\x1b[2J/dp0")
    beating = asyncio.create_task(beat(publisher, {}))
    dead = f"http://127.0.0.1:{free_port()}"
    app = RouterApp(
        {"a": dead}, Router(stale_after=1.0), memory_url, str(tokenizer), engine_poll_interval=0.1
    )
    try:
        async with serving(app) as url, aiohttp.ClientSession() as session:

            async def refused() -> Any:
                status, _, body = await complete(session, url, "m")
                assert status == 503
                message = body["error"]["message"]
                return message if "no engine publishes" in message else None

            message = await until(refused)
            assert message == (
                "No vLLM server is available: every worker is down or silent. no engine "
                "publishes as `a`; sources seen: `evil\\x1b[2J/dp0` (set KVBUS_SOURCE=a on "
                "that engine, or --worker evil\\x1b[2J=URL)."
            )
    finally:
        beating.cancel()
        await publisher.aclose()


async def test_an_engine_endpoint_too_large_or_too_slow_costs_a_bounded_read(
    memory_url: str, tokenizer: Path, engines: tuple[FakeEngine, FakeEngine]
) -> None:
    """No bus at all: a's /metrics is over ENGINE_METRICS_MAX_BYTES, b's never ends in
    time. Neither is routed to; both reads are counted; the router answers 503 at once
    and then routes to b as soon as its /metrics answers."""
    a, b = engines
    a.metrics_text = b"#" * (ENGINE_METRICS_MAX_BYTES + 1)
    b.metrics_delay = 3600
    workers = {"a": await a.start(), "b": await b.start()}
    app = RouterApp(
        workers, Router(stale_after=0.5), memory_url, str(tokenizer), engine_poll_interval=0.05
    )
    async with serving(app) as url, aiohttp.ClientSession() as session:

        def polls(outcome: str) -> float:
            value = app.metrics.registry.get_sample_value(
                "kvbus_router_engine_polls_total", {"outcome": outcome}
            )
            return value or 0.0

        await until(lambda: asyncio.sleep(0, polls("too_large") >= 2 and polls("failed") >= 2))
        assert app.router.eligible() == []
        status, _, _ = await complete(session, url, "m")
        assert status == 503
        b.metrics_delay = 0
        await until(lambda: asyncio.sleep(0, app.router.eligible() == ["b/dp0"]))
        status, worker, _ = await complete(session, url, "m")
        assert (status, worker) == (200, "b/dp0")


# --- NATS killed under load --------------------------------------------------------------


class Outage:
    """nats-server, one real vLLM engine (a) and a fake one (b), started once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.model = directory / "model"
        self.model.mkdir()
        make_model(self.model)
        self.nats = NatsServer(directory)
        self.engine = VllmServer(directory, self.model, "a", "", blocks=64)

    def start(self) -> None:
        self.nats.start()
        self.engine.kvbus_url = self.nats.url
        self.engine.launch()
        self.engine.wait_healthy()
        self.engine.complete(WARM_UP)

    def stop(self) -> None:
        self.engine.stop()
        self.nats.stop()


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    parts = Outage(tmp_path_factory.mktemp("outage"))
    try:
        parts.start()
        yield parts
    finally:
        parts.stop()


def test_a_real_engines_metrics_give_its_load(outage: Outage) -> None:
    """What vLLM serves on /metrics (the gauges' names, the engine label) is read: one
    engine, rank 0, its KV cache usage a fraction; well under the bytes a read may take."""
    with urllib.request.urlopen(f"{outage.engine.url}/metrics", timeout=10) as response:
        text = response.read()
    assert len(text) < ENGINE_METRICS_MAX_BYTES // 8
    loads = engine_loads(text, time.time())
    assert list(loads) == [0]
    assert loads[0].running == loads[0].waiting == 0  # idle
    assert 0.0 <= loads[0].kv_cache_usage <= 1.0


def router_metric(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def test_nats_killed_for_10_s_under_load_fails_no_request(
    outage: Outage, tmp_path: Path
) -> None:
    """kill -9 of nats-server for 10 s while requests flow through ``kvbus router``:
    none fails; /health says the bus is down and routing degraded (still 200), requests
    go on being routed by the load each engine's own /metrics shows (b shows a queue of
    50 there: none goes to it), and full routing is back, index intact, once NATS is."""
    fake = FakeEngine(str(outage.model))
    workers = {"a": outage.engine.url, "b": await fake.start()}
    publisher = kvbus.Publisher(outage.nats.url, stream="metrics", source="b/dp0")
    b_bus: dict[str, int] = {}
    beating = asyncio.create_task(beat(publisher, b_bus))
    router = RouterProcess(tmp_path, workers, "kv", outage.nats.url, cli=True)
    router.launch()
    results: list[tuple[float, int, str]] = []
    stop = asyncio.Event()

    async def load(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            status, worker, _ = await complete(session, router.url, str(outage.model))
            results.append((time.monotonic(), status, worker))
            await asyncio.sleep(0.05)

    try:
        await asyncio.to_thread(router.wait_ready, 2, 60)
        # Blocks in the index, to show they outlive the outage.
        await asyncio.to_thread(outage.engine.complete, " ".join(f"w{i}" for i in range(99, 199)))
        async with aiohttp.ClientSession() as session:

            async def indexed() -> Any:
                async with session.get(f"{router.url}/metrics") as response:
                    text = await response.text()
                return text if router_metric(text, "kvbus_router_indexed_blocks") else None

            metrics_before = await until(indexed)
            clients = [asyncio.create_task(load(session)) for _ in range(2)]
            await asyncio.sleep(2)

            # The outage: NATS dies; b's endpoint now shows a queue of 50.
            fake.waiting = 50
            b_bus["on"] = 0
            outage.nats.kill()
            killed = time.monotonic()

            def no_failures() -> None:
                failed = [(round(t - killed, 1), s) for t, s, _ in results if s != 200]
                assert not failed, f"(seconds after the kill, status): {failed}"

            async def degraded() -> Any:
                no_failures()
                status, state = await get(session, f"{router.url}/health")
                both = state.get("engine_load") == ["a/dp0", "b/dp0"]
                return (status, state) if state.get("bus") == "down" and both else None

            status, state = await until(degraded)
            assert status == 200 and state["ready"] is True
            assert state["routing"] == "degraded (load from engines)"
            announced = time.monotonic()
            await asyncio.sleep(max(0.0, 10 - (announced - killed)))

            outage.nats.start()  # the same port and store
            b_bus["on"], fake.waiting = 1, 0

            async def recovered() -> Any:
                _, state = await get(session, f"{router.url}/health")
                return state if state["routing"] == "full" else None

            state = await until(recovered, timeout=60)
            assert state["bus"] == "up" and sorted(state["eligible"]) == ["a/dp0", "b/dp0"]
            back = time.monotonic()
            await asyncio.sleep(1)
            stop.set()
            await asyncio.gather(*clients)
            async with session.get(f"{router.url}/metrics") as response:
                metrics_after = await response.text()
    finally:
        stop.set()
        beating.cancel()
        router.stop()
        await publisher.aclose()
        await fake.close()

    no_failures()
    during = [w for t, _, w in results if announced <= t < killed + 10]
    assert len(during) >= 10 and set(during) == {"a/dp0"}, during  # by load: b is queued
    assert [w for t, _, w in results if t >= back]  # served after the recovery too
    assert router_metric(metrics_after, "kvbus_router_degraded_routes_total") >= len(during)
    assert router_metric(metrics_after, "kvbus_router_bus_up") == 1
    blocks = router_metric(metrics_before, "kvbus_router_indexed_blocks")
    assert blocks > 0 and router_metric(metrics_after, "kvbus_router_indexed_blocks") >= blocks
