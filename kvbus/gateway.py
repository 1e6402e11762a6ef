"""``kvbus router``: an OpenAI-compatible router in front of vLLM servers, as a service.

Each vLLM server runs with the kvbus plugin and stat logger (``pip install kvbus[vllm]``)
and ``KVBUS_URL`` pointing at the same bus, with ``KVBUS_SOURCE=NAME``; its KV events
and load then arrive as sources ``NAME/dp<rank>``. The router follows both streams,
tokenizes each request as vLLM does (the chat template for chat), asks `kvbus.router`
which worker to use, and forwards the request there unchanged (data-parallel rank in
vLLM's ``X-data-parallel-rank`` header); the response, streamed or not, comes back
unchanged. ``x-kvbus-worker`` and ``x-kvbus-predicted-cached-tokens`` headers are added.

    kvbus router --port 8000 --url nats://127.0.0.1:4222 \\
        --worker a=http://127.0.0.1:8001 --worker b=http://127.0.0.1:8002 --policy kv

Ready at once after a start or restart: it reads the snapshots ``kvbus compact`` stored
(if one runs) and replays the kv stream's retained history after them before it says
ready (the index starts complete), and reads the last ``--stale-after``
seconds of the metrics stream (each engine's latest load) instead of waiting for the next
heartbeat. ``/health`` answers 200 only when ready: history replayed, recent load read,
the served model's tokenizer loaded and some worker alive; 503 (with what is missing in
its JSON) otherwise.

Requests the router cannot read (invalid JSON, a model it does not know, a prompt it
cannot tokenize, token ids that are no token ids) go to a live worker unrouted, so the
client gets vLLM's own error; so do requests that bring their own ``chat_template``
(vLLM decides whether to accept one). A prompt too long is routed and vLLM answers. With
no worker alive the answer is 503 in vLLM's error shape; every error the router itself
gives has that shape. ``/metrics`` serves Prometheus series, among them how exactly each
decision predicted the engine's cached tokens.

What a client or a worker can cost it is bounded: tokenizing a body over 2 KiB runs in
two threads of its own, never on the event loop (a smaller one is tokenized in place),
and a body over ``--max-tokenize-bytes`` is routed by load alone. A body over
``--max-body-bytes`` (32 MiB) is refused (413), and the bodies held at once, from their
first byte until no retry can need them, add up to at most ``--max-held-body-bytes``
(256 MiB): a request over it is answered 503 with ``Retry-After``. A connection must
complete each request head within ``--header-timeout`` of opening or of its previous
response (an idle keep-alive connection is closed then too, as vLLM's own server closes
one after 5 s), and its body within ``--body-timeout``; a client that leaves cancels its
request upstream, and one that stops reading for ``--client-write-timeout`` is dropped.
Each worker gets at most ``--worker-connections`` connections, so one that hangs cannot
take the others' share; a request that waits ``--pool-timeout`` for one of a busy
worker's goes to another, the busy one not marked down. A worker that refuses, drops,
times out (``--worker-timeout`` from a connection of its own to its first byte) or
answers something that is not HTTP is marked down and the request goes to another. Each
limit, when hit, is counted in ``/metrics``.

The bus is not in the request path. When no load record has come on the metrics stream
for ``--stale-after`` seconds (the bus is down, or no engine publishes on it), the
router goes on routing from what it knew (its index, each worker's last load), then by
each worker's load and liveness read from its own endpoint (vLLM's ``/health`` and
``/metrics``: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, every ``--engine-poll-interval`` seconds, each poll within
a fifth of ``--stale-after`` and `ENGINE_METRICS_MAX_BYTES`). ``/health`` says so
(``"bus": "down", "routing": "degraded (load from engines)"``, still 200) and so does
``/metrics`` (``kvbus_router_bus_up``, ``kvbus_router_degraded_routes_total``); full
routing resumes when the bus is back. A worker whose engine publishes under another
name is routed the same way, and ``/health``, the 503 answer and one log line say which
names the bus did carry (``no engine publishes as `a`; sources seen: ...``).

SIGTERM (or SIGINT) stops it within about a second whatever the bus is doing: requests in
flight get ``--drain-timeout`` to finish, then are cut; the bus readers are cancelled
and not waited for beyond a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import enum
import errno
import gc
import json
import logging
import math
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, Literal

import aiohttp
import prometheus_client as prom
from aiohttp import web, web_log
from yarl import URL

import kvbus
import kvbus.metrics
from kvbus.config import command_url, redact_url
from kvbus.envelope import Kind
from kvbus.events import LoadMetrics
from kvbus.logs import LimitedLog, displayable, shown
from kvbus.router import CostWeights, Decision, Policy, Router
from kvbus.subscribe import Message, Resync
from kvbus.transfers import ConnectorMetrics
from kvbus.transports import BackendUnusable, open_transport

log = logging.getLogger("kvbus.router")
_limited_log = LimitedLog(log)  # one line a second per kind: bus items may come in floods
BACKEND_RECHECK: Final = 2.0
"""Seconds between a bus read the backend cannot serve as set up and the next try."""
_RANK: Final = re.compile(r"/dp(\d+)$")
_STREAM_TAIL: Final = 8192
_HOP_BY_HOP: Final = {
    "content-length", "transfer-encoding", "connection", "keep-alive", "server", "date",
}  # fmt: skip
_FORWARDED: Final = ("Content-Type", "Authorization", "Accept", "X-Request-Id")
_INLINE_TOKENIZE_BYTES: Final = 2048
"""Bodies up to this size (a few hundred tokens, ~0.1 ms) are tokenized on the event
loop: the hop to a tokenizer thread and back costs more than that (and up to the GIL's
5 ms switch interval when another thread holds it). Larger ones go to the threads."""
_TOKEN_BUCKETS: Final = (0, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_ERROR_BUCKETS: Final = (-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096)
_TOKEN_LIMIT: Final = 2**32  # vLLM's token ids are unsigned 32-bit
_QUICK: Final = aiohttp.ClientTimeout(total=5)  # a model list, not a generation
_QUICK_CONNECTIONS: Final = 8
"""Model lists (``/v1/models``, discovery) in flight at once, all workers together: on
connections of their own beside ``--worker-connections``, so a flood of them never makes
a generation wait for a pooled connection."""
_STOP_WAIT: Final = 0.5
"""Seconds the bus readers and the routes publisher get to end once cancelled or
closed at shutdown; a client library that swallows a cancel is not waited for."""
_PROBES: Final = frozenset({"/health", "/metrics"})
"""Paths a load balancer or Prometheus asks every few seconds: access-logged at DEBUG."""
_LOAD_ONLY: Final[tuple[list[int], None]] = ([], None)  # routed by load alone
ENGINE_METRICS_MAX_BYTES: Final = 4 * 2**20
"""The most bytes of an engine's ``/metrics`` read (vLLM's is tens of KiB per engine);
a larger answer is not read further, counted (``kvbus_router_engine_polls_total``
``outcome="too_large"``) and its load not used."""
_ENGINE_GAUGES: Final = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_cache_usage",
}
_ENGINE_LABEL: Final = re.compile(rb'(?:^|,)engine="(\d{1,6})"')
_MAX_ENGINE_RANKS: Final = 256
"""Engines (data-parallel ranks) of one worker taken from its endpoint at most."""
_MAX_REQUESTS_FIGURE: Final = 2**31
_MAX_OTHER_SOURCES: Final = 64
"""Sources on the bus that are no configured worker's, remembered (for the message
that names them) at most; the names come from the network."""
_SHOWN_SOURCES: Final = 8
"""Of those, named in a message at most."""
_SHOWN_ERROR: Final = 240
"""Characters of an error's text in a log line or /health at most (a tokenizer's load
error can run to paragraphs)."""


def error_body(
    message: str, kind: str, status: int, retry_after: float | None = None
) -> web.Response:
    """An error in vLLM's shape (`ErrorResponse`); with ``retry_after``, a
    ``Retry-After`` header saying when to try again (OpenAI clients honour it)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    headers = None if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return web.json_response(body, status=status, headers=headers)


def _busy(message: str) -> web.Response:
    return error_body(message, "ServiceUnavailableError", 503, retry_after=1)


class BodyBudget:
    """Bytes of request bodies the router holds at once, all requests together."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.capacity:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class _Body:
    """One request's body, its bytes counted in a `BodyBudget` until `release`."""

    __slots__ = ("_budget", "_counted", "data")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self._counted = 0
        self.data = bytearray()

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False (nothing kept) when the budget cannot hold it."""
        if not self._budget.take(len(chunk)):
            return False
        self._counted += len(chunk)
        self.data += chunk
        return True

    def release(self) -> None:
        """No retry can need the body any more: drop it and give its bytes back."""
        self.data = bytearray()
        self._budget.give(self._counted)
        self._counted = 0


class Metrics:
    """The router's Prometheus series (``/metrics``), per worker and policy."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        kvbus.metrics.register(self.registry)  # kvbus_publisher_*, kvbus_subscriber_*
        per_worker = ("worker", "policy")

        def counter(name: str, doc: str, labels: tuple[str, ...] = per_worker) -> prom.Counter:
            return prom.Counter(f"kvbus_router_{name}", doc, labels, registry=self.registry)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = per_worker
        ) -> prom.Histogram:
            return prom.Histogram(
                f"kvbus_router_{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(f"kvbus_router_{name}", doc, registry=self.registry)

        self.requests = counter("requests", "Requests forwarded", (*per_worker, "code"))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens routed")
        self.unrouted = counter("unrouted_requests", "Requests forwarded unread (invalid)", ())
        self.no_worker = counter("no_worker", "Requests answered 503: no worker alive", ())
        self.slow_clients = counter(
            "slow_clients",
            "Connections closed: no whole request head within --header-timeout of opening "
            "or of the previous response (idle keep-alive connections included)",
            (),
        )
        self.stalled_clients = counter(
            "stalled_clients",
            "Connections dropped: the client read nothing for --client-write-timeout",
            (),
        )
        self.refused = counter(
            "refused_requests",
            "Requests refused before routing: body_too_large (413, --max-body-bytes), "
            "bodies_held (503, --max-held-body-bytes)",
            ("reason",),
        )
        self.busy = counter(
            "busy_worker_waits",
            "Requests that waited --pool-timeout for one of a worker's "
            "--worker-connections and went elsewhere (the worker is not marked down)",
            ("worker",),
        )
        self.body_bytes = gauge(
            "held_body_bytes", "Bytes of request bodies held now (--max-held-body-bytes)"
        )
        self.bus_up = gauge(
            "bus_up",
            "1 while load records arrive on the metrics stream; 0: the bus is down (or no "
            "engine publishes), routing degraded to the engines' own /metrics",
        )
        self.degraded_routes = counter(
            "degraded_routes",
            "Requests routed while the bus was down, or to a worker on load read from its "
            "own endpoint",
            (),
        )
        self.engine_polls = counter(
            "engine_polls",
            "Loads read from the engines' own /health and /metrics, by outcome: ok, failed, "
            "too_large (ENGINE_METRICS_MAX_BYTES), unreadable",
            ("outcome",),
        )
        self.bad_items = counter(
            "bad_stream_items", "Bus items the router could not apply (logged, skipped)", ()
        )
        # Routing accuracy, per request whose response carried usage: what the router
        # expected the engine to find cached, what the engine reported, and the gap.
        self.predicted = histogram(
            "predicted_cached_tokens", "Prompt tokens the router expected cached", _TOKEN_BUCKETS
        )
        self.reported = histogram(
            "reported_cached_tokens", "Cached prompt tokens the engine reported", _TOKEN_BUCKETS
        )
        self.error = histogram(
            "prediction_error_tokens",
            "Reported less predicted cached tokens (negative: the router expected more)",
            _ERROR_BUCKETS,
        )
        self.predictions = counter(
            "predictions",
            "Predictions checked against usage, by outcome: exact, over, under; unreported: "
            "the usage had no cached_tokens (vLLM runs without --enable-prompt-tokens-details)",
            (*per_worker, "outcome"),
        )
        self._unreported_said: set[str] = set()
        """Workers (configured names) already said to report no cached tokens."""
        self.decision = histogram(
            "decision_seconds",
            "Tokenizing and choosing a worker",
            (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            (),
        )
        self.ttft = histogram(
            "first_byte_seconds",
            "Time to the first byte of the worker's response",
            prom.Histogram.DEFAULT_BUCKETS,
        )
        self.eligible = gauge("eligible_workers", "Workers that may get traffic")
        self.blocks = gauge("indexed_blocks", "Distinct prefix blocks indexed")
        self.ready = gauge("ready", "1 when /health says ready")
        self.unchained = gauge(
            "unchained_blocks", "Stored blocks skipped: their parent was never seen"
        )
        self.peer_requests = gauge(
            "peer_requests", "Other replicas' requests in flight, counted here (--routes-stream)"
        )

    def observe_prediction(self, decision: Decision, reported: int | Unreported) -> None:
        labels = (decision.worker, decision.policy.value)
        if reported is UNREPORTED:
            # Not a miss: vLLM leaves cached_tokens out unless asked to count them.
            # Counted as "over" it would make every prediction look wrong.
            self.predictions.labels(*labels, "unreported").inc()
            worker = _RANK.sub("", decision.worker)
            if worker not in self._unreported_said:
                self._unreported_said.add(worker)
                log.warning(
                    "worker %s reports no cached tokens: start vLLM with "
                    "--enable-prompt-tokens-details to measure routing accuracy",
                    worker,
                )
            return
        predicted = decision.predicted_cached_tokens
        self.predicted.labels(*labels).observe(predicted)
        self.reported.labels(*labels).observe(reported)
        self.error.labels(*labels).observe(reported - predicted)
        outcome = "exact" if reported == predicted else "over" if predicted > reported else "under"
        self.predictions.labels(*labels, outcome).inc()


class Tokenizer:
    """The served model's tokenizer, used the way vLLM's OpenAI server uses it."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(path)
        # transformers imported torch: ~400k objects that live as long as the process.
        # Out of the collector's sight, a full collection no longer walks them all
        # (~0.3 s, a stall of every request in flight). Thawed at exit, so that they are
        # finalized as usual (triton's bindings report frozen ones as leaks).
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once, however many tokenizers load
        atexit.register(gc.unfreeze)

    def completion(self, body: dict[str, Any]) -> list[int]:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        special = body.get("add_special_tokens", True)
        return list(self.hf(prompt, add_special_tokens=special).input_ids)

    def chat(self, body: dict[str, Any]) -> list[int]:
        messages = [
            {**m, "content": _text(m.get("content"))} if isinstance(m, dict) else m
            for m in body["messages"]
        ]
        text = self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tools=body.get("tools"),
            chat_template=body.get("chat_template"),
            **(body.get("chat_template_kwargs") or {}),
        )
        special = body.get("add_special_tokens", False)
        return list(self.hf(text, add_special_tokens=special).input_ids)


def _text(content: Any) -> Any:
    """Text parts of a message joined as vLLM's 'string' content format does."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


Tokenize = Callable[[Tokenizer, dict[str, Any]], list[int]]


class RouterApp:
    def __init__(
        self,
        workers: dict[str, str],
        router: Router,
        url: str,
        tokenizer: str | None = None,
        kv_stream: str = "kv",
        metrics_stream: str = "metrics",
        down_for: float = 5.0,
        *,
        worker_connections: int = 256,
        worker_timeout: float = 300.0,
        body_timeout: float = 30.0,
        max_tokenize_bytes: int = 2**20,
        max_body_bytes: int = 32 * 2**20,
        max_held_body_bytes: int = 256 * 2**20,
        client_write_timeout: float = 30.0,
        pool_timeout: float = 30.0,
        connector_stream: str | None = None,
        routes_stream: str | None = None,
        replica: str | None = None,
        engine_poll_interval: float = 1.0,
    ) -> None:
        self.workers = {name: base.rstrip("/") for name, base in workers.items()}
        self.engine_poll_interval = engine_poll_interval
        """Seconds between reads of the load of workers the bus tells nothing of lately
        from their own endpoints (each read within a fifth of ``stale_after``)."""
        self._started = self._bus_heard = time.monotonic()
        """When the latest item of the metrics stream arrived (or the start)."""
        self._bus_was_up = True
        self._heard_names: set[str] = set()
        """Configured workers some item on the bus came from."""
        self._other_sources: dict[str, None] = {}
        """Sources on the bus of no configured worker (`_MAX_OTHER_SOURCES` at most)."""
        self._load_sources: dict[str, set[str]] = {}
        """Per configured worker: its sources that sent load (bus or endpoint)."""
        self._polls: dict[str, asyncio.Task[None]] = {}
        """Reads of a worker's own endpoint in flight."""
        self._told: set[str] = set()
        self.problems: list[str] = []
        """Mistakes in the set-up the router can see (a worker no engine publishes as)."""
        self.routes_stream = routes_stream
        """Where replicas behind one address share their requests in flight."""
        self.replica = replica
        self.routes: kvbus.Publisher | None = None
        self.router = router
        self.url = url
        self.tokenizer_path = tokenizer
        self.tokenizer: Tokenizer | None = None
        self.tokenizer_error: str | None = None
        """Why the tokenizer did not load, and what to do (/health): requests are then
        routed by load alone."""
        self.kv_stream = kv_stream
        self.metrics_stream = metrics_stream
        self.down_for = down_for
        self.metrics = Metrics()
        self.connector_stream = connector_stream
        self.connector_metrics = (
            ConnectorMetrics(self.metrics.registry) if connector_stream else None
        )
        """The engines' KV connector transfers and stats, in this router's /metrics."""
        self.loras: set[str] = set()
        self.models: set[str] = set()
        self.kv_replayed = False
        """The kv stream's retained history is in the index."""
        self.load_read = False
        """The metrics stream's recent past (each engine's latest load) was read."""
        self.worker_connections = worker_connections
        self.worker_timeout = worker_timeout
        self.body_timeout = body_timeout
        self.max_tokenize_bytes = max_tokenize_bytes
        if max_held_body_bytes < max_body_bytes:
            raise ValueError(
                f"max_held_body_bytes ({max_held_body_bytes}) must hold one body of "
                f"max_body_bytes ({max_body_bytes})"
            )
        self.max_body_bytes = max_body_bytes
        self.bodies = BodyBudget(max_held_body_bytes)
        self.client_write_timeout = client_write_timeout
        self.pool_timeout = pool_timeout
        self.header_timeout = 10.0
        """Set by `start`: seconds for each request head, from the connection's opening
        or its previous response."""
        self.session: aiohttp.ClientSession | None = None
        self._slots: dict[str, asyncio.Semaphore] = {}
        """Per worker address: its --worker-connections, taken by a request for as long
        as its response lasts (then its connection is back in the pool)."""
        self._quick_slots = asyncio.Semaphore(_QUICK_CONNECTIONS)
        self._tasks: list[asyncio.Task[None]] = []
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="kvbus-tokenize")
        self._head_timers: dict[Any, asyncio.TimerHandle] = {}
        """Connections yet to send a whole request head, and when they must have."""
        self._bases: dict[str, tuple[str, str | None, asyncio.Semaphore]] = {}

    # --- lifecycle -------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/health", self.health)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        # No total timeout: a stream takes as long as it takes. Up to the first byte
        # (all of a response that is not streamed), --worker-timeout. The pool holds
        # more connections per worker than the requests that may use them at once
        # (--worker-connections for generations, _QUICK_CONNECTIONS for model lists), so
        # no request ever waits in it: waiting is done, timed and counted apart
        # (--pool-timeout), never as the worker's own time.
        self._started = self._bus_heard = time.monotonic()  # the bus gets --stale-after
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=self.worker_connections + _QUICK_CONNECTIONS + 1
            ),  # + 1: a load read from its endpoint (`_poll_engine`)
        )
        self._tasks = [
            asyncio.create_task(self._follow_kv()),
            asyncio.create_task(self._follow_metrics()),
            asyncio.create_task(self._discover()),
            asyncio.create_task(self._watch()),
        ]
        if self.connector_metrics is not None:
            self._tasks.append(asyncio.create_task(self._follow_connector()))
        if self.routes_stream:
            routes = self.routes = kvbus.Publisher(
                self.url, stream=self.routes_stream, source=self.replica
            )
            self.router.replica = routes.source
            self.router.share = lambda event: routes.publish(event, Kind.ROUTES)
            self._tasks.append(asyncio.create_task(self._follow_routes()))
        for task in self._tasks:
            task.add_done_callback(_report_failure)
        yield
        for task in [*self._tasks, *self._polls.values()]:
            task.cancel()
        # Bounded: with the bus down, a client library may swallow a cancel or take
        # its own time to give up; shutdown does not wait on it (the process is ending).
        _, stuck = await asyncio.wait(self._tasks, timeout=_STOP_WAIT)
        if stuck:
            log.warning("%d bus readers did not stop within %ss; left", len(stuck), _STOP_WAIT)
        if self.routes is not None:
            self.router.share = None
            # SourceStopped: the others forget its requests (or expire them, if the
            # bus is down and it cannot be sent in time).
            await self.routes.aclose(_STOP_WAIT)
        await self.session.close()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        """Some worker may get traffic and the tokenizer is loaded, and the bus's history
        is read (or the bus is down: routing degraded, not stopped)."""
        return (
            ((self.kv_replayed and self.load_read) or not self.bus_up)
            and (self.tokenizer is not None or self.tokenizer_error is not None)
            and bool(self.router.eligible())
        )

    @property
    def bus_up(self) -> bool:
        """Whether the metrics stream delivered anything in the last ``stale_after``
        seconds: every engine's stat logger sends a record every 2 s, so silence means
        the bus is down (or no engine publishes on it)."""
        return time.monotonic() - self._bus_heard < self.router.stale_after

    async def _follow_kv(self) -> None:
        """The kv stream's history (until it ends, then ready), then its live tail."""
        cursor = await self._read(self.kv_stream, None, False, self.router.apply_kv, snapshot=True)
        self.kv_replayed = True
        await self._read(self.kv_stream, cursor, True, self.router.apply_kv)

    async def _follow_connector(self) -> None:
        """The connector stream's retained history, then its live tail, into /metrics."""
        assert self.connector_metrics is not None and self.connector_stream
        await self._read(self.connector_stream, None, True, self.connector_metrics.apply)

    async def _follow_routes(self) -> None:
        """Other replicas' requests in flight, from now on (older ones are done or
        will be soon); a lost event is not worth waiting for."""
        assert self.routes_stream
        await self._read(
            self.routes_stream, "latest", True, self.router.apply_routes, 0, known=lambda _: True
        )

    async def _follow_metrics(self) -> None:
        """The metrics stream from ``stale_after`` seconds ago (older records would be
        stale anyway) to its end, then ready, then its live tail. Load records are
        state, not history: a gap is not worth waiting for (``gap_timeout=0``)."""
        position = None
        transport = open_transport(self.url)
        try:
            since = time.time() - self.router.stale_after
            position = await transport.position_at(self.metrics_stream, since)
        except Exception as error:  # then read what is retained
            log.warning("could not find the recent past of %s: %r", self.metrics_stream, error)
        finally:
            await transport.aclose()

        def apply_aged(item: Message | Resync) -> None:
            age = time.time() - item.ts if isinstance(item, Message) else 0.0
            self._apply_load(item, age)

        cursor = kvbus.Cursor(position)
        heard = self._heard_on_bus
        cursor = await self._read(self.metrics_stream, cursor, False, apply_aged, 0, known=heard)
        self.load_read = True
        await self._read(self.metrics_stream, cursor, True, self._apply_load, 0, known=heard)

    def _apply_load(self, item: Message | Resync, age: float = 0.0) -> None:
        if isinstance(item, Message) and isinstance(item.body, LoadMetrics):
            self._add_load_source(item.source)
        self.router.apply_metrics(item, age)

    def _add_load_source(self, source: str) -> None:
        sources = self._load_sources.setdefault(_RANK.sub("", source), set())
        if len(sources) < _MAX_ENGINE_RANKS:
            sources.add(source)

    def _heard_on_bus(self, source: str) -> bool:
        """An item of the metrics stream arrived: the bus is up. Whether it is a
        configured worker's."""
        self._bus_heard = time.monotonic()
        return self._known(source)

    async def _read(
        self,
        stream: str,
        cursor: kvbus.Cursor | Literal["latest"] | None,
        follow: bool,
        apply: Callable[[Message | Resync], None],
        gap_timeout: float | None = None,
        *,
        snapshot: bool = False,
        known: Callable[[str], bool] | None = None,
    ) -> kvbus.Cursor:
        """Apply ``stream`` from ``cursor`` (to its end, or for good with ``follow``),
        only the items of sources ``known`` (default: configured workers); after a
        failure, resume where it stopped (so nothing is applied twice). Returns the
        cursor after the end."""
        known = known or self._known
        options: dict[str, Any] = {"snapshot": snapshot}
        if gap_timeout is not None:
            options["gap_timeout"] = gap_timeout
        while True:
            sub = kvbus.subscribe(stream, self.url, cursor=cursor, follow=follow, **options)
            try:
                async with sub:
                    async for item in sub:
                        if not known(item.source):
                            continue
                        try:
                            apply(item)
                        except Exception:  # one bad item must not stop the router
                            self.metrics.bad_items.inc()
                            _limited_log.exception(
                                "apply",
                                "could not apply %s item from %s",
                                stream,
                                shown(item.source),
                            )
                return sub.cursor
            except asyncio.CancelledError:
                raise
            except BackendUnusable:
                # The transport said once what to change (NATS without JetStream); the
                # router waits for the operator quietly, routing by the engines' load.
                cursor = sub.cursor
                await asyncio.sleep(BACKEND_RECHECK)
            except Exception:
                log.exception("following %s failed; again in 1 s", stream)
                cursor = sub.cursor
                await asyncio.sleep(1)

    def _known(self, source: str) -> bool:
        """Whether ``source`` is a configured worker's (``NAME`` or ``NAME/dpN``);
        either way it was seen on the bus (`_check_names` names the others)."""
        name = _RANK.sub("", source)
        if name in self.workers:
            self._heard_names.add(name)
            return True
        others = self._other_sources
        if source not in others and len(others) < _MAX_OTHER_SOURCES:
            others[source] = None
        return False

    # --- without the bus ---------------------------------------------------------------

    async def _watch(self) -> None:
        """Every ``engine_poll_interval``: says when the bus goes down or comes back,
        reads the load of each worker the bus told nothing of for half ``stale_after``
        from its own endpoint (before what the router last knew goes stale), and looks
        for workers no engine publishes as."""
        while True:
            self._check_bus()
            for name in self.workers:
                if name not in self._polls and self._needs_engine_load(name):
                    self._polls[name] = asyncio.create_task(self._poll_engine(name))
            self._check_names()
            await asyncio.sleep(self.engine_poll_interval)

    def _check_bus(self) -> None:
        up = self.bus_up
        self.metrics.bus_up.set(int(up))
        if up == self._bus_was_up:
            return
        self._bus_was_up = up
        if up:
            log.info("the bus is back: routing on its load records and index again")
        else:
            log.warning(
                "no load record on the metrics stream for %ss: the bus is down (or no engine "
                "publishes); routing on what the router knew and the engines' own /metrics",
                self.router.stale_after,
            )

    def _needs_engine_load(self, name: str) -> bool:
        """Whether some engine of worker ``name`` has sent no load record on the bus
        for half ``stale_after`` (or never did)."""
        sources = self._load_sources.get(name)
        if not sources:
            return True
        threshold = self.router.stale_after / 2
        return any(self.router.load_age(s) > threshold for s in sources)

    async def _poll_engine(self, name: str) -> None:
        """Worker ``name``'s load from its own endpoint: ``/health`` (200: its engine
        lives), then ``/metrics``, within a fifth of ``stale_after``; given to the
        router for each of its engines whose bus record is old."""
        assert self.session is not None
        base = self.workers[name]
        outcome = "failed"
        try:
            async with asyncio.timeout(self.router.stale_after / 5):
                async with self.session.get(f"{base}/health") as response:
                    if response.status != 200:
                        raise ValueError(f"/health answered {response.status}")
                async with self.session.get(
                    f"{base}/metrics", headers={"Accept-Encoding": "identity"}
                ) as response:
                    if response.status != 200:
                        raise ValueError(f"/metrics answered {response.status}")
                    text = await _read_bounded(response, ENGINE_METRICS_MAX_BYTES)
            loads = engine_loads(text, time.time())
            outcome = "ok" if loads else "unreadable"
        except _TooLarge as error:
            outcome = "too_large"
            _limited_log.warning(
                "engine metrics", "the /metrics of worker %s is refused: %s", name, error
            )
            return
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.debug("could not read the load of worker %s: %r", name, error)
            return
        finally:
            self.metrics.engine_polls.labels(outcome).inc()
            self._polls.pop(name, None)
        threshold = self.router.stale_after / 2
        for engine, load in loads.items():
            # A worker whose engine publishes as bare NAME (no rank) keeps that name.
            bare = engine == 0 and self.router.load_age(name) < math.inf
            source = name if bare else f"{name}/dp{engine}"
            if self.router.load_age(source) > threshold:
                self._add_load_source(source)
                self.router.apply_engine_load(source, load)

    def _check_names(self) -> None:
        """Once the bus has been up for ``stale_after``: a message for each configured
        worker no item on the bus came from (logged once), naming what did come."""
        if not self.bus_up or not self.load_read:
            return
        if time.monotonic() - self._started < self.router.stale_after:
            return
        unseen = [name for name in self.workers if name not in self._heard_names]
        self.problems = [self._unseen(name) for name in unseen]
        for name, message in zip(unseen, self.problems, strict=True):
            if name not in self._told:
                self._told.add(name)
                log.warning("%s", message)  # its names already made displayable

    def _unseen(self, name: str) -> str:
        shown_name = displayable(name)
        others = sorted(self._other_sources)
        if not others:
            return (
                f"no engine publishes as `{shown_name}`; sources seen: none (set "
                f"KVBUS_SOURCE={shown_name} and KVBUS_URL to this router's --url on that engine)"
            )
        seen = ", ".join(f"`{displayable(s)}`" for s in others[:_SHOWN_SOURCES])
        if len(others) > _SHOWN_SOURCES:
            seen += ", ..."
        other = displayable(_RANK.sub("", others[0]))
        return (
            f"no engine publishes as `{shown_name}`; sources seen: {seen} (set "
            f"KVBUS_SOURCE={shown_name} on that engine, or --worker {other}=URL)"
        )

    async def _discover(self) -> None:
        """Served model names (and the tokenizer, unless given) from the first worker
        that answers."""
        assert self.session is not None
        if self.tokenizer_path:
            await self._load_tokenizer(self.tokenizer_path, "--tokenizer")
        while True:
            for base in self.workers.values():
                root = None
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    async with (
                        self._quick_slots,
                        self.session.get(f"{base}/v1/models", timeout=_QUICK) as response,
                    ):
                        cards = (await response.json())["data"]
                    self.models = {c["id"] for c in cards}
                    self.loras = {c["id"] for c in cards if c.get("parent")}
                    base_models = (c.get("root") or c["id"] for c in cards if not c.get("parent"))
                    root = next(base_models, None)
                if root is None:
                    continue
                log.info("models %s", sorted(self.models))
                if self.tokenizer is None and self.tokenizer_error is None:
                    await self._load_tokenizer(root, "model")
                return
            await asyncio.sleep(1)

    async def _load_tokenizer(self, path: str, named_by: str) -> None:
        """The tokenizer at ``path`` (named by ``--tokenizer`` or the served model's
        card); one that will not load (a model path relative to the engine's directory,
        missing files) is said once, in the log and in /health, with what to do, and
        requests are routed by load alone rather than never."""
        try:
            self.tokenizer = await asyncio.to_thread(Tokenizer, path)
        except Exception as error:
            self.tokenizer_error = (
                f"could not load the tokenizer for {named_by} {shown(path)} "
                f"({displayable(' '.join(str(error).split()), _SHOWN_ERROR)}): pass "
                "--tokenizer PATH_OR_NAME (the served model's tokenizer directory); "
                "routing by load alone until then"
            )
            log.error("%s", self.tokenizer_error)
            return
        log.info("tokenizer from %s", shown(path))

    # --- handlers --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda t, body: t.completion(body))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda t, body: t.chat(body))

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error the router gives in vLLM's shape, none as aiohttp's text/plain."""
        timer = self._head_timers.pop(request.protocol, None)
        if timer is not None:
            timer.cancel()
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except web.HTTPException as error:
            return error_body(error.reason, type(error).__name__, error.status)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_body("The router failed on this request.", "InternalServerError", 500)
        finally:
            # The next request on this connection (keep-alive) gets the same time for
            # its head as the first did: aiohttp alone would wait its keepalive_timeout.
            self.expect_head(request.protocol, self.header_timeout)

    async def _generate(self, request: web.Request, tokenize: Tokenize) -> web.StreamResponse:
        body = _Body(self.bodies)
        try:
            refused = await self._receive(request, body)
            if refused is not None:  # (a response is a mapping: falsy when empty)
                return refused
            return await self._route(request, body, tokenize)
        finally:
            body.release()

    async def _receive(self, request: web.Request, body: _Body) -> web.Response | None:
        """Read the request's body into ``body``; an error response instead when it is
        too large, over the bytes all bodies may hold at once, or too slow."""
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            return self._too_large()  # refused before a byte of it is read
        try:
            async with asyncio.timeout(self.body_timeout):  # no task of its own, unlike wait_for
                async for chunk in request.content.iter_any():
                    if len(body.data) + len(chunk) > self.max_body_bytes:
                        return self._too_large()  # chunked: no length said up front
                    if not body.add(chunk):
                        self.metrics.refused.labels("bodies_held").inc()
                        return _busy("The router holds too many request bodies; try again.")
        except TimeoutError:
            return error_body("The request body did not arrive in time.", "RequestTimeout", 408)
        return None

    def _too_large(self) -> web.Response:
        self.metrics.refused.labels("body_too_large").inc()
        return error_body(
            f"The request body is over the router's limit of {self.max_body_bytes} bytes.",
            "RequestEntityTooLarge",
            413,
        )

    async def _route(
        self, request: web.Request, body: _Body, tokenize: Tokenize
    ) -> web.StreamResponse:
        raw = body.data
        started = time.perf_counter()
        if len(raw) > self.max_tokenize_bytes:
            read: tuple[list[int], str | None] | None = _LOAD_ONLY
        elif len(raw) <= _INLINE_TOKENIZE_BYTES:
            read = self._tokens(raw, tokenize)
        else:
            loop = asyncio.get_running_loop()
            read = await loop.run_in_executor(self._tokenizing, self._tokens, raw, tokenize)
        if read is None:  # the engine explains what is wrong with it
            self.metrics.unrouted.inc()
            tokens: list[int] = []
            lora = None
        else:
            tokens, lora = read
        del raw  # only ``body`` holds it now: released once no retry can need it
        tried: set[str] = set()
        busy = False
        while True:
            decision = self.router.route(tokens, lora, exclude=tried)
            self.metrics.decision.observe(time.perf_counter() - started)
            if decision is None:
                self.metrics.no_worker.inc()
                if busy:
                    return _busy("Every vLLM server that is up has all its connections busy.")
                why = "".join(f" {problem}." for problem in self.problems)
                return _busy(f"No vLLM server is available: every worker is down or silent.{why}")
            if not tried and (decision.engine_load or not self.bus_up):
                self.metrics.degraded_routes.inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s", request.headers.get("x-request-id", "-"), decision.explain())
            try:
                return await self._forward(request, body, decision)
            except _Busy:
                tried.add(decision.worker)  # not its fault: it stays up for the others
                busy = True
                self.metrics.busy.labels(decision.worker).inc()
            except _Unreachable as error:
                tried.add(decision.worker)
                self.router.mark_down(decision.worker, self.down_for)
                self._say_unreachable(decision.worker, str(error))
            finally:
                self.router.finished(decision)

    def _say_unreachable(self, worker: str, why: str) -> None:
        """One line (at most one a second per configured worker) for a worker that
        failed a request, which went to another: marked down for ``down_for``. Named
        as configured (``--worker a=URL``): its ranks share the address."""
        name = _RANK.sub("", worker)
        _limited_log.warning(
            f"unreachable {name}",  # configured names only: a bounded set of kinds
            "worker %s (%s) unreachable: %s; retrying it in %gs",
            name,
            redact_url(self.workers[name]),
            why,
            self.down_for,
        )

    def _tokens(
        self, raw: bytes | bytearray, tokenize: Tokenize
    ) -> tuple[list[int], str | None] | None:
        """The prompt's token ids and LoRA, or None when the request cannot be read."""
        try:
            body = json.loads(raw)
            model = body.get("model")
            if self.models and model is not None and model not in self.models:
                return None
            if body.get("chat_template") is not None:
                return None  # whether to accept one is the engine's decision
            if self.tokenizer is None:
                return [], None  # not discovered yet: load alone decides
            tokens = tokenize(self.tokenizer, body)
        except Exception:
            return None
        if not all(0 <= t < _TOKEN_LIMIT for t in tokens):
            return None  # not token ids vLLM could have: it says why
        return tokens, model if model in self.loras else None

    async def _forward(
        self, request: web.Request, body: _Body, decision: Decision
    ) -> web.StreamResponse:
        assert self.session is not None
        base, rank, slots = self._upstream(decision.worker)
        sent_headers = request.headers
        headers = {k: sent_headers[k] for k in _FORWARDED if k in sent_headers}
        # The router reads usage from the body, and compressing on loopback or a LAN
        # costs more than it saves (a worker that compresses anyway: `_copy_headers`).
        headers["Accept-Encoding"] = "identity"
        if rank is not None:
            headers["X-data-parallel-rank"] = rank
        labels = (decision.worker, decision.policy.value)
        try:  # a wait for a connection is no fault of the worker's: timed apart
            async with asyncio.timeout(self.pool_timeout):
                await slots.acquire()
        except TimeoutError:
            raise _Busy from None
        try:
            sent = time.perf_counter()
            try:
                async with asyncio.timeout(self.worker_timeout):
                    upstream = await self.session.post(
                        base + request.path, data=body.data, headers=headers
                    )
            except (aiohttp.ClientError, TimeoutError) as error:
                # Refused, dropped, silent or not HTTP, before anything reached the client.
                raise _Unreachable(_failure_text(error, self.worker_timeout)) from error
            async with upstream:
                self.metrics.ttft.labels(*labels).observe(time.perf_counter() - sent)
                content_type = upstream.headers.get("content-type", "")
                streamed = content_type.startswith("text/event-stream")
                answer: bytes | bytearray
                if streamed:
                    body.release()  # a stream is never retried
                    response, answer = await self._relay_stream(request, upstream, decision)
                else:  # all of it first: a worker that breaks off is retried elsewhere
                    try:
                        answer = await upstream.read()
                    except aiohttp.ClientError as error:
                        raise _Unreachable(_failure_text(error, self.worker_timeout)) from error
                    body.release()
                    self.router.started(decision)
                    response = await self._reply(request, upstream, decision, answer)
        finally:
            slots.release()
        self.metrics.requests.labels(*labels, str(upstream.status)).inc()
        if upstream.status == 200:
            self.metrics.prompt_tokens.labels(*labels).inc(decision.prompt_tokens)
            reported = _cached_tokens(answer, streamed)
            if reported is not None:
                self.metrics.observe_prediction(decision, reported)
        return response

    def _upstream(self, worker: str) -> tuple[str, str | None, asyncio.Semaphore]:
        """A worker's (``NAME/dpR``) base URL, data-parallel rank and connection slots
        (one set per address, as aiohttp pools connections), remembered."""
        known = self._bases.get(worker)
        if known is None:
            rank = _RANK.search(worker)
            base = self.workers[_RANK.sub("", worker)]
            origin = str(URL(base).origin())
            slots = self._slots.get(origin)
            if slots is None:
                slots = self._slots[origin] = asyncio.Semaphore(self.worker_connections)
            known = self._bases[worker] = (base, rank.group(1) if rank else None, slots)
        return known

    @staticmethod
    def _copy_headers(
        upstream: aiohttp.ClientResponse, response: web.StreamResponse, decision: Decision
    ) -> None:
        # aiohttp decodes the encodings it knows (gzip, deflate, br, zstd) as it reads;
        # the client gets those bytes decoded, so without their Content-Encoding.
        decoded = getattr(upstream.content, "total_compressed_bytes", None) is not None
        for key, value in upstream.headers.items():
            lowered = key.lower()
            if lowered not in _HOP_BY_HOP and not (decoded and lowered == "content-encoding"):
                response.headers[key] = value
        response.headers["x-kvbus-worker"] = decision.worker
        response.headers["x-kvbus-predicted-cached-tokens"] = str(decision.predicted_cached_tokens)

    async def _reply(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        decision: Decision,
        answer: bytes,
    ) -> web.StreamResponse:
        """A response read whole, sent on as a client reads it (`_send`)."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        self._copy_headers(upstream, response, decision)
        response.content_length = len(answer)
        await response.prepare(request)
        if await self._send(request, response.write(answer), decision):
            await self._send(request, response.write_eof(), decision)
        return response

    async def _send(
        self, request: web.Request, writing: Awaitable[None], decision: Decision
    ) -> bool:
        """Hand bytes to the client: False, its connection dropped, when it left or read
        nothing for ``--client-write-timeout`` (it would hold a worker's connection
        for good). The worker did nothing wrong."""
        try:
            async with asyncio.timeout(self.client_write_timeout):
                await writing
            return True
        except TimeoutError:
            self.metrics.stalled_clients.inc()
            log.info("a client of %s stopped reading; dropped", decision.worker)
        except ConnectionError:  # it left
            pass
        if request.transport is not None:
            request.transport.abort()  # close() would wait to flush to it
        return False

    async def _relay_stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, decision: Decision
    ) -> tuple[web.StreamResponse, bytearray]:
        """Pass a streamed response on chunk by chunk; returns its tail (the usage)."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        self._copy_headers(upstream, response, decision)
        await response.prepare(request)
        tail = bytearray()
        while True:
            try:
                chunk = await upstream.content.readany()
            except aiohttp.ClientError as error:
                # The client has part of a stream: cut it off, as the worker did.
                self.router.mark_down(decision.worker, self.down_for)
                self._say_unreachable(
                    decision.worker,
                    f"broke off a stream ({_failure_text(error, self.worker_timeout)})",
                )
                if request.transport is not None:
                    request.transport.close()
                return response, bytearray()
            if not chunk:
                break
            if not tail:  # the first bytes: the engine is past this prompt's prefill
                self.router.started(decision)
            if not await self._send(request, response.write(chunk), decision):
                return response, bytearray()
            tail += chunk
            del tail[: max(0, len(tail) - _STREAM_TAIL)]  # usage rides on the last event
        await self._send(request, response.write_eof(), decision)
        return response, tail

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for worker in [*self.router.eligible(), *self.workers]:
            base = self.workers.get(_RANK.sub("", worker))
            if base is None:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with asyncio.timeout(_QUICK.total), self._quick_slots:
                    async with self.session.get(f"{base}/v1/models") as upstream:
                        return web.Response(
                            body=await upstream.read(),
                            status=upstream.status,
                            content_type="application/json",
                        )
        return _busy("No vLLM server is available.")

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.eligible.set(len(self.router.eligible()))
        self.metrics.blocks.set(len(self.router.index))
        self.metrics.ready.set(int(self.ready))
        self.metrics.bus_up.set(int(self.bus_up))
        self.metrics.unchained.set(self.router.index.unchained)
        self.metrics.peer_requests.set(self.router.peer_requests)
        return web.Response(
            body=prom.generate_latest(self.metrics.registry),
            headers={"Content-Type": prom.CONTENT_TYPE_LATEST},
        )

    def expect_head(self, protocol: Any, timeout: float) -> None:
        """Close ``protocol``'s connection unless a whole request head arrives within
        ``timeout`` seconds (`_errors` stops the clock when one has)."""
        loop = asyncio.get_running_loop()
        previous = self._head_timers.pop(protocol, None)
        if previous is not None:
            previous.cancel()
        self._head_timers[protocol] = loop.call_later(timeout, self._close_silent, protocol)

    def _close_silent(self, protocol: Any) -> None:
        self._head_timers.pop(protocol, None)
        transport = getattr(protocol, "transport", None)
        if transport is not None and not transport.is_closing():
            self.metrics.slow_clients.inc()
            # A client that has not even read the last response: do not wait on it.
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()

    async def health(self, request: web.Request) -> web.Response:
        """Ready or not (200 or 503), and why: what is read, who may get traffic, the
        bus's state and routing's (``degraded`` while some worker's load comes from its
        own endpoint), and the set-up mistakes seen (`problems`)."""
        engine_load = self.router.engine_loaded()
        bus_up = self.bus_up
        state = {
            "ready": self.ready,
            "kv_history": self.kv_replayed,
            "load": self.load_read,
            "tokenizer": self.tokenizer is not None,
            "tokenizer_error": self.tokenizer_error,
            "eligible": self.router.eligible(),
            "bus": "up" if bus_up else "down",
            "routing": "full" if bus_up and not engine_load else "degraded (load from engines)",
            "engine_load": engine_load,
            "problems": self.problems,
        }
        return web.json_response(state, status=200 if state["ready"] else 503)


def _report_failure(task: asyncio.Task[None]) -> None:
    """A background task that ends by failing (a bad --url, say) says so at once: the
    router will never be ready."""
    if not task.cancelled() and task.exception() is not None:
        log.error("router task stopped: %r; /health stays 503", task.exception())


class _Unreachable(Exception):
    """The worker refused or dropped the connection before answering (safe to retry);
    its text says how, in a few words (`_failure_text`)."""


_CONNECTION_ERRORS: Final = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
}


def _failure_text(error: BaseException, worker_timeout: float) -> str:
    """How a request to a worker failed, in a few words for a log line ("connection
    refused"), not the client library's repr."""
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "no connection in time"
    if isinstance(error, TimeoutError):  # --worker-timeout (aiohttp's read timeouts too)
        return f"no answer within {worker_timeout:g}s"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "it closed the connection without answering"
    if isinstance(error, aiohttp.ClientResponseError):  # it answered, but not in HTTP
        return f"not an HTTP answer ({displayable(error.message, _SHOWN_ERROR)})"
    cause = error.os_error if isinstance(error, aiohttp.ClientConnectorError) else error
    if isinstance(cause, socket.gaierror):
        return f"host not found ({cause.strerror})"
    if isinstance(cause, OSError) and cause.errno in _CONNECTION_ERRORS:
        return _CONNECTION_ERRORS[cause.errno]
    text = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(error)
    return displayable(" ".join(text.split()) or type(error).__name__, _SHOWN_ERROR)


class _Busy(Exception):
    """All of a worker's connections stayed in use for ``--pool-timeout`` (safe to send
    elsewhere; the worker is not at fault)."""


class Unreported(enum.Enum):
    """A response's usage without ``prompt_tokens_details.cached_tokens``: vLLM sends
    ``"prompt_tokens_details": null`` (or, in a stream, leaves it out) unless it runs
    with ``--enable-prompt-tokens-details``."""

    UNREPORTED = "unreported"


UNREPORTED: Final = Unreported.UNREPORTED


def _cached_tokens(body: bytes | bytearray, streamed: bool) -> int | Unreported | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a response (a stream's usage is
    in its last data event, sent with ``stream_options.include_usage``); `UNREPORTED`:
    usage without it; None: no usage."""
    if streamed:
        events = [line[6:] for line in body.splitlines() if line.startswith(b"data: {")]
        body = events[-1] if events else b""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        usage = json.loads(body)["usage"]
        details = usage.get("prompt_tokens_details")
        cached = None if details is None else details.get("cached_tokens")
        return UNREPORTED if cached is None else int(cached)
    return None


def engine_loads(text: bytes, now: float) -> dict[int, LoadMetrics]:
    """Each engine's load in a vLLM ``/metrics`` answer (Prometheus text), by its
    ``engine`` label (the data-parallel rank; 0 when unlabelled), stamped ``now``: the
    sum of each gauge's series per engine. An engine without both request gauges, or
    with a figure that is not a finite number, is left out; counts are brought into
    0..2^31 (the router clamps the usage). One pass over the text per gauge, O(size)."""
    figures: dict[int, dict[str, float]] = {}
    text = b"\n" + text
    for name, field in _ENGINE_GAUGES.items():
        needle = b"\n" + name
        start = 0
        while (found := text.find(needle, start)) >= 0:
            end = text.find(b"\n", found + 1)
            end = len(text) if end < 0 else end
            start = end
            rest = text[found + len(needle) : end]
            if rest[:1] == b"{":
                labels, brace, rest = rest[1:].rpartition(b"}")
                if not brace:
                    continue
            elif rest[:1] == b" ":
                labels = b""
            else:
                continue  # another series whose name starts alike
            parts = rest.split()
            with contextlib.suppress(ValueError):
                value = float(parts[0]) if parts else math.nan
                if not math.isfinite(value):
                    continue
                match = _ENGINE_LABEL.search(labels)
                engine = int(match.group(1)) if match else 0
                if engine not in figures and len(figures) >= _MAX_ENGINE_RANKS:
                    continue
                engine_figures = figures.setdefault(engine, {})
                engine_figures[field] = engine_figures.get(field, 0.0) + value
    return {
        engine: LoadMetrics(
            ts=now,
            engine_index=engine,
            running=_request_count(found["running"]),
            waiting=_request_count(found["waiting"]),
            kv_cache_usage=found.get("kv_cache_usage", 0.0),
        )
        for engine, found in figures.items()
        if "running" in found and "waiting" in found
    }


def _request_count(value: float) -> int:
    return int(min(max(value, 0.0), _MAX_REQUESTS_FIGURE))


class _TooLarge(Exception):
    """An answer over the bytes it may have."""


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """``response``'s body, refused (`_TooLarge`) past ``limit`` bytes before more is
    read; one the server compressed anyway (asked not to) is refused too, as what it
    would decompress to is unbounded by what arrives."""
    if response.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise _TooLarge("compressed")
    if (response.content_length or 0) > limit:
        raise _TooLarge(f"{response.content_length} bytes")
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise _TooLarge(f"over {limit} bytes")
    return bytes(data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's options (``kvbus router`` and ``examples/nats_router.py``)."""
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="a vLLM server: its KVBUS_SOURCE and base URL (repeat for each)",
    )
    parser.add_argument("--policy", choices=[p.value for p in Policy], default="kv")
    parser.add_argument("--tokenizer", help="tokenizer dir (default: the served model's)")
    parser.add_argument(
        "--url",
        default=command_url(),
        help="kvbus transport (default $KVBUS_URL, else nats://127.0.0.1:4222)",
    )
    parser.add_argument("--kv-stream", default="kv")
    parser.add_argument(
        "--metrics-stream", default=os.environ.get("KVBUS_METRICS_STREAM", "metrics")
    )
    parser.add_argument(
        "--connector-stream",
        default=os.environ.get("KVBUS_CONNECTOR_STREAM"),
        help="export the engines' KV connector transfers from this stream in /metrics",
    )
    parser.add_argument(
        "--routes-stream",
        help="replicas behind one address: share requests in flight on this stream "
        "(the same for every replica, e.g. routes)",
    )
    parser.add_argument(
        "--replica", help="this replica's source on --routes-stream (default hostname-pid)"
    )
    parser.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="cost weight: prefill, eviction, waiting, running, kv_usage (see kvbus.router)",
    )
    parser.add_argument(
        "--stale-after",
        type=float,
        default=5.0,
        help="seconds without a worker's load record before it gets no traffic (unless its "
        "own endpoint answers); as long without any: the bus is down, routing degraded",
    )
    parser.add_argument(
        "--engine-poll-interval",
        type=float,
        default=1.0,
        help="seconds between reads of a worker's own /health and /metrics while the bus "
        "tells nothing of it (the bus down, or its engine publishing under another name)",
    )
    parser.add_argument("--block-size", type=int, help="default: from the engines' events")
    parser.add_argument("--seed", type=int, default=0, help="for ties (same inputs, same picks)")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--worker-connections", type=int, default=256, help="most connections to one worker"
    )
    limits.add_argument(
        "--worker-timeout",
        type=float,
        default=300.0,
        help="seconds to a worker's first byte (all of a response not streamed); then it "
        "is marked down and the request goes to another",
    )
    limits.add_argument(
        "--pool-timeout",
        type=float,
        default=30.0,
        help="seconds a request waits for one of a worker's --worker-connections; then it "
        "goes to another worker (the busy one is not marked down), or 503 if none is free",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for each request head, from the connection's opening or its previous "
        "response; then the connection is closed (idle keep-alive ones too)",
    )
    limits.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds for a client's request body"
    )
    limits.add_argument(
        "--client-write-timeout",
        type=float,
        default=30.0,
        help="seconds a client may read nothing of its response (a stream included); then "
        "it is dropped, and its worker's connection freed",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 * 2**20,
        help="larger request bodies are refused, 413 (default 32 MiB: a 1M-token prompt as "
        "text or token ids is under 10 MiB; the rest is room for images in data URLs)",
    )
    limits.add_argument(
        "--max-held-body-bytes",
        type=int,
        default=256 * 2**20,
        help="request bodies held at once, all clients together, until no retry can need "
        "them; a request over it is answered 503 with Retry-After (default 256 MiB)",
    )
    limits.add_argument(
        "--max-tokenize-bytes",
        type=int,
        default=2**20,
        help="larger request bodies are routed by load alone, not tokenized",
    )
    limits.add_argument(
        "--drain-timeout",
        type=float,
        default=0.5,
        help="seconds requests in flight get to finish after SIGTERM/SIGINT; then they are "
        "cut and the router exits",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="debug: every decision with its reason",
    )


async def start(
    app: RouterApp,
    host: str,
    port: int,
    header_timeout: float = 10.0,
    drain_timeout: float = 0.5,
) -> tuple[web.AppRunner, asyncio.Server]:
    """Serve ``app`` on ``host:port``; stop with `stop` (requests in flight get
    ``drain_timeout`` seconds, then are cancelled).

    Handlers are cancelled when their client leaves (the upstream request with them),
    and a connection that has not sent a whole request head within ``header_timeout``
    seconds of opening, or of its previous response, is closed: aiohttp itself waits
    its keepalive_timeout (75 s) even for half a head, so 3,000 half-sent requests used
    to hold 3,000 sockets.
    """
    app.header_timeout = header_timeout
    runner = web.AppRunner(
        app.app(),
        handler_cancellation=True,
        shutdown_timeout=drain_timeout,
        access_log_class=_AccessLog,
    )
    await runner.setup()
    loop = asyncio.get_running_loop()
    make_protocol = runner.server
    assert make_protocol is not None

    def connection() -> asyncio.BaseProtocol:
        protocol = make_protocol()
        app.expect_head(protocol, header_timeout)
        return protocol

    server = await loop.create_server(connection, host, port)
    return runner, server


async def stop(runner: web.AppRunner, server: asyncio.Server) -> None:
    server.close()
    await runner.cleanup()


class _AccessLog(web_log.AccessLogger):
    """aiohttp's access log (``aiohttp.access``, INFO), but a probe of ``/health`` or
    ``/metrics`` only at DEBUG: a load balancer asks every few seconds, and its lines
    would bury the requests' (why the router is not ready is logged on its own)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path not in _PROBES or request.method != "GET":
            super().log(request, response, time)
        elif self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                '%s "%s %s" %d %.6fs',
                request.remote,
                request.method,
                request.path,
                response.status,
                time,
            )


def listening_line(app: RouterApp, server: asyncio.Server) -> str:
    """What `_serve_forever` says once it accepts connections: where, to which
    workers, on which bus (its credentials hidden)."""
    host, port = server.sockets[0].getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    return (
        f"kvbus router listening on http://{where}:{port} "
        f"(workers: {', '.join(app.workers)}; bus: {redact_url(app.url)})"
    )


async def _serve_forever(
    app: RouterApp, host: str, port: int, header_timeout: float, drain_timeout: float
) -> None:
    runner, server = await start(app, host, port, header_timeout, drain_timeout)
    log.info("%s", listening_line(app, server))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        await stop(runner, server)


def build(args: argparse.Namespace) -> RouterApp:
    workers = dict(w.split("=", 1) for w in args.worker)
    weights = CostWeights(**{k: float(v) for k, v in (w.split("=", 1) for w in args.weight)})
    router = Router(
        args.policy,
        weights,
        block_size=args.block_size,
        stale_after=args.stale_after,
        seed=args.seed,
    )
    return RouterApp(
        workers,
        router,
        args.url,
        args.tokenizer,
        args.kv_stream,
        args.metrics_stream,
        worker_connections=args.worker_connections,
        worker_timeout=args.worker_timeout,
        body_timeout=args.body_timeout,
        max_tokenize_bytes=args.max_tokenize_bytes,
        max_body_bytes=args.max_body_bytes,
        max_held_body_bytes=args.max_held_body_bytes,
        client_write_timeout=args.client_write_timeout,
        pool_timeout=args.pool_timeout,
        connector_stream=args.connector_stream,
        routes_stream=args.routes_stream,
        replica=args.replica,
        engine_poll_interval=args.engine_poll_interval,
    )


def serve(args: argparse.Namespace) -> int:
    """Run the router until interrupted."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    app = build(args)
    run(_serve_forever(app, args.host, args.port, args.header_timeout, args.drain_timeout))
    return 0


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run the router's event loop: uvloop's where installed (``kvbus[router]``;
    0.85 instead of 1.0 ms added per completion, bench/bench_overhead.py), else
    asyncio's. Unlike `asyncio.run`, what is left running at the end gets a bounded
    time to take its cancel: a bus client that swallows one (Redis or NATS down) does
    not keep the process for ever."""
    try:
        import uvloop
    except ImportError:
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                _, stuck = loop.run_until_complete(asyncio.wait(left, timeout=_STOP_WAIT))
                if stuck:
                    log.warning("%d tasks ignored their cancel; exiting anyway", len(stuck))
            for ending in (loop.shutdown_asyncgens(), loop.shutdown_default_executor()):
                loop.run_until_complete(asyncio.wait([loop.create_task(ending)], timeout=1))
        finally:
            loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_arguments(parser)
    return serve(parser.parse_args(argv))
