"""What clients and workers can make the router spend: each test reproduces a finding
against the router service (in this process, on a memory:// bus) in front of scripted
workers (aiohttp apps standing in for vLLM's HTTP server: the logic under test is the
router's; real engines are in test_router_e2e)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cluster import free_port, make_model
from kvbus.transports import Record
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus import Kind, LoadMetrics
from kvbus.routing.router import Router
from kvbus.service.gateway import RouterApp, start, stop
from kvbus.wire.envelope import SCHEMA_VERSION, Envelope, encode_envelope
from kvbus.wire.events import encode

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("tokenizer")
    make_model(model)
    return model


async def answer(request: web.Request) -> web.Response:
    """A vLLM completion, its usage included."""
    await request.read()
    usage = {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    return web.json_response({"id": "cmpl-1", "choices": [], "usage": usage})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "m", "root": "m"}]})


async def echo(request: web.Request) -> web.Response:
    """What arrived: method, path and query, body, content type."""
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path_qs,
            "body": body.decode(),
            "content_type": request.headers.get("Content-Type"),
        }
    )


class Fleet:
    """Scripted workers on loopback, load records on the bus, and the router."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.workers: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []
        self._servers: list[asyncio.Server] = []
        self.router_url = ""
        self.app: RouterApp | None = None

    async def worker(
        self, name: str, generate: Handler = answer, tokenize: Handler | None = None
    ) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", generate)
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_post("/v1/responses", generate)
        if tokenize is not None:
            app.router.add_post("/tokenize", tokenize)
        app.router.add_get("/v1/models", models)
        app.router.add_route("*", "/echo/{tail:.*}", echo)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self._runners.append(runner)
        self.workers[name] = f"http://127.0.0.1:{port}"

    async def raw_worker(self, name: str, reply: bytes) -> None:
        """A worker that answers every connection with ``reply`` and hangs up."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(65536)
            writer.write(reply)
            await writer.drain()
            writer.close()

        port = free_port()
        self._servers.append(await asyncio.start_server(handle, "127.0.0.1", port))
        self.workers[name] = f"http://127.0.0.1:{port}"

    async def _beat(self) -> None:
        """Each worker's load every second, as the stat logger sends it."""
        publishers = [
            kvbus.Publisher(self.url, stream="metrics", source=f"{name}/dp0")
            for name in self.workers
        ]
        try:
            while True:
                for publisher in publishers:
                    record = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
                    publisher.publish(record, Kind.METRICS)
                await asyncio.sleep(1)
        finally:
            for publisher in publishers:
                await publisher.aclose(1)

    async def run_router(self, tokenizer: Path, policy: str = "kv", **limits: Any) -> None:
        header_timeout = limits.pop("header_timeout", 10.0)
        self._beater = asyncio.create_task(self._beat())
        self.app = RouterApp(self.workers, Router(policy), self.url, str(tokenizer), **limits)
        port = free_port()
        self._router = await start(self.app, "127.0.0.1", port, header_timeout)
        self.router_url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                async with session.get(f"{self.router_url}/health") as response:
                    if response.status == 200:
                        return
                await asyncio.sleep(0.05)
        raise AssertionError("the router never got ready")

    async def close(self) -> None:
        if self.app is not None:
            self._beater.cancel()
            await asyncio.gather(self._beater, return_exceptions=True)
            await stop(*self._router)
        for runner in self._runners:
            await runner.cleanup()
        for server in self._servers:
            server.close()


@pytest.fixture
async def fleet(memory_url: str) -> AsyncIterator[Fleet]:
    fleet = Fleet(memory_url)
    yield fleet
    await fleet.close()


async def complete(
    fleet: Fleet, body: dict[str, Any] | bytes, timeout: float = 30
) -> tuple[int, dict[str, Any], str]:
    """Status, JSON body and serving worker of one completion through the router."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(
            f"{fleet.router_url}/v1/completions", data=data, headers=headers
        ) as response:
            return (
                response.status,
                await response.json(content_type=None),
                response.headers.get("x-kvbus-worker", ""),
            )


PROMPT = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1}


async def test_a_hanging_worker_is_timed_out_and_its_requests_go_elsewhere(
    fleet: Fleet, tokenizer: Path
) -> None:
    """One worker that accepts and never answers used to hold all 100 pooled
    connections (no timeout), and requests to the healthy worker timed out."""
    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        raise AssertionError("unreachable")

    await fleet.worker("hang", hang)
    await fleet.worker("good")
    await fleet.run_router(tokenizer, "round_robin", worker_timeout=1.0, worker_connections=2)
    results = await asyncio.gather(*(complete(fleet, PROMPT) for _ in range(12)))
    assert [(status, worker) for status, _, worker in results] == [(200, "good/dp0")] * 12
    assert fleet.app is not None and "hang/dp0" not in fleet.app.router.eligible()


@pytest.mark.parametrize(
    "reply",
    [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\ntruncated", b""],
    ids=["not-http", "truncated", "hang-up"],
)
async def test_a_worker_answering_garbage_is_marked_down_and_the_request_retried(
    fleet: Fleet, tokenizer: Path, reply: bytes
) -> None:
    """A worker answering garbage used to give the client a 500 in text/plain."""
    await fleet.raw_worker("bad", reply)
    await fleet.worker("good")
    await fleet.run_router(tokenizer, "round_robin")
    results = [await complete(fleet, PROMPT) for _ in range(4)]
    assert [(s, w) for s, _, w in results] == [(200, "good/dp0")] * 4


async def test_a_request_chat_template_is_the_engines_decision(
    fleet: Fleet, tokenizer: Path
) -> None:
    """A request-supplied chat_template used to be rendered by the router, on its loop."""
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(
            {"error": {"message": "no", "type": "BadRequestError"}}, status=400
        )

    await fleet.worker("a", chat)
    await fleet.run_router(tokenizer)
    body = {**PROMPT, "chat_template": "{% for m in messages %}" * 50}
    status, answer_body, _ = await complete(fleet, body)
    assert (status, answer_body["error"]["type"]) == (400, "BadRequestError")
    assert seen[0]["chat_template"] == body["chat_template"]  # forwarded untouched
    assert fleet.app is not None
    assert fleet.app.metrics.unrouted._value.get() == 1


async def test_a_huge_prompt_is_routed_by_load_without_tokenizing(
    fleet: Fleet, tokenizer: Path
) -> None:
    """A 10 MB prompt used to be tokenized on the event loop: seconds of no routing, no
    metrics, every other request 503."""
    await fleet.worker("a")
    await fleet.run_router(tokenizer)
    huge = {**PROMPT, "prompt": "w5 " * 3_500_000}
    other = asyncio.create_task(complete(fleet, PROMPT))
    status, _, worker = await complete(fleet, huge)
    assert (status, worker) == (200, "a/dp0")
    assert (await other)[0] == 200
    assert fleet.app is not None  # only the small prompt was tokenized
    assert fleet.app.metrics.prompt_tokens.labels("a/dp0", "kv")._value.get() < 100


async def test_a_forged_load_record_does_not_take_a_worker_out(
    fleet: Fleet, tokenizer: Path
) -> None:
    """One metrics envelope with epoch 2**64-1 used to make the worker's real records
    stale for good: no traffic for it ever again."""
    await fleet.worker("a")
    await fleet.worker("b")
    await fleet.run_router(tokenizer)
    record = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
    forged = Envelope(
        SCHEMA_VERSION, Kind.METRICS, "a/dp0", 2**64 - 1, 1, time.time(), encode(record)
    )
    await MemoryTransport(fleet.url).append(
        "metrics", [Record("a/dp0", forged.msg_id, encode_envelope(forged))]
    )
    assert fleet.app is not None
    await asyncio.sleep(fleet.app.router.stale_after + 1.5)  # stale by now, if it were
    assert "a/dp0" in fleet.app.router.eligible()


async def test_a_client_that_leaves_cancels_its_request_upstream(
    fleet: Fleet, tokenizer: Path
) -> None:
    """A handler used to run on after its client left: upstream requests piled up."""
    gone = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            gone.set()
            raise
        raise AssertionError("not cancelled")

    await fleet.worker("a", slow)
    await fleet.run_router(tokenizer)
    with pytest.raises(asyncio.TimeoutError):
        await complete(fleet, PROMPT, timeout=0.5)
    await asyncio.wait_for(gone.wait(), 10)


async def test_half_sent_requests_are_closed(fleet: Fleet, tokenizer: Path) -> None:
    """3,000 half-sent requests used to stay open for good."""
    await fleet.worker("a")
    await fleet.run_router(tokenizer, header_timeout=0.5, body_timeout=0.5)
    host, port = fleet.router_url.removeprefix("http://").split(":")
    # A head that never ends: the connection is closed.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    # A body that never ends: 408, in vLLM's shape.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()
    assert fleet.app is not None and fleet.app.metrics.slow_clients._value.get() == 1


async def test_a_path_the_router_does_not_route_by_prompt_goes_to_a_worker_unchanged(
    fleet: Fleet, tokenizer: Path
) -> None:
    """Embeddings, pooling, audio, a newer vLLM's endpoints: method, path, query, body and
    content type as sent, the worker's answer (a 404 included) as given."""
    await fleet.worker("a")
    await fleet.run_router(tokenizer)
    form = aiohttp.FormData({"model": "m"})
    form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as session:
        async with session.put(
            f"{fleet.router_url}/echo/v1/audio/transcriptions?language=en", data=form
        ) as response:
            seen = await response.json()
            worker = response.headers["x-kvbus-worker"]
        async with session.get(f"{fleet.router_url}/echo/version") as response:
            version = await response.json()
        async with session.get(f"{fleet.router_url}/v1/nonexistent") as response:
            missing = (response.status, await response.text())
    assert response.status == 404 and worker.startswith("a")
    assert seen["method"] == "PUT" and seen["path"] == "/echo/v1/audio/transcriptions?language=en"
    assert seen["content_type"].startswith("multipart/form-data; boundary=")
    assert 'filename="a.wav"' in seen["body"] and "RIFF....WAVE" in seen["body"]
    assert version == {"method": "GET", "path": "/echo/version", "body": "", "content_type": None}
    assert missing == (404, "404: Not Found")  # the worker's own answer, not the router's
    # One engine's own controls are not sent to one engine chosen by load.
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/sleep?level=1") as response:
            refused = (response.status, await response.json())
    assert refused[0] == 404 and "call each engine's own address" in refused[1]["error"]["message"]
