"""Issue 28, the router's HTTP side: what request bodies, slow readers, half-sent keep-alive
requests and a compressing worker used to cost it, and a SIGTERM with the bus down. The
router runs as a service (in this process on a memory:// bus, or as ``kvbus router`` on
a real nats-server) in front of scripted workers: aiohttp apps standing in for vLLM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cluster import RouterProcess

import kvbus
from kvbus import Kind, LoadMetrics

from .servers import NatsServer, free_port
from .test_gateway_limits import PROMPT, Fleet, complete
from .test_gateway_limits import fleet as fleet  # the fixtures
from .test_gateway_limits import tokenizer as tokenizer

USAGE = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}


def counter(fleet: Fleet, name: str, *labels: str) -> float:
    assert fleet.app is not None
    metric = getattr(fleet.app.metrics, name)
    return float((metric.labels(*labels) if labels else metric)._value.get())


def host_port(fleet: Fleet) -> tuple[str, int]:
    host, port = fleet.router_url.removeprefix("http://").split(":")
    return host, int(port)


async def held_worker(release: asyncio.Event, arrived: asyncio.Event | None = None) -> Any:
    """A worker that answers (usage included) once ``release`` is set."""

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        if arrived is not None:
            arrived.set()
        await release.wait()
        return web.json_response({"id": "cmpl-1", "choices": [], "usage": USAGE})

    return handle


async def test_a_body_over_max_body_bytes_is_refused_with_vllms_shape(
    fleet: Fleet, tokenizer: Path
) -> None:
    """Bodies used to be read whole up to 64 MiB each, however many at once."""
    await fleet.worker("a")
    await fleet.run_router(tokenizer, max_body_bytes=2**16, max_held_body_bytes=2**20)
    big = json.dumps({**PROMPT, "prompt": "w5 " * 30_000}).encode()  # 90 KB
    status, body, worker = await complete(fleet, big)
    assert (status, body["error"]["code"], worker) == (413, 413, "")
    # Chunked, with no length said up front: refused once it passes the limit.

    async def chunks() -> Any:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/v1/completions", data=chunks()) as response:
            assert response.status == 413
            assert (await response.json())["error"]["type"] == "RequestEntityTooLarge"
    assert counter(fleet, "refused", "body_too_large") == 2
    assert (await complete(fleet, PROMPT))[0] == 200  # a body under it is served
    assert fleet.app is not None and fleet.app.bodies.held == 0


async def test_bodies_held_at_once_are_capped_and_given_back(fleet: Fleet, tokenizer: Path) -> None:
    """Eight 60 MiB bodies used to cost the router 1.35 GiB: nothing capped how many
    it held at once."""
    release, arrived = asyncio.Event(), asyncio.Event()
    await fleet.worker("a", await held_worker(release, arrived))
    await fleet.run_router(tokenizer, max_body_bytes=2**20, max_held_body_bytes=2**20)
    body = json.dumps({**PROMPT, "prompt": "w5 " * 200_000}).encode()  # 600 KB
    first = asyncio.create_task(complete(fleet, body))
    await asyncio.wait_for(arrived.wait(), 30)  # its body held: it may be retried
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{fleet.router_url}/v1/completions", data=body, headers=headers
        ) as response:
            refused = (response.status, response.headers.get("Retry-After"), await response.json())
    assert refused[:2] == (503, "1")
    assert refused[2]["error"]["type"] == "ServiceUnavailableError"
    assert counter(fleet, "refused", "bodies_held") == 1
    release.set()
    assert (await first)[0] == 200
    assert fleet.app is not None and fleet.app.bodies.held == 0  # all given back
    assert (await complete(fleet, body))[0] == 200


async def test_a_streamed_response_gives_its_body_back_at_the_first_byte(
    fleet: Fleet, tokenizer: Path
) -> None:
    """A stream is never retried: its body need not be held while it lasts."""
    done = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\n')
        await done.wait()
        await response.write(b"data: [DONE]\n\n")
        return response

    await fleet.worker("a", stream)
    await fleet.run_router(tokenizer, max_body_bytes=2**20, max_held_body_bytes=2**20)
    body = json.dumps({**PROMPT, "prompt": "w5 " * 200_000, "stream": True}).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/v1/completions", data=body) as streaming:
            await streaming.content.readline()  # the first event came through
            assert fleet.app is not None and fleet.app.bodies.held == 0
            async with session.post(f"{fleet.router_url}/v1/completions", data=body) as second:
                assert second.status == 200  # its body fitted in beside the first's
                done.set()
                assert (await second.read()).endswith(b"data: [DONE]\n\n")
            await streaming.read()


async def test_a_client_that_stops_reading_is_dropped_and_the_worker_stays_up(
    fleet: Fleet, tokenizer: Path
) -> None:
    """A client that stopped reading a stream used to hold the worker's connection for
    good; once all were held, the next request waited --worker-timeout in the pool and
    the healthy worker was marked down."""
    upstream_gone = asyncio.Event()

    async def flood(request: web.Request) -> web.StreamResponse:
        if not json.loads(await request.read()).get("stream"):
            return web.json_response({"id": "cmpl-2", "choices": [], "usage": USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: " + b"x" * 65536 + b"\n\n")
        except (ConnectionError, asyncio.CancelledError):
            upstream_gone.set()
            raise

    await fleet.worker("a", flood)
    await fleet.run_router(
        tokenizer, worker_connections=1, client_write_timeout=0.5, worker_timeout=5.0
    )
    host, port = host_port(fleet)
    stalled = socket.create_connection((host, port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({**PROMPT, "stream": True}).encode()
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:  # it reads nothing, ever
        await asyncio.wait_for(upstream_gone.wait(), 30)
        assert counter(fleet, "stalled_clients") == 1
        assert fleet.app is not None and "a/dp0" in fleet.app.router.eligible()
        status, _, worker = await complete(fleet, PROMPT)  # the one connection is free
        assert (status, worker) == (200, "a/dp0")
    finally:
        stalled.close()


async def test_a_wait_for_a_busy_workers_connection_is_not_its_fault(
    fleet: Fleet, tokenizer: Path
) -> None:
    """Waiting for a pooled connection used to count as the worker timing out: a
    healthy, busy worker was marked down and every request got 503."""
    release, arrived = asyncio.Event(), asyncio.Event()
    await fleet.worker("a", await held_worker(release, arrived))
    await fleet.run_router(tokenizer, worker_connections=1, pool_timeout=0.3, worker_timeout=5.0)
    first = asyncio.create_task(complete(fleet, PROMPT))
    await asyncio.wait_for(arrived.wait(), 30)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/v1/completions", json=PROMPT) as response:
            assert (response.status, response.headers.get("Retry-After")) == (503, "1")
    assert counter(fleet, "busy", "a/dp0") == 1
    assert fleet.app is not None and "a/dp0" in fleet.app.router.eligible()
    release.set()
    assert (await first)[:3:2] == (200, "a/dp0")
    assert (await complete(fleet, PROMPT))[0] == 200


async def a_worker_behind(
    fleet: Fleet, tokenizer: Path
) -> tuple[asyncio.Event, asyncio.Event, asyncio.Task[Any]]:
    """Worker a (held until ``release``) and a router; a request routed there 0.5 s ago
    that has not started (``arrived`` is set again when another comes): its worker
    runs at least 0.5 s behind."""
    release, arrived = asyncio.Event(), asyncio.Event()
    await fleet.worker("a", await held_worker(release, arrived))
    await fleet.run_router(tokenizer)
    first = asyncio.create_task(complete(fleet, PROMPT))
    await asyncio.wait_for(arrived.wait(), 30)
    await asyncio.sleep(0.5)
    arrived.clear()
    return release, arrived, first


async def test_a_request_the_worker_would_start_too_late_is_shed_at_once(
    fleet: Fleet, tokenizer: Path
) -> None:
    """--shed-after: a request whose worker should take longer than that to its first
    token (here: a request routed there 0.5 s ago has not started) is answered 503 at
    once, in vLLM's shape, and takes nothing from the worker; it stays eligible."""
    release, arrived, first = await a_worker_behind(fleet, tokenizer)
    assert fleet.app is not None
    fleet.app.router.shed_after = 0.3
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/v1/completions", json=PROMPT) as response:
            shed = (response.status, response.headers.get("Retry-After"), await response.json())
    assert shed[:2] == (503, "1")
    assert shed[2]["error"]["type"] == "ServiceUnavailableError"
    assert "--shed-after is 0.3 s" in shed[2]["error"]["message"]
    assert counter(fleet, "shed", "first_token") == 1 and not arrived.is_set()
    assert "a/dp0" in fleet.app.router.eligible()
    release.set()
    assert (await first)[:3:2] == (200, "a/dp0")
    assert (await complete(fleet, PROMPT))[0] == 200  # nothing waits there now
    assert counter(fleet, "shed", "first_token") == 1


async def test_a_request_past_the_routers_deadline_is_shed_unless_it_gives_its_own(
    fleet: Fleet, tokenizer: Path
) -> None:
    """--deadline: a request whose worker should end it later than that (here its first
    token alone: a request routed there 0.5 s ago has not started) is answered 503 at
    once; one whose X-Kvbus-Deadline gives it longer goes; a deadline that is not a
    positive number of seconds is refused."""
    release, arrived, first = await a_worker_behind(fleet, tokenizer)
    assert fleet.app is not None
    fleet.app.router.deadline = 0.3
    url = f"{fleet.router_url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=PROMPT) as response:
            shed = (response.status, await response.json())
        for bad in ("soon", "-1", "0", "nan", "inf", "1e999"):
            async with session.post(url, json=PROMPT, headers={"X-Kvbus-Deadline": bad}) as r:
                refused = (r.status, (await r.json())["error"]["message"])
            assert refused[0] == 400 and "X-Kvbus-Deadline" in refused[1]
        assert not arrived.is_set()
        given = asyncio.create_task(
            session.post(url, json=PROMPT, headers={"X-Kvbus-Deadline": "30"})
        )
        await asyncio.wait_for(arrived.wait(), 30)  # it went to the worker
        release.set()
        async with await given as response:
            assert response.status == 200
    assert shed[0] == 503
    assert "left of the router's --deadline of 0.3 s" in shed[1]["error"]["message"]
    assert counter(fleet, "shed", "deadline") == 1
    assert counter(fleet, "shed", "first_token") == 0
    assert (await first)[:3:2] == (200, "a/dp0")


@pytest.mark.parametrize(
    ("path", "choices"),
    [("/v1/chat/completions", 1), ("/v1/completions", 1), ("/v1/completions", 2)],
)
async def test_a_workers_seconds_per_token_are_its_streams_steps_not_its_prefill(
    fleet: Fleet, tokenizer: Path, path: str, choices: int
) -> None:
    """The router times a worker's steps by the gaps between the chunks of its streams:
    not the first gap (a server may send a chat's role before the prefill), not the
    usage and [DONE] sent with the last token; the usage's output tokens make the mean
    output. With ``n`` choices each step brings an event of each still generating, and
    the usage counts all of their tokens: a step is still one step, an answer's output
    its tokens a choice. Here the second choice stops after two tokens, and the relay
    reads the first's last four steps at once."""
    steps = 0.05

    def event(index: int, token: int, finish: str | None = None) -> bytes:
        choice = {"index": index, "text": f"w{token}", "finish_reason": finish}
        return b"data: %s\n\n" % json.dumps({"choices": [choice]}).encode()

    async def streaming(request: web.Request) -> web.StreamResponse:
        await request.read()
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n')
        await asyncio.sleep(2.0)  # the prefill, after the role
        if choices == 1:
            for token in range(5):
                await asyncio.sleep(steps if token else 0)  # the usage comes with the last
                await stream.write(event(0, token))
            output = 5
        else:
            await stream.write(event(0, 0) + event(1, 0))
            await asyncio.sleep(steps)
            await stream.write(event(0, 1) + event(1, 1, "stop"))
            await asyncio.sleep(4 * steps)
            await stream.write(b"".join(event(0, token) for token in range(2, 6)))
            output = 8  # 6 and 2
        usage = {**USAGE, "completion_tokens": output}
        await stream.write(b'data: {"choices": [], "usage": %s}\n\n' % json.dumps(usage).encode())
        await stream.write(b"data: [DONE]\n\n")
        return stream

    await fleet.worker("a", streaming)
    await fleet.run_router(tokenizer)
    assert fleet.app is not None
    router = fleet.app.router
    body = {**PROMPT, "stream": True, "stream_options": {"include_usage": True}, "n": choices}
    if path.endswith("chat/completions"):
        body = {"model": PROMPT["model"], "messages": [{"role": "user", "content": "w5 w6"}]}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}{path}", json=body) as response:
            assert response.status == 200 and (await response.read()).endswith(b"[DONE]\n\n")
    learned = router.seconds_per_token("a/dp0")
    # Learned from the steps alone: the 2 s before the first token would read far more,
    # each step's events taken as steps (n of them) a fraction, and the four steps read
    # at once as two (a finished choice's events counted) 1.7 times too slow.
    assert 0.75 * steps <= learned < (8 if choices == 1 else 1.45) * steps
    assert router.admission.decode_times.mean_output == (5 if choices == 1 else 4)
    text = fleet.app.metrics.registry.get_sample_value(
        "kvbus_router_seconds_per_output_token", {"worker": "a/dp0"}
    )
    assert text == learned
    # Past a deadline under the usual output's steps, a completion that may run that
    # long is shed; one for a single token, and a pass-through (no output), are not.
    router.deadline = 3 * learned
    async with aiohttp.ClientSession() as session:
        unlimited = {"model": PROMPT["model"], "prompt": "w5 w6 w7 w8"}
        async with session.post(f"{fleet.router_url}/v1/completions", json=unlimited) as response:
            assert response.status == 503
        async with session.get(f"{fleet.router_url}/echo/x") as response:
            assert response.status == 200
    assert counter(fleet, "shed", "deadline") == 1


async def test_a_responses_stream_starts_at_its_output_not_at_its_created_event(
    fleet: Fleet, tokenizer: Path
) -> None:
    """vLLM's Responses API sends ``response.created`` and ``response.in_progress`` as it
    accepts a request, before the prefill: the router used to count the request started
    there (its prefill no longer queued, its first token timed at once)."""
    output, stream_done = asyncio.Event(), asyncio.Event()

    def event(kind: str) -> bytes:
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps({"type": kind}).encode())

    async def responding(request: web.Request) -> web.StreamResponse:
        await request.read()
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(event("response.created"))
        await stream.write(event("response.in_progress"))
        await output.wait()  # the prefill
        began = event("response.output_item.added") + event("response.output_text.delta")
        await stream.write(began)
        await stream_done.wait()
        await stream.write(event("response.completed"))
        return stream

    await fleet.worker("a", responding)
    await fleet.run_router(tokenizer)
    assert fleet.app is not None
    state = fleet.app.router.state
    number = state.load_workers["a/dp0"]
    body = {"model": PROMPT["model"], "input": "w5 w6 w7 w8", "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/v1/responses", json=body) as response:
            assert response.status == 200
            assert b"response.created" in await response.content.readuntil(b"\n\n")
            await asyncio.sleep(0.3)  # the in_progress event relayed too
            assert state.requests.streaming(number) == 0  # its prefill still ahead
            output.set()
            await response.content.readuntil(b"response.output_text.delta")
            for _ in range(100):
                if state.requests.streaming(number):
                    break
                await asyncio.sleep(0.02)
            assert state.requests.streaming(number) == 1  # started: past its prefill
            stream_done.set()
            assert (await response.read()).endswith(b"\n\n")


def test_a_responses_stream_begins_at_its_first_event_past_the_preamble_however_split() -> None:
    """`ResponsesOpening` over the chunks a relay may read: the preamble's events split
    anywhere (a large ``response.created`` comes in pieces, an event line cut in two),
    an ``event:`` inside an event's JSON, and a server that names no events."""
    from kvbus.service.upstream import ResponsesOpening

    created = b'event: response.created\ndata: {"instructions": "say event: x"}\n\n'
    progress = b"event: response.in_progress\ndata: {}\n\n"
    output = b"event: response.output_item.added\ndata: {}\n\n"
    stream = created + progress + output
    preamble = len(created + progress)
    cuts = [[], [7], [30], [preamble - 20], [preamble + 9], [len(created) + 3, preamble + 1]]
    for at in [*cuts, list(range(1, len(stream)))]:  # the last: a byte at a time
        opening, began_at = ResponsesOpening(), None
        for start, end in zip([0, *at], [*at, len(stream)], strict=True):
            if opening.passed(stream[start:end]):
                began_at = end
                break
        assert began_at is not None and began_at > preamble, at  # past the preamble
    # Read a byte at a time, it begins as soon as the output event's line is whole.
    assert began_at == preamble + len(b"event: response.output_item.added\n")
    assert ResponsesOpening().passed(b'data: {"type": "response.created"}\n\n')  # no names
    assert not ResponsesOpening().passed(b"event: ")  # a name to come


async def test_a_half_sent_second_request_on_a_keep_alive_connection_is_closed(
    fleet: Fleet, tokenizer: Path
) -> None:
    """--header-timeout used to cover a connection's first request only: half of a
    second one kept the connection open 75-90 s."""
    await fleet.worker("a")
    await fleet.run_router(tokenizer, header_timeout=0.5)
    reader, writer = await asyncio.open_connection(*host_port(fleet))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if b"Content-Length" in line
        )
        await asyncio.wait_for(reader.readexactly(length), 10)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
    finally:
        writer.close()
    assert counter(fleet, "slow_clients") >= 1


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
async def test_a_worker_that_gzips_reaches_the_client_readable(
    fleet: Fleet, tokenizer: Path, streamed: bool
) -> None:
    """The worker's Content-Encoding: gzip used to be passed on over the body aiohttp
    had already decompressed: the client could not read it."""
    encodings: list[str] = []
    events = [b'data: {"choices": []}\n\n', b'data: {"choices": [], "usage": %s}\n\n']

    async def gzipping(request: web.Request) -> web.StreamResponse:
        await request.read()
        encodings.append(request.headers.get("Accept-Encoding", ""))
        usage = json.dumps(USAGE).encode()
        if not streamed:
            response = web.json_response({"id": "cmpl-1", "choices": [], "usage": USAGE})
            response.enable_compression(force=web.ContentCoding.gzip)  # asked or not
            return response
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        stream.enable_compression(force=web.ContentCoding.gzip)
        await stream.prepare(request)
        for event in (events[0], events[1] % usage, b"data: [DONE]\n\n"):
            await stream.write(event)
        return stream

    await fleet.worker("a", gzipping)
    await fleet.run_router(tokenizer)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(
            f"{fleet.router_url}/v1/completions", json={**PROMPT, "stream": streamed}
        ) as response:
            raw = await response.read()
            encoding = response.headers.get("Content-Encoding")
    assert response.status == 200 and encoding is None
    if streamed:
        assert raw.endswith(b"data: [DONE]\n\n") and b'"cached_tokens": 3' in raw
    else:
        assert json.loads(raw)["usage"] == USAGE
    assert encodings == ["identity"]  # the router asks for none
    # The router read the usage: its prediction was checked against it.
    assert fleet.app is not None
    assert fleet.app.metrics.reported.labels("a/dp0", "kv")._sum.get() == 3


async def test_sigterm_ends_the_router_while_the_bus_is_stopped_mid_stream(
    tmp_path: Path, tokenizer: Path
) -> None:
    """``kvbus router`` on SIGTERM used to wait 60 s for streams in flight and 10 s for
    its routes publisher when the bus did not answer."""
    nats = NatsServer(tmp_path)
    nats.start()
    streaming = asyncio.Event()
    fleet = Fleet(nats.url)

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        streaming.set()
        while True:
            await response.write(b'data: {"choices": []}\n\n')
            await asyncio.sleep(0.1)

    await fleet.worker("a", endless)
    beat = asyncio.create_task(beat_forever(nats.url, "a/dp0"))
    router = RouterProcess(
        tmp_path,
        fleet.workers,
        "kv",
        nats.url,
        extra=["--tokenizer", str(tokenizer), "--routes-stream", "routes"],
        cli=True,
    )
    router.launch()
    try:
        await asyncio.to_thread(router.wait_ready, 1, 90)
        async with aiohttp.ClientSession() as session:
            body = {**PROMPT, "stream": True}
            async with session.post(f"{router.url}/v1/completions", json=body) as response:
                await response.content.readline()
                await asyncio.wait_for(streaming.wait(), 10)
                assert nats.process is not None
                os.kill(nats.process.pid, signal.SIGSTOP)  # the bus stops answering
                await asyncio.sleep(0.5)
                assert router.process is not None
                router.process.send_signal(signal.SIGTERM)
                # Bounded, and generous: the point is that it ends, not how fast.
                code = await asyncio.to_thread(router.process.wait, 15)
        assert code == 0, router.log_tail()
    except subprocess.TimeoutExpired as still_running:
        tail = router.log_tail()
        raise AssertionError(f"kvbus router running 15 s after SIGTERM\n{tail}") from still_running
    finally:
        beat.cancel()
        if nats.process is not None and nats.process.poll() is None:
            os.kill(nats.process.pid, signal.SIGCONT)
        router.kill()
        await asyncio.gather(beat, return_exceptions=True)
        await fleet.close()
        nats.stop()


async def beat_forever(url: str, source: str) -> None:
    """A worker's load every half second, as the stat logger sends it."""
    publisher = kvbus.Publisher(url, stream="metrics", source=source)
    try:
        while True:
            record = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
            publisher.publish(record, Kind.METRICS)
            await asyncio.sleep(0.5)
    finally:
        publisher.close(0.5)


async def test_a_worker_that_sends_its_headers_and_stalls_is_retried_elsewhere(
    fleet: Fleet, tokenizer: Path
) -> None:
    """--worker-timeout covered only the wait for the headers: a worker that sent them
    and stalled held the request (a connection slot, the body's budget) until the client
    left."""
    stalled: list[asyncio.StreamWriter] = []
    completions = 0

    async def headers_then_nothing(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal completions
        head = await reader.read(65536)
        completions += head.startswith(b"POST /v1/completions ")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 999\r\n\r\n{"
        )
        await writer.drain()
        stalled.append(writer)  # and nothing more, the connection left open

    port = free_port()
    server = await asyncio.start_server(headers_then_nothing, "127.0.0.1", port)
    fleet.workers["stalls"] = f"http://127.0.0.1:{port}"
    await fleet.worker("good")
    try:
        await fleet.run_router(tokenizer, "round_robin", worker_timeout=1.0)
        results = [await complete(fleet, PROMPT, timeout=20) for _ in range(4)]
        assert [(status, worker) for status, _, worker in results] == [(200, "good/dp0")] * 4
        assert completions  # the stalled worker was tried (not only asked /v1/models)
    finally:
        for writer in stalled:
            writer.close()
        server.close()


async def test_a_cookie_a_worker_sets_for_one_client_rides_on_no_other_clients_request(
    fleet: Fleet, tokenizer: Path
) -> None:
    """The router's client kept aiohttp's cookie jar: a worker's Set-Cookie in one
    client's answer was stored and sent on every later request, any client's, to any
    worker on that host (cookies do not tell ports apart). The client gets the cookie;
    the router keeps none."""
    seen: list[str | None] = []

    async def sets_a_cookie(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"id": "cmpl-1", "choices": [], "usage": USAGE})
        response.set_cookie("session", f"of-request-{len(seen)}")
        return response

    await fleet.worker("a", sets_a_cookie)
    # By name: aiohttp's jar takes no cookie from an IP address.
    fleet.workers["a"] = fleet.workers["a"].replace("127.0.0.1", "localhost")
    await fleet.run_router(tokenizer, "round_robin")
    for _ in range(3):
        async with aiohttp.ClientSession() as client:  # each a client of its own
            async with client.post(
                f"{fleet.router_url}/v1/completions",
                json=PROMPT,
            ) as response:
                assert response.status == 200
                assert response.cookies["session"].value == f"of-request-{len(seen)}"
    assert seen == [None, None, None]
