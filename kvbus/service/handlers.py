"""The router service's HTTP side: the endpoints it routes by prompt (completions, chat,
the Responses API, Anthropic's ``/v1/messages``), every other path a vLLM server serves
passed through by load (embeddings, pooling, score, rerank, audio, ``/tokenize``, ...),
the model list, ``/metrics`` and ``/health``; every error it gives in vLLM's shape; the
time a connection gets for each request head (``--header-timeout``) and a body
(``--body-timeout``), and the bytes a body may have."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from typing import Any, Final

import aiohttp
import prometheus_client as prom
from aiohttp import web

from kvbus.routing.router import Decision, Router
from kvbus.routing.sessions import session_key
from kvbus.service.bus_followers import BusFollowers
from kvbus.service.bus_watch import BusWatch
from kvbus.service.disagg import PrefillDecode, Prefilled
from kvbus.service.response_homes import ResponseHomes
from kvbus.service.router_metrics import Metrics
from kvbus.service.served_model import LOAD_ONLY, ServedModel, Tokenize
from kvbus.service.upstream import (
    QUICK,
    STEPPED_PATHS,
    BodyBudget,
    RequestBody,
    Upstream,
    WorkerBusy,
    WorkerUnreachable,
)
from kvbus.service.worker_names import RANK

log = logging.getLogger("kvbus.routing.router")


def error_body(
    message: str, kind: str, status: int, retry_after: float | None = None
) -> web.Response:
    """An error in vLLM's shape (`ErrorResponse`); with ``retry_after``, a
    ``Retry-After`` header saying when to try again (OpenAI clients honour it)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    headers = None if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return web.json_response(body, status=status, headers=headers)


DEADLINE_HEADER: Final = "X-Kvbus-Deadline"
"""A request's own deadline (seconds to its last token, from its arrival), over the
router's ``--deadline``."""


def request_deadline(value: str | None) -> float | None:
    """A deadline header's seconds (None: none given); ValueError when it is not a
    positive number of seconds."""
    if value is None:
        return None
    seconds = float(value)  # (ValueError: not a number; its length is aiohttp's to bound)
    if not 0 < seconds < math.inf:
        raise ValueError(value)
    return seconds


def _busy(message: str) -> web.Response:
    return error_body(message, "ServiceUnavailableError", 503, retry_after=1)


class RouterHTTP:
    """The handlers (`completions`, `chat`, `list_models`, `prometheus`, `health`) and
    the `errors` middleware of the router's web application."""

    def __init__(
        self,
        workers: dict[str, str],
        router: Router,
        metrics: Metrics,
        upstream: Upstream,
        followers: BusFollowers,
        watch: BusWatch,
        served: ServedModel,
        *,
        body_timeout: float,
        max_body_bytes: int,
        max_held_body_bytes: int,
    ) -> None:
        self.workers = workers
        self.router = router
        self.metrics = metrics
        self.upstream = upstream
        self.followers = followers
        self.watch = watch
        self.served = served
        self.body_timeout = body_timeout
        if max_held_body_bytes < max_body_bytes:
            raise ValueError(
                f"max_held_body_bytes ({max_held_body_bytes}) must hold one body of "
                f"max_body_bytes ({max_body_bytes})"
            )
        self.max_body_bytes = max_body_bytes
        self.bodies = BodyBudget(max_held_body_bytes)
        self.homes = ResponseHomes()
        """Where each Responses API response was made (`remember`)."""
        upstream.answered = self.remember
        self.session_header = "x-session-id"
        """The request header that names a session (`kvbus.routing.sessions`); set by
        `kvbus.service.gateway.build` (``--session-header``; empty: none)."""
        self.pd: PrefillDecode | None = None
        """Prefill/decode disaggregation (`kvbus.service.disagg`), set by
        `kvbus.service.gateway.RouterApp`."""
        self.header_timeout = 10.0
        """Set by `kvbus.service.gateway.start`: seconds for each request head, from the
        connection's opening or its previous response."""
        self._head_timers: dict[Any, asyncio.TimerHandle] = {}
        """Connections yet to send a whole request head, and when they must have."""

    @property
    def ready(self) -> bool:
        """Some worker may get traffic and the tokenizer is loaded, and the bus's history
        is read (or the bus is down: routing degraded, not stopped)."""
        return (
            ((self.followers.kv_replayed and self.followers.load_read) or not self.followers.bus_up)
            and (self.served.tokenizer is not None or self.served.tokenizer_error is not None)
            and bool(self.router.eligible())
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda t, body: t.completion(body), as_ids=True)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda t, body: t.chat(body))

    def _shed(self, decision: Decision, deadline: float | None, left: float | None) -> web.Response:
        """The 503 of a request shed (`Decision.shed`), saying which limit it passed
        (``deadline``: its own; ``left``: of that or the router's, what remained)."""
        self.metrics.shed.labels(decision.shed_limit).inc()
        if decision.shed_limit == "first_token":
            return _busy(
                f"Every vLLM server is too busy: the best would take about "
                f"{decision.predicted_ttft:.1f} s to a first token (the router's "
                f"--shed-after is {self.router.shed_after:g} s)."
            )
        given = (
            f"the request's deadline of {deadline:g} s"
            if deadline is not None
            else f"the router's --deadline of {self.router.deadline:g} s"
        )
        return _busy(
            f"Every vLLM server is too busy: the best would take about "
            f"{decision.predicted_end:.1f} s to the last token, and {left or 0.0:.1f} s "
            f"are left of {given}."
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: by its prompt, or to the worker that made the response
        its ``previous_response_id`` names (that engine holds the conversation)."""
        return await self._generate(request, lambda t, body: t.responses(body))

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages`` (Anthropic's API, which vLLM serves): by its prompt."""
        return await self._generate(request, lambda t, body: t.anthropic(body))

    async def engine_admin(self, request: web.Request) -> web.StreamResponse:
        """One engine's own controls (sleep, pause, cache resets, LoRA loading, weight
        updates, profiling, RPC): sent to one engine chosen by load they would leave the
        fleet inconsistent, so the router refuses them. Call each engine directly."""
        return error_body(
            f"{request.path} controls one vLLM engine: call each engine's own address, "
            "not the router.",
            "NotFoundError",
            404,
        )

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        """Any other path, any method, sent on unchanged to a worker chosen by load: what
        vLLM serves without a prompt to route by (embeddings, pooling, score, rerank,
        audio) and what the router does not know (a newer vLLM's endpoints). A stored
        response (``/v1/responses/{id}``, its ``/cancel``) goes where it was made.
        ``/tokenize`` too goes by load: it computes nothing, so where it runs caches
        nothing, and routing it by prefix would count its prompt as soon cached there."""
        return await self._generate(request, None)

    def remember(self, request: web.Request, decision: Decision, status: int, head: bytes) -> None:
        """`Upstream.answered`: a new response's id and where it was made."""
        if status == 200 and request.path == "/v1/responses":
            self.homes.answered(decision.worker, head)

    @web.middleware
    async def errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
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

    async def _generate(
        self, request: web.Request, tokenize: Tokenize | None, as_ids: bool = False
    ) -> web.StreamResponse:
        arrived = time.perf_counter()
        try:
            deadline = request_deadline(request.headers.get(DEADLINE_HEADER))
        except ValueError:
            return error_body(
                f"{DEADLINE_HEADER} must be a positive number of seconds.", "BadRequestError", 400
            )
        body = RequestBody(self.bodies)
        try:
            refused = await self._receive(request, body)
            if refused is not None:  # (a response is a mapping: falsy when empty)
                return refused
            home = self.homes.of_path(request.path)
            if home is None and request.path == "/v1/responses":
                home = self.homes.of_body(body.data)
            if home is not None:
                # Its prompt continues a conversation only that engine holds: keyed by
                # its new input alone it would count blocks the engine never stores.
                tokenize = None
            return await self._route(request, body, tokenize, home, as_ids, arrived, deadline)
        finally:
            body.release()

    async def _receive(self, request: web.Request, body: RequestBody) -> web.Response | None:
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
        self,
        request: web.Request,
        body: RequestBody,
        tokenize: Tokenize | None,
        home: str | None = None,
        as_ids: bool = False,
        arrived: float = 0.0,
        deadline: float | None = None,
    ) -> web.StreamResponse:
        """Route the request (by its prompt, as ``tokenize`` reads it; by load alone
        without one; to ``home`` alone while it may get traffic) and send it on (with
        ``as_ids``, its prompt as the token ids where ``--send-token-ids`` may). It
        arrived at ``arrived`` (`time.perf_counter`); ``deadline``: its own."""
        raw = body.data
        started = time.perf_counter()
        pd = self.pd if self.pd is not None and self.pd.active() else None
        as_ids = as_ids and pd is None and tokenize is not None  # (one hop: a prefill's is its own)
        read, sent = (
            await self.served.read(raw, tokenize, as_ids)
            if tokenize is not None
            else (LOAD_ONLY, None)
        )
        if read is None:  # the engine explains what is wrong with it
            self.metrics.unrouted.inc()
            read = LOAD_ONLY
        del raw  # only ``body`` holds it now: released once no retry can need it
        limit = deadline if deadline is not None else self.router.deadline
        # A pass-through (embeddings, /tokenize, ...) makes no output to time.
        max_tokens, ignores_eos = (
            (read.max_tokens, read.ignores_eos) if tokenize is not None else (1, True)
        )
        named = request.headers.get(self.session_header) if self.session_header else None
        session = session_key(named) if named else 0
        tried: set[str] = set()
        if home is not None and home in (eligible := self.router.eligible()):
            tried.update(w for w in eligible if w != home)
        hop: dict[str, str] = {}  # both hops of a disaggregated request: one request id
        prefilled: Prefilled | None = None
        if pd is not None and home is None and pd.has_prefill_hop(request.path, read):
            hop["X-Request-Id"] = request.headers.get("X-Request-Id") or f"kvbus-{uuid.uuid4()}"
        elif pd is not None:
            prefilled = Prefilled()  # one hop, to a worker that may decode
        busy = False
        while True:
            exclude = tried if pd is None else tried | pd.decode_excluded()
            # From the request's arrival, not from now.
            left = None if limit is None else limit - (time.perf_counter() - arrived)
            decision = self.router.route(
                read.tokens,
                read.lora,
                read.extra_keys,
                exclude=exclude,
                session=session,
                max_tokens=max_tokens,
                ignores_eos=ignores_eos,
                deadline=left,
            )
            self.metrics.decision.observe(time.perf_counter() - started)
            if decision is None:
                self.metrics.no_worker.inc()
                if busy:
                    return _busy("Every vLLM server that is up has all its connections busy.")
                why = "".join(f" {problem}." for problem in self.watch.problems)
                which = "that may decode " if pd is not None else ""
                return _busy(
                    f"No vLLM server {which}is available: every worker is down or silent.{why}"
                )
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s", request.headers.get("x-request-id", "-"), decision.explain())
            if decision.shed:
                return self._shed(decision, deadline, left)
            if request.path in STEPPED_PATHS:  # (n is theirs alone)
                decision.choices = read.choices
            if not tried and (decision.engine_load or not self.followers.bus_up):
                self.metrics.degraded_routes.inc()
            try:
                if pd is not None and prefilled is None:
                    prefilled = await pd.prefill(request, body.data, read, decision, hop, left)
                    if prefilled.refused is not None:
                        return prefilled.refused
                as_sent = prefilled.body if prefilled else None
                # Asked for every completion (not only one with ids made): it starts the
                # check of an engine not yet asked, or asked again after it was down.
                agrees = as_ids and self.served.ids_for(decision.worker, len(read.tokens))
                if agrees and sent is not None:
                    as_sent = sent  # (its engine's /tokenize agrees with the router's)
                answer = await self.upstream.forward(request, body, decision, as_sent, hop or None)
                if as_sent is not None and as_sent is sent:
                    self.metrics.prompts_as_ids.inc()
                return answer
            except WorkerBusy:
                tried.add(decision.worker)  # not its fault: it stays up for the others
                busy = True
                self.metrics.busy.labels(decision.worker).inc()
            except WorkerUnreachable as error:
                tried.add(decision.worker)
                self.router.mark_down(decision.worker, self.upstream.down_for)
                self.upstream.say_unreachable(decision.worker, str(error))
                if prefilled is not None and prefilled.moved:
                    # It may have read the moved KV before it failed (the prefill
                    # worker then frees it): the next decode worker gets a new hop.
                    prefilled = None
            finally:
                self.router.finished(decision)

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        session = self.upstream.session
        assert session is not None
        for worker in [*self.router.eligible(), *self.workers]:
            base = self.workers.get(RANK.sub("", worker))
            if base is None:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with asyncio.timeout(QUICK.total), self.upstream.quick_slots:
                    async with session.get(f"{base}/v1/models") as upstream:
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
        self.metrics.bus_up.set(int(self.followers.bus_up))
        self.metrics.unchained.set(self.router.index.unchained)
        self.metrics.peer_requests.set(self.router.peer_requests)
        segments = self.served.tokenizer.segments if self.served.tokenizer else None
        if segments is not None:
            self.metrics.count_segments(segments.hits, segments.misses)
        return web.Response(
            body=prom.generate_latest(self.metrics.registry),
            headers={"Content-Type": prom.CONTENT_TYPE_LATEST},
        )

    def expect_head(self, protocol: Any, timeout: float) -> None:
        """Close ``protocol``'s connection unless a whole request head arrives within
        ``timeout`` seconds (`errors` stops the clock when one has)."""
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
        own endpoint), and the set-up mistakes seen (`BusWatch.problems`)."""
        engine_load = self.router.engine_loaded()
        bus_up = self.followers.bus_up
        state = {
            "ready": self.ready,
            "kv_history": self.followers.kv_replayed,
            "load": self.followers.load_read,
            "tokenizer": self.served.tokenizer is not None,
            "tokenizer_error": self.served.tokenizer_error,
            "token_ids": self.served.ids_checked,
            "eligible": self.router.eligible(),
            "bus": "up" if bus_up else "down",
            "routing": "full" if bus_up and not engine_load else "degraded (load from engines)",
            "engine_load": engine_load,
            "problems": self.watch.problems,
        }
        return web.json_response(state, status=200 if state["ready"] else 503)
