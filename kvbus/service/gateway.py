"""``kvbus router``: an OpenAI-compatible router in front of vLLM servers, as a service.

Each vLLM server runs with the kvbus plugin and stat logger (``pip install kvbus[vllm]``)
and ``KVBUS_URL`` pointing at the same bus, with ``KVBUS_SOURCE=NAME``; its KV events
and load then arrive as sources ``NAME/dp<rank>``. The router follows both streams,
tokenizes each request as vLLM does (the chat template for chat), asks `kvbus.routing.router`
which worker to use, and forwards the request there unchanged (data-parallel rank in
vLLM's ``X-data-parallel-rank`` header); the response, streamed or not, comes back
unchanged. ``x-kvbus-worker``, ``x-kvbus-predicted-cached-tokens`` and ``x-kvbus-kv-seq``
(the worker's latest kv batch applied when routed) headers are added.

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
import logging
import os
import signal
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Final

from aiohttp import web, web_log

import kvbus
from kvbus.bus.follow import BACKEND_RECHECK
from kvbus.config import command_url, redact_url
from kvbus.routing.router import CostWeights, Policy, Router
from kvbus.routing.transfers import ConnectorMetrics
from kvbus.service.bus_followers import BusFollowers
from kvbus.service.bus_watch import ENGINE_METRICS_MAX_BYTES, BusWatch, engine_loads
from kvbus.service.disagg import PrefillDecode, Role, WorkerRoles
from kvbus.service.discovery import DEFAULT_HOSTS, AllowedHosts, WorkerDiscovery
from kvbus.service.handlers import RouterHTTP, error_body
from kvbus.service.router_metrics import UNREPORTED, Metrics, Unreported
from kvbus.service.segment_tokens import CACHED_BYTES
from kvbus.service.served_model import ServedModel, Tokenizer
from kvbus.service.upstream import BodyBudget, Upstream
from kvbus.service.upstream import cached_tokens as _cached_tokens
from kvbus.service.worker_names import RANK
from kvbus.wire.envelope import Kind

__all__ = [  # the service's parts, importable from here as before they moved out
    "BACKEND_RECHECK",
    "ENGINE_METRICS_MAX_BYTES",
    "UNREPORTED",
    "BodyBudget",
    "Metrics",
    "RouterApp",
    "Tokenizer",
    "Unreported",
    "_cached_tokens",
    "add_arguments",
    "build",
    "engine_loads",
    "error_body",
    "main",
    "run",
    "serve",
    "start",
    "stop",
]

log = logging.getLogger("kvbus.routing.router")
_STOP_WAIT: Final = 0.5
"""Seconds the bus readers and the routes publisher get to end once cancelled or
closed at shutdown; a client library that swallows a cancel is not waited for."""
_PROBES: Final = frozenset({"/health", "/metrics"})
"""Paths a load balancer or Prometheus asks every few seconds: access-logged at DEBUG."""


class RouterApp:
    """The router service put together from its parts: `Upstream` (the workers'
    connections, forwarding), `ServedModel` (model names, tokenizer), `BusFollowers`
    (the bus streams), `BusWatch` (the bus's state, the engines' own load) and
    `RouterHTTP` (the handlers); `app` is its web application, whose lifetime the bus
    readers and the workers' connections share."""

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
        discover_hosts: Sequence[str] | None = None,
        roles: dict[str, Role] | None = None,
        skip_prefill_above: float = 0.9,
        send_token_ids: bool = True,
        prompt_cache_bytes: int = CACHED_BYTES,
    ) -> None:
        self.workers = {name: base.rstrip("/") for name, base in workers.items()}
        self.router = router
        self.url = url
        self.routes_stream = routes_stream
        """Where replicas behind one address share their requests in flight."""
        self.replica = replica
        self.routes: kvbus.Publisher | None = None
        self.metrics = Metrics()
        self.connector_metrics = (
            ConnectorMetrics(self.metrics.registry) if connector_stream else None
        )
        """The engines' KV connector transfers and stats, in this router's /metrics."""
        self.upstream = Upstream(
            self.workers,
            router,
            self.metrics,
            down_for,
            worker_connections=worker_connections,
            worker_timeout=worker_timeout,
            pool_timeout=pool_timeout,
            client_write_timeout=client_write_timeout,
        )
        self.served = ServedModel(
            self.workers,
            self.upstream,
            tokenizer,
            max_tokenize_bytes,
            send_token_ids,
            prompt_cache_bytes,
        )
        self.upstream.on_unreachable = self.served.forget_ids  # (checked again before ids)
        self.followers = BusFollowers(
            self.workers,
            router,
            self.metrics,
            url,
            kv_stream,
            metrics_stream,
            self.connector_metrics,
            connector_stream,
            routes_stream,
        )
        if discover_hosts is not None:
            self.followers.discovery = WorkerDiscovery(
                self.workers,
                AllowedHosts(discover_hosts),
                self.upstream.forget_address,
                lambda name: name in {RANK.sub("", w) for w in router.eligible()},
            )
        self.watch = BusWatch(
            self.workers, router, self.metrics, self.followers, self.upstream, engine_poll_interval
        )
        self.http = RouterHTTP(
            self.workers,
            router,
            self.metrics,
            self.upstream,
            self.followers,
            self.watch,
            self.served,
            body_timeout=body_timeout,
            max_body_bytes=max_body_bytes,
            max_held_body_bytes=max_held_body_bytes,
        )
        self.roles = WorkerRoles(roles)
        self.followers.roles = self.roles
        self.http.pd = PrefillDecode(
            self.roles, router, self.upstream, self.metrics, skip_prefill_above
        )
        self._tasks: list[asyncio.Task[None]] = []

    # What the parts know, read here as before they moved out (tests, `start`).

    @property
    def ready(self) -> bool:
        return self.http.ready

    @property
    def bus_up(self) -> bool:
        return self.followers.bus_up

    @property
    def kv_replayed(self) -> bool:
        return self.followers.kv_replayed

    @property
    def load_read(self) -> bool:
        return self.followers.load_read

    @property
    def models(self) -> set[str]:
        return self.served.models

    @property
    def problems(self) -> list[str]:
        return self.watch.problems

    @property
    def bodies(self) -> BodyBudget:
        return self.http.bodies

    @property
    def header_timeout(self) -> float:
        return self.http.header_timeout

    @header_timeout.setter
    def header_timeout(self, seconds: float) -> None:
        self.http.header_timeout = seconds

    def app(self) -> web.Application:
        http = self.http
        app = web.Application(client_max_size=http.max_body_bytes, middlewares=[http.errors])
        app.router.add_post("/v1/completions", http.completions)
        app.router.add_post("/v1/chat/completions", http.chat)
        app.router.add_get("/v1/models", http.list_models)
        app.router.add_get("/metrics", http.prometheus)
        app.router.add_get("/health", http.health)
        app.router.add_post("/v1/responses", http.responses)
        app.router.add_post("/v1/messages", http.anthropic)
        for path in ENGINE_ADMIN_PATHS:
            app.router.add_route("*", path, http.engine_admin)
        app.router.add_route("*", "/{path:.*}", http.pass_through)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        self.followers.start_clock()  # the bus gets --stale-after
        self.upstream.open()
        followers = self.followers
        self._tasks = [
            asyncio.create_task(followers.follow_kv()),
            asyncio.create_task(followers.follow_metrics()),
            asyncio.create_task(self.served.discover()),
            asyncio.create_task(self.watch.run()),
        ]
        if self.connector_metrics is not None:
            self._tasks.append(asyncio.create_task(followers.follow_connector()))
        if self.routes_stream:
            routes = self.routes = kvbus.Publisher(
                self.url, stream=self.routes_stream, source=self.replica
            )
            self.router.replica = routes.source
            self.router.share = lambda event: routes.publish(event, Kind.ROUTES)
            self._tasks.append(asyncio.create_task(followers.follow_routes()))
        for task in self._tasks:
            task.add_done_callback(_report_failure)
        yield
        for task in [*self._tasks, *self.watch.polls.values()]:
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
        self.served.close()  # (first: its checks use the upstream's session)
        await self.upstream.close()


ENGINE_ADMIN_PATHS: Final = (
    "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc",
    "/abort_requests", "/release_kv_cache_memory", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/start_profile", "/stop_profile", "/scale_elastic_ep",
    "/is_scaling_elastic_ep", "/update_weights", "/update_weight_version",
    "/start_weight_update", "/finish_weight_update", "/start_draft_weight_update",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
)  # fmt: skip
"""vLLM's per-engine controls (vLLM 0.32): the router answers them 404 rather than send
each to one engine chosen by load."""


def _report_failure(task: asyncio.Task[None]) -> None:
    """A background task that ends by failing (a bad --url, say) says so at once: the
    router will never be ready."""
    if not task.cancelled() and task.exception() is not None:
        log.error("router task stopped: %r; /health stays 503", task.exception())


def _positive_seconds(text: str) -> float:
    seconds = float(text)
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return seconds


def _mib(text: str) -> float:
    mib = float(text)
    if not (mib == 0 or 1 <= mib <= 2**20):  # (NaN too; under 1, every segment too large)
        raise argparse.ArgumentTypeError(f"must be 0, or 1 to 1048576 MiB, not {text}")
    return mib


def _share(text: str) -> float:
    share = float(text)
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a share between 0 and 1")
    return share


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's options (``kvbus router`` and ``examples/nats_router.py``)."""
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a vLLM server: its KVBUS_SOURCE and base URL (repeat for each); none: the "
        "engines the bus tells of (their load records' URLs, within --discover-hosts)",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a prefill worker of a disaggregated (P/D) fleet, as --worker (a --worker "
        "takes the role its engine advertises in $KVBUS_ROLE)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a decode worker of a disaggregated (P/D) fleet, as --worker",
    )
    parser.add_argument(
        "--skip-prefill-above",
        type=_share,
        default=0.9,
        metavar="SHARE",
        help="P/D: a request whose decode worker holds over this share of its prompt "
        "goes there without a prefill hop",
    )
    parser.add_argument(
        "--discover-hosts",
        action="append",
        metavar="HOSTS",
        help="route also to engines found on the bus whose advertised URL's host is in "
        "these IP networks or names (comma-separated; '.example' for every name under "
        f"it; default without --worker: {','.join(DEFAULT_HOSTS)})",
    )
    parser.add_argument("--policy", choices=[p.value for p in Policy], default="kv")
    parser.add_argument("--tokenizer", help="tokenizer dir (default: the served model's)")
    parser.add_argument(
        "--send-token-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send a completion's text prompt to its engine as the token ids the router "
        "computed, so the engine does not tokenize it again (to each engine once its "
        "/tokenize agrees with the router's tokenizer; where the answer could tell, as "
        "sent: README; default: on; --no-send-token-ids: every request as the client "
        "sent it)",
    )
    parser.add_argument(
        "--prompt-cache-mib",
        type=_mib,
        default=CACHED_BYTES / 2**20,
        metavar="MIB",
        help="memory for segments of long prompts already tokenized, so that a prefix "
        "they share (a system prompt, a conversation's earlier turns) is tokenized once "
        "(where the tokenizer gives the same ids so: README; default: "
        f"{CACHED_BYTES // 2**20}; 0: every prompt tokenized whole)",
    )
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
        help=(
            "cost weight: prefill, queued, eviction, waiting, running, kv_usage, pace "
            "(kvbus.routing.cost)"
        ),
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
    parser.add_argument(
        "--session-header",
        default="x-session-id",
        help="request header naming a session: its requests stay on one worker (shared "
        "with the replicas on --routes-stream); empty: none",
    )
    parser.add_argument(
        "--session-slack",
        type=float,
        default=64.0,
        help="blocks of prefill: a session moves when its worker may not get traffic or "
        "costs more than this over the best (overloaded, or its cache lost the prefix); "
        "inf: only when it may not get traffic",
    )
    parser.add_argument(
        "--session-ttl",
        type=_positive_seconds,
        default=600.0,
        help="seconds a session's worker is remembered after its last request",
    )
    parser.add_argument("--block-size", type=int, help="default: from the engines' events")
    parser.add_argument("--seed", type=int, default=0, help="for ties (same inputs, same picks)")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--worker-connections", type=int, default=256, help="most connections to one worker"
    )
    limits.add_argument(
        "--worker-timeout",
        type=_positive_seconds,
        default=300.0,
        help="seconds to a worker's first byte (all of a response not streamed); then it "
        "is marked down and the request goes to another",
    )
    limits.add_argument(
        "--shed-after",
        type=_positive_seconds,
        help="seconds: a request that the best worker should take longer than this to "
        "start (its predicted time to a first token, learned from the first tokens seen) "
        "is answered 503 with Retry-After at once, taking nothing from the engines; set "
        "it to the TTFT SLO, past which a request only takes the time of others "
        "(default: never)",
    )
    limits.add_argument(
        "--deadline",
        type=_positive_seconds,
        help="seconds: a request that the best worker should take longer than this to "
        "finish (its predicted first token plus its expected output at the worker's "
        "seconds per token, timed from the steps of its streams as they are relayed) is "
        "answered 503 at once, like --shed-after; set it to the clients' timeout for a "
        "whole answer. A request's X-Kvbus-Deadline header (seconds, from its arrival) is "
        "its own instead (default: only those)",
    )
    limits.add_argument(
        "--pool-timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds a request waits for one of a worker's --worker-connections; then it "
        "goes to another worker (the busy one is not marked down), or 503 if none is free",
    )
    limits.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=10.0,
        help="seconds for each request head, from the connection's opening or its previous "
        "response; then the connection is closed (idle keep-alive ones too)",
    )
    limits.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds for a client's request body",
    )
    limits.add_argument(
        "--client-write-timeout",
        type=_positive_seconds,
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
        app.http.expect_head(protocol, header_timeout)
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
    workers = ", ".join(app.workers)
    if app.followers.discovery is not None:
        workers = f"{workers}{'; ' if workers else ''}those the bus tells of"
    return (
        f"kvbus router listening on http://{where}:{port} "
        f"(workers: {workers}; bus: {redact_url(app.url)})"
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
    roles: dict[str, Role] = {}
    for role, given in ((Role.PREFILL, args.prefill), (Role.DECODE, args.decode)):
        for name, url in (w.split("=", 1) for w in given):
            workers[name], roles[name] = url, role
    hosts = [h for given in args.discover_hosts or [] for h in given.split(",")]
    discover = hosts or (None if workers else list(DEFAULT_HOSTS))
    weights = CostWeights(**{k: float(v) for k, v in (w.split("=", 1) for w in args.weight)})
    router = Router(
        args.policy,
        weights,
        block_size=args.block_size,
        stale_after=args.stale_after,
        seed=args.seed,
        shed_after=args.shed_after,
        deadline=args.deadline,
        session_slack=args.session_slack,
        session_ttl=args.session_ttl,
    )
    app = RouterApp(
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
        discover_hosts=discover,
        roles=roles,
        skip_prefill_above=args.skip_prefill_above,
        send_token_ids=args.send_token_ids,
        prompt_cache_bytes=int(args.prompt_cache_mib * 2**20),
    )
    app.http.session_header = args.session_header
    return app


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
