"""`StreamWatch`: a relayed stream's stalls, worker side and client side, from one timer
a stream; and, through the router, a worker that goes silent mid-stream and a client
that stops reading, each still cut off in their limit."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from kvbus.service.stream_watch import StreamWatch

from .test_gateway_limits import PROMPT, Fleet
from .test_gateway_limits import fleet as fleet  # the fixtures
from .test_gateway_limits import tokenizer as tokenizer


class Reader:
    """A worker's response content: records the exception a stall sets."""

    def __init__(self) -> None:
        self.exception: BaseException | None = None
        self.at = 0.0

    def set_exception(self, exception: BaseException) -> None:
        self.exception, self.at = exception, time.monotonic()


class Transport:
    """A client's connection: records its abort."""

    def __init__(self) -> None:
        self.aborted_at: float | None = None

    def abort(self) -> None:
        self.aborted_at = time.monotonic()


async def test_a_silent_worker_is_stalled_after_its_limit_and_progress_keeps_it_alive() -> None:
    reader, transport = Reader(), Transport()
    began = time.monotonic()
    watch = StreamWatch(0.3, 5.0, reader, transport)  # type: ignore[arg-type]
    for _ in range(6):  # a token every 0.1 s for 0.6 s: twice the limit, never silent
        await asyncio.sleep(0.1)
        watch.reading()
    assert reader.exception is None and watch.stalled is None
    silent_from = time.monotonic()
    await asyncio.sleep(0.6)
    assert watch.stalled == "worker" and isinstance(reader.exception, TimeoutError)
    assert 0.3 <= reader.at - silent_from < 0.5
    assert reader.at - began > 0.6
    assert transport.aborted_at is None
    watch.close()


async def test_a_client_that_reads_nothing_is_aborted_at_the_shorter_limit() -> None:
    """The timer is armed for the worker's long limit while reading; a write then
    started must still be caught at the client's short one."""
    reader, transport = Reader(), Transport()
    told: list[float] = []
    watch = StreamWatch(
        30.0,
        0.2,
        reader,
        transport,
        lambda: told.append(time.monotonic()),  # type: ignore[arg-type]
    )
    await asyncio.sleep(0.5)  # reading: 0.5 s of a 30 s limit
    assert watch.stalled is None
    watch.writing()
    writing_from = time.monotonic()
    await asyncio.sleep(0.5)
    assert watch.stalled == "client" and transport.aborted_at is not None
    assert 0.2 <= transport.aborted_at - writing_from < 0.35
    assert told and told[0] <= transport.aborted_at  # counted before the abort
    assert reader.exception is None
    watch.close()


async def test_a_closed_watch_does_nothing_more() -> None:
    reader, transport = Reader(), Transport()
    watch = StreamWatch(0.1, 0.1, reader, transport)  # type: ignore[arg-type]
    watch.close()
    await asyncio.sleep(0.3)
    assert watch.stalled is None and reader.exception is None and transport.aborted_at is None


async def test_a_worker_silent_mid_stream_is_cut_off_and_marked_down(
    fleet: Fleet, tokenizer: Path
) -> None:
    """The client gets what the worker sent, then the end of its connection, within
    --worker-timeout of the silence; the worker is marked down."""
    never = asyncio.Event()
    first = b'data: {"id":"cmpl-1","object":"text_completion","choices":[]}\n\n'

    async def one_event_then_silence(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first)
        await never.wait()
        raise AssertionError("unreachable")

    await fleet.worker("silent", one_event_then_silence)
    await fleet.run_router(tokenizer, "round_robin", worker_timeout=1.0)
    body = json.dumps({**PROMPT, "stream": True}).encode()
    received = bytearray()
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(
            f"{fleet.router_url}/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        ) as response:
            assert response.status == 200
            assert response.headers["x-kvbus-worker"] == "silent/dp0"
            began = time.monotonic()
            try:
                async for chunk in response.content.iter_any():
                    received += chunk
            except aiohttp.ClientPayloadError:
                pass  # cut off mid-stream, as the worker broke it off
            ended = time.monotonic() - began
    assert bytes(received) == first
    assert 0.5 < ended < 5.0
    assert fleet.app is not None and "silent/dp0" not in fleet.app.router.eligible()


async def test_stalls_repeated_leave_nothing_held(fleet: Fleet, tokenizer: Path) -> None:
    """A soak of both stalls on one worker with one connection: 25 times a client that
    stops reading mid-stream, a worker silent mid-stream, then a whole stream. Each
    stall is counted once (the client's) or marks the worker down (the worker's), and
    frees the one connection and the body's bytes: the whole stream after them gets
    through each time."""
    never = asyncio.Event()
    event = b'data: {"id":"cmpl-1","object":"text_completion","choices":[]}\n\n'
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 4}}).encode()

    async def scripted(request: web.Request) -> web.StreamResponse:
        prompt = json.loads(await request.read())["prompt"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if "w9" in prompt:  # a flood, for a client that reads nothing
            while True:
                await response.write(b"data: " + b"x" * 65536 + b"\n\n")
        await response.write(event)
        if "w10" in prompt:  # silent after its first event
            await never.wait()
        await response.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        return response

    await fleet.worker("w", scripted)
    await fleet.run_router(
        tokenizer,
        "round_robin",
        worker_connections=1,
        client_write_timeout=0.2,
        worker_timeout=0.3,
        down_for=0.05,
    )
    assert fleet.app is not None
    host, port = fleet.router_url.removeprefix("http://").split(":")

    async def stream(prompt: str) -> bytes:
        body = {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True}
        received = bytearray()
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{fleet.router_url}/v1/completions", json=body) as answer:
                assert answer.status == 200
                try:
                    async for chunk in answer.content.iter_any():
                        received += chunk
                except aiohttp.ClientPayloadError:
                    pass
        return bytes(received)

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.025)
        raise AssertionError("not in 5 s")

    rounds = 25
    for round_ in range(rounds):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": "m", "prompt": "w5 w9", "stream": True}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        counted = round_ + 1  # the client reads nothing: counted once
        await until(lambda: stalled_clients(fleet) == counted)  # noqa: B023 (awaited here)
        writer.close()
        assert await stream("w5 w10") == event  # then cut off
        await until(lambda: "w/dp0" in fleet.app.router.eligible())  # type: ignore[union-attr]
        whole = await stream("w5 w6")
        assert whole.endswith(b"data: [DONE]\n\n"), whole[-200:]
    assert stalled_clients(fleet) == rounds
    assert fleet.app.bodies.held == 0


def stalled_clients(fleet: Fleet) -> float:
    assert fleet.app is not None
    return float(fleet.app.metrics.stalled_clients._value.get())
