"""Issue 29: a user's set-up mistakes get a message that says what to do, and the
router's log reads well. Each test makes the mistake for real: a nats-server started
without JetStream, a model path relative to the engine's directory, vLLM's usage without
``--enable-prompt-tokens-details`` (its exact JSON), a worker that is not running; and
checks what a user sees (log lines, ``/health``, ``/metrics``, exit status)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cluster import RouterProcess, free_port, make_model
from kvbus.transports import open_transport
from kvbus.transports.nats import JetStreamUnavailable

import kvbus
from kvbus import Kind
from kvbus.routing.router import Router
from kvbus.service.gateway import UNREPORTED, RouterApp, _cached_tokens, start
from kvbus.service.upstream import output_in

from .conftest import append_raw, envelope
from .servers import NatsServer
from .test_gateway_limits import PROMPT, Fleet, answer, complete, models
from .test_gateway_limits import fleet as fleet  # the fixtures
from .test_gateway_limits import tokenizer as tokenizer

NO_JETSTREAM = "has no JetStream: start nats-server with -js (or enable jetstream in its config)"


class NatsWithoutJetStream(NatsServer):
    """A nats-server as one starts it by hand without ``-js``: no JetStream at all
    (``jetstream = True`` and a restart: the same server with it)."""

    jetstream = False

    def command(self) -> list[str]:
        command = super().command()
        if not self.jetstream:
            config = self.data_dir / "nats.conf"
            lines = config.read_text().splitlines()
            config.write_text("".join(f"{x}\n" for x in lines if not x.startswith("jetstream")))
        return command


@pytest.fixture
def bare_nats(tmp_path: Path) -> Any:
    server = NatsWithoutJetStream(tmp_path)
    server.start()
    yield server
    server.stop()


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def wait_for_line(caplog: pytest.LogCaptureFixture, text: str) -> None:
    async with asyncio.timeout(30):
        while not said(caplog, text):  # noqa: ASYNC110 (logging has no event to wait on)
            await asyncio.sleep(0.05)


# --- JetStream disabled ---------------------------------------------------------------


async def test_a_server_without_jetstream_is_named_with_what_to_do_once(
    bare_nats: NatsWithoutJetStream, caplog: pytest.LogCaptureFixture
) -> None:
    """Every read used to fail with a bare ``ServiceUnavailableError()``, retried for
    ever. Now the error says what to do, and the log says it once per process however
    many transports and attempts; the URL's password is not in it."""
    url = f"nats://kvbus:s3cret@127.0.0.1:{bare_nats.port}"
    expected = f"nats://kvbus:***@127.0.0.1:{bare_nats.port} {NO_JETSTREAM}"
    caplog.set_level(logging.INFO)
    for _ in range(2):
        transport = open_transport(url)
        try:
            for _ in range(3):
                with pytest.raises(JetStreamUnavailable) as raised:
                    async with asyncio.timeout(30):
                        [entry async for entry in transport.read("kv")]
                assert str(raised.value) == expected
            with pytest.raises(JetStreamUnavailable):
                await asyncio.wait_for(transport.position_at("kv", time.time()), 30)
        finally:
            await transport.aclose()
    assert said(caplog, NO_JETSTREAM) == [f"kvbus: {expected}"]
    assert "s3cret" not in caplog.text


async def test_a_publisher_waits_for_jetstream_and_goes_on_once_it_is_enabled(
    bare_nats: NatsWithoutJetStream, caplog: pytest.LogCaptureFixture
) -> None:
    """An append used to fail and be retried, a warning each time, for as long as the
    server ran without JetStream. It now waits quietly (one line said what to do) and
    delivers once the server is restarted with it."""
    caplog.set_level(logging.INFO)
    publisher = kvbus.Publisher(bare_nats.url, stream="kv", source="engine-a")
    try:
        load = kvbus.LoadMetrics(ts=time.time(), running=1, waiting=0, kv_cache_usage=0.0)
        publisher.publish(load, Kind.METRICS)
        await wait_for_line(caplog, NO_JETSTREAM)
        await asyncio.sleep(1)  # time for retries, had there been any
        assert publisher.stats.send_errors == 0
        bare_nats.stop()
        bare_nats.jetstream = True
        bare_nats.start()
        assert await publisher.aflush(60)
    finally:
        await publisher.aclose(5)
    sub = kvbus.subscribe("kv", bare_nats.url, follow=False)
    async with sub:
        items = [item async for item in sub]
    loads = [m.body for m in items if isinstance(m, kvbus.Message) and m.kind is Kind.METRICS]
    assert loads == [load]
    assert len(said(caplog, NO_JETSTREAM)) == 1
    assert not said(caplog, "ServiceUnavailableError")


def test_kvbus_tail_without_follow_exits_with_the_message(
    bare_nats: NatsWithoutJetStream,
) -> None:
    """``kvbus tail --no-follow`` used to hang, retrying for ever."""
    kvbus_command = str(Path(sys.executable).parent / "kvbus")
    done = subprocess.run(
        [kvbus_command, "tail", "--url", bare_nats.url, "--no-follow"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 1
    assert f"kvbus tail: {bare_nats.url} {NO_JETSTREAM}" in done.stderr
    assert "Traceback" not in done.stderr and "ServiceUnavailableError" not in done.stderr


# --- a tokenizer that will not load -----------------------------------------------------


async def add_worker(fleet: Fleet, name: str, models: Any, generate: Any = answer) -> None:
    """A scripted vLLM in ``fleet`` whose ``/v1/models`` is ``models``'s answer."""
    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fleet._runners.append(runner)
    fleet.workers[name] = f"http://127.0.0.1:{port}"


async def run_router(fleet: Fleet, tokenizer: str | None) -> int:
    """`Fleet.run_router`, with ``tokenizer`` as given (None: the model card's);
    /health's status once it is 200 or 10 s have passed."""
    fleet._beater = asyncio.create_task(fleet._beat())
    fleet.app = RouterApp(fleet.workers, Router("kv"), fleet.url, tokenizer)
    port = free_port()
    fleet._router = await start(fleet.app, "127.0.0.1", port)
    fleet.router_url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            async with session.get(f"{fleet.router_url}/health") as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.05)
        return response.status


async def test_a_model_path_relative_to_the_engine_says_pass_tokenizer_and_routes_by_load(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine started as ``--model ./tiny-llama`` in its own directory names its
    model ``./tiny-llama``, which the router (elsewhere) cannot load: /health used to
    stay 503 for ever with no hint. Now the log and /health say what failed and what to
    do, and requests are served, routed by load alone."""
    make_model(tmp_path / "engine" / "tiny-llama")  # there for the engine, not the router
    assert not os.path.exists("tiny-llama")  # noqa: ASYNC240 (one stat)
    caplog.set_level(logging.INFO, logger="kvbus.routing.router")

    async def cards(request: web.Request) -> web.Response:
        card = {"id": "./tiny-llama", "object": "model", "root": "./tiny-llama", "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    await add_worker(fleet, "a", cards)
    assert await run_router(fleet, None) == 200
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{fleet.router_url}/health") as response:
            health = await response.json()
    message = health["tokenizer_error"]
    assert health["tokenizer"] is False
    assert message.startswith("could not load the tokenizer for model './tiny-llama' (")
    assert "pass --tokenizer PATH_OR_NAME (the served model's tokenizer directory)" in message
    assert said(caplog, "could not load the tokenizer") == [message]
    status, _, worker = await complete(fleet, {**PROMPT, "model": "./tiny-llama"})
    assert (status, worker) == (200, "a/dp0")


async def test_a_tokenizer_option_that_will_not_load_says_so(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """``--tokenizer`` with a relative path that is not there: the router's discovery
    used to die with it (no model list either)."""
    caplog.set_level(logging.INFO, logger="kvbus.routing.router")
    await add_worker(fleet, "a", models)
    assert await run_router(fleet, "./no-such-tokenizer") == 200
    [message] = said(caplog, "could not load the tokenizer")
    assert message.startswith("could not load the tokenizer for --tokenizer './no-such-tokenizer'")
    assert fleet.app is not None and fleet.app.models == {"m"}
    assert (await complete(fleet, PROMPT))[0] == 200


# --- usage without cached tokens --------------------------------------------------------

# vLLM 0.32's JSON, made with its own classes (vllm.entrypoints.openai.completion.protocol:
# CompletionResponse(...).model_dump() as its API server sends it; a stream's last event,
# CompletionStreamResponse(..., usage=...).model_dump_json(exclude_unset=True)).
VLLM_COMPLETION = (
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    '"text":" a","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,'
    '"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],'
    '"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":40,'
    '"total_tokens":41,"completion_tokens":1,"prompt_tokens_details":%s,'
    '"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,'
    '"metrics":null}'
)
WITHOUT_DETAILS = VLLM_COMPLETION % "null"
WITH_DETAILS = VLLM_COMPLETION % (
    '{"cached_tokens":32,"created_cache_tokens":null,"multimodal_tokens":null}'
)
STREAM_USAGE_WITHOUT_DETAILS = (
    '{"id":"cmpl-1","created":1,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":40,"total_tokens":41,"completion_tokens":1}}'
)
STREAM_USAGE_WITH_DETAILS = (
    '{"id":"cmpl-1","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":40,'
    '"total_tokens":41,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":32}}}'
)
STREAM_CHUNK = (
    '{"id":"cmpl-1","created":1,"model":"m","choices":[{"index":0,"text":" a",'
    '"logprobs":null,"finish_reason":null,"stop_reason":null}]}'
)
NO_CACHED_TOKENS = (
    "worker a reports no cached tokens: start vLLM with --enable-prompt-tokens-details "
    "to measure routing accuracy"
)


def sse(*events: str) -> bytes:
    return "".join(f"data: {event}\n\n" for event in (*events, "[DONE]")).encode()


def test_usage_is_read_as_vllm_sends_it_with_and_without_prompt_tokens_details() -> None:
    """Without the details the engine reported nothing: not 0 cached tokens."""
    assert _cached_tokens(WITHOUT_DETAILS.encode(), False) is UNREPORTED
    assert _cached_tokens(WITH_DETAILS.encode(), False) == 32
    stream = sse(STREAM_CHUNK, STREAM_USAGE_WITHOUT_DETAILS)
    assert _cached_tokens(stream, True) is UNREPORTED
    assert _cached_tokens(sse(STREAM_CHUNK, STREAM_USAGE_WITH_DETAILS), True) == 32
    assert _cached_tokens(sse(STREAM_CHUNK), True) is None  # no usage asked for
    details = '{"cached_tokens":null,"created_cache_tokens":null,"multimodal_tokens":{"image":9}}'
    assert _cached_tokens((VLLM_COMPLETION % details).encode(), False) is UNREPORTED
    # Forged figures answer "not read", never an error in the request's path.
    forged = '{"usage": {"prompt_tokens_details": {"cached_tokens": Infinity}}}'
    assert _cached_tokens(forged.encode(), False) is None
    assert output_in({"completion_tokens": 7}) == 7 and output_in({"output_tokens": 3}) == 3
    assert output_in({"completion_tokens": True}) is None and output_in(None) is None


def outcomes(fleet: Fleet) -> dict[str, float]:
    assert fleet.app is not None
    found: dict[str, float] = {}
    for metric in fleet.app.metrics.predictions.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                outcome = sample.labels["outcome"]
                found[outcome] = found.get(outcome, 0) + sample.value
    return found


async def status(fleet: Fleet, body: dict[str, Any]) -> int:
    """A completion's status through the router, its answer (streamed or not) read."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.router_url}/v1/completions", json=body) as response:
            await response.read()
            return response.status


async def test_an_engine_without_prompt_tokens_details_is_unreported_not_over(
    fleet: Fleet, tokenizer: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its predictions used to be checked against 0 cached tokens: every correct one
    counted ``over``. Now they count as ``unreported``, and the log says once per worker
    what to do."""
    caplog.set_level(logging.INFO, logger="kvbus.routing.router")
    details = False

    async def vllm(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            usage = STREAM_USAGE_WITH_DETAILS if details else STREAM_USAGE_WITHOUT_DETAILS
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(sse(STREAM_CHUNK, usage))
            return response
        answer = WITH_DETAILS if details else WITHOUT_DETAILS
        return web.Response(text=answer, content_type="application/json")

    await fleet.worker("a", vllm)
    await fleet.run_router(tokenizer)
    streamed = {**PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    for body in (PROMPT, PROMPT, streamed):
        assert await status(fleet, body) == 200
    assert outcomes(fleet) == {"unreported": 3}
    assert said(caplog, "reports no cached tokens") == [NO_CACHED_TOKENS]
    details = True
    for body in (PROMPT, streamed):
        assert await status(fleet, body) == 200
    checked = outcomes(fleet)
    assert checked.pop("unreported") == 3 and sum(checked.values()) == 2
    assert len(said(caplog, "reports no cached tokens")) == 1


# --- the router's log --------------------------------------------------------------------


async def test_a_worker_that_is_not_running_is_one_clean_line(
    fleet: Fleet, tokenizer: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to be logged as the client library's exception repr, repr'd again."""
    caplog.set_level(logging.INFO, logger="kvbus.routing.router")
    await fleet.worker("b")
    dead = free_port()  # nothing listens there
    fleet.workers["a"] = f"http://127.0.0.1:{dead}"
    await fleet.run_router(tokenizer)
    served = set()
    async with asyncio.timeout(30):
        while not said(caplog, "unreachable"):
            status, _, worker = await complete(fleet, PROMPT)
            assert status == 200  # b answers what a could not
            served.add(worker)
    assert said(caplog, "unreachable") == [
        f"worker a (http://127.0.0.1:{dead}) unreachable: connection refused; retrying it in 5s"
    ]
    assert "Error" not in caplog.text


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_the_router_says_where_it_listens_and_leaves_probes_out_of_its_log(
    tmp_path: Path,
) -> None:
    """``kvbus router`` used to start without a word, then log every probe at INFO."""
    dead_bus, dead_a, dead_b = free_port(), free_port(), free_port()
    url = f"nats://kvbus:s3cret@127.0.0.1:{dead_bus}"
    workers = {"a": f"http://127.0.0.1:{dead_a}", "b": f"http://127.0.0.1:{dead_b}"}
    router = RouterProcess(tmp_path, workers, "kv", url, cli=True)
    router.start()
    try:
        statuses = [status_of(f"{router.url}{path}") for path in ("/health", "/metrics") * 3]
        assert statuses == [503, 200] * 3  # not ready: no worker is up
        assert status_of(f"{router.url}/v1/models") == 503
    finally:
        router.stop()
    log = (tmp_path / f"{router.name}.log").read_text()
    assert (
        f"kvbus router listening on http://127.0.0.1:{router.port} "
        f"(workers: a, b; bus: nats://kvbus:***@127.0.0.1:{dead_bus})"
    ) in log
    assert '"GET /v1/models' in log  # requests are in the access log
    assert "GET /health" not in log and "GET /metrics" not in log
    assert "s3cret" not in log


async def test_sources_that_join_are_not_news_and_gaps_are(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A read that starts after a source's first message used to open the router's log
    with "resync ...: joined, lost (1, 4)" at INFO for every engine."""
    epoch = 7
    await append_raw(memory_url, [envelope("a", epoch, seq) for seq in (5, 6, 9)])
    caplog.set_level(logging.INFO, logger="kvbus.bus.subscription")
    sub = kvbus.subscribe("kv", memory_url, follow=False, gap_timeout=0)
    async with sub:
        reasons = [i.reason.value async for i in sub if isinstance(i, kvbus.Resync)]
    assert reasons == ["joined", "gap"]
    assert [r.getMessage() for r in caplog.records] == [
        "kvbus: resync 'a' in kv epoch 7: gap, seqs 7-8 lost"
    ]
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="kvbus.bus.subscription")
    sub = kvbus.subscribe("kv", memory_url, follow=False, gap_timeout=0)
    async with sub:
        [item async for item in sub]
    assert said(caplog, "joined") == ["kvbus: 'a' in kv: joined at seq 5 of epoch 7"]
