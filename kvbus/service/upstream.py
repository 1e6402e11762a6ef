"""The router service's side towards the workers: a routed request forwarded to its
vLLM worker and the answer relayed to the client, streamed or not.

Bounded as the service promises (see `kvbus.service.gateway`): request bodies held at once
(`BodyBudget`), each worker's connections (``--worker-connections``, waited for at most
``--pool-timeout``), a worker's time to its first byte (``--worker-timeout``) and a
client's time to read each part of its answer (``--client-write-timeout``). A worker
that fails a request before the client got anything raises `WorkerUnreachable`, a busy
one `WorkerBusy`: the caller sends the request elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aiohttp
from aiohttp import web
from yarl import URL

from kvbus.config import redact_url
from kvbus.logs import LimitedLog, displayable
from kvbus.routing.admission import MIN_STEP
from kvbus.routing.router import Decision, Router
from kvbus.service.router_metrics import UNREPORTED, Metrics, Unreported
from kvbus.service.stream_watch import StreamWatch
from kvbus.service.worker_names import RANK

log = logging.getLogger("kvbus.routing.router")
_limited_log = LimitedLog(log)  # one line a second per configured worker
_STREAM_TAIL: Final = 8192
_HOP_BY_HOP: Final = {
    "content-length", "transfer-encoding", "connection", "keep-alive", "server", "date",
}  # fmt: skip
_FORWARDED: Final = (
    "Content-Type",
    "Authorization",
    "Accept",
    "X-Request-Id",
    "X-Api-Key",  # Anthropic clients' key (/v1/messages), which vLLM accepts too
    "Anthropic-Version",
    "Anthropic-Beta",
)
_HEAD: Final = 4096
Answered = Callable[[web.Request, Decision, int, bytes], None]
"""Told a worker's answer's status and first bytes (`Upstream.answered`)."""
QUICK: Final = aiohttp.ClientTimeout(total=5)  # a model list, not a generation
QUICK_CONNECTIONS: Final = 8
"""Model lists (``/v1/models``, discovery) in flight at once, all workers together: on
connections of their own beside ``--worker-connections``, so a flood of them never makes
a generation wait for a pooled connection."""
_GENERATING: Final = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)
"""Paths whose answers' usage counts output (`Router.answered`)."""
STEPPED_PATHS: Final = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Paths whose streams time their worker's steps: one data event a step for each
choice still generating (the Responses and Anthropic APIs' streams send several events
a step, of kinds that vary with the output)."""
MAX_HOP_ANSWER: Final = 2**20
"""Bytes of an answer the client does not see (P/D's prefill hop: one token's)."""
SHOWN_ERROR: Final = 240
"""Characters of an error's text in a log line or /health at most (a tokenizer's load
error can run to paragraphs)."""


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


class RequestBody:
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


class Upstream:
    """The workers' HTTP client: one session and connection pool for all of them, each
    address's ``--worker-connections`` apart (`forward`), and a few connections for
    model lists (`QUICK_CONNECTIONS`) and the engines' own ``/metrics``."""

    def __init__(
        self,
        workers: dict[str, str],
        router: Router,
        metrics: Metrics,
        down_for: float,
        *,
        worker_connections: int,
        worker_timeout: float,
        pool_timeout: float,
        client_write_timeout: float,
    ) -> None:
        self.workers = workers
        self.router = router
        self.metrics = metrics
        self.down_for = down_for
        self.worker_connections = worker_connections
        self.worker_timeout = worker_timeout
        self.pool_timeout = pool_timeout
        self.client_write_timeout = client_write_timeout
        self.session: aiohttp.ClientSession | None = None
        """Open from `open` (in the event loop that serves) to `close`."""
        self._slots: dict[str, asyncio.Semaphore] = {}
        """Per worker address: its --worker-connections, taken by a request for as long
        as its response lasts (then its connection is back in the pool)."""
        self.quick_slots = asyncio.Semaphore(QUICK_CONNECTIONS)
        self.answered: Answered | None = None
        """Told the start of every answer a worker gives (its first ``_HEAD`` bytes:
        a whole answer's, or a stream's first chunk's), with its status."""
        self.on_unreachable: Callable[[str], None] | None = None
        """Told each worker `say_unreachable` names (it may come back another engine)."""
        self._bases: dict[str, tuple[str, str | None, asyncio.Semaphore]] = {}

    def open(self) -> None:
        # No total timeout: a stream takes as long as it takes. Up to the first byte
        # (all of a response that is not streamed), --worker-timeout. The pool holds
        # more connections per worker than the requests that may use them at once
        # (--worker-connections for generations, QUICK_CONNECTIONS for model lists), so
        # no request ever waits in it: waiting is done, timed and counted apart
        # (--pool-timeout), never as the worker's own time.
        # No cookie jar: a worker's Set-Cookie belongs to the client it answered (which
        # gets it), and a jar would send it on every later request, any client's, to any
        # worker on that host (cookies do not tell ports apart).
        self.session = aiohttp.ClientSession(
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=self.worker_connections + QUICK_CONNECTIONS + 2
            ),  # + 2: a load read from its endpoint (`BusWatch`); its /tokenize check
            # (`prompt_ids.EngineChecks`: one an engine at a time, in slots of their own)
        )

    async def close(self) -> None:
        assert self.session is not None
        await self.session.close()

    def say_unreachable(self, worker: str, why: str) -> None:
        """One line (at most one a second per configured worker) for a worker that
        failed a request, which went to another: marked down for ``down_for``. Named
        as configured (``--worker a=URL``): its ranks share the address."""
        name = RANK.sub("", worker)
        if self.on_unreachable is not None:
            self.on_unreachable(worker)
        _limited_log.warning(
            f"unreachable {name}",  # configured names only: a bounded set of kinds
            "worker %s (%s) unreachable: %s; retrying it in %gs",
            name,
            redact_url(self.workers[name]),
            why,
            self.down_for,
        )

    async def forward(
        self,
        request: web.Request,
        body: RequestBody,
        decision: Decision,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Send the request to ``decision``'s worker (``data`` instead of its body, and
        ``headers`` over its own, when given) and relay the answer to the client."""
        assert self.session is not None
        base, rank, slots = self._worker_address(decision.worker)
        sent_headers = self._headers(request, rank, headers)
        payload = body.data if data is None else data
        labels = (decision.worker, decision.policy.value)
        await self._take(slots)
        try:
            sent = time.perf_counter()
            try:
                async with asyncio.timeout(self.worker_timeout):
                    upstream = await self.session.request(
                        request.method,
                        base + request.path_qs,
                        data=payload if payload or request.method != "GET" else None,
                        headers=sent_headers,
                    )
            except (aiohttp.ClientError, TimeoutError) as error:
                # Refused, dropped, silent or not HTTP, before anything reached the client.
                raise WorkerUnreachable(failure_text(error, self.worker_timeout)) from error
            async with upstream:
                self.metrics.ttft.labels(*labels).observe(time.perf_counter() - sent)
                content_type = upstream.headers.get("content-type", "")
                streamed = content_type.startswith("text/event-stream")
                answer: bytes | bytearray
                if streamed:
                    body.release()  # a stream is never retried
                    response, answer = await self._relay_stream(request, upstream, decision)
                else:  # all of it first: a worker that breaks off is retried elsewhere
                    # --worker-timeout covers all of it: a worker that sends its headers
                    # and stalls would hold a connection slot and the body's budget.
                    left = max(0.0, self.worker_timeout - (time.perf_counter() - sent))
                    try:
                        async with asyncio.timeout(left):
                            answer = await upstream.read()
                    except (aiohttp.ClientError, TimeoutError) as error:
                        raise WorkerUnreachable(failure_text(error, self.worker_timeout)) from error
                    body.release()
                    self.router.started(decision)
                    if self.answered is not None:
                        self.answered(request, decision, upstream.status, answer[:_HEAD])
                    response = await self._reply(request, upstream, decision, answer)
        finally:
            slots.release()
        self.metrics.requests.labels(*labels, str(upstream.status)).inc()
        if upstream.status == 200:
            self.metrics.prompt_tokens.labels(*labels).inc(decision.prompt_tokens)
            usage = usage_of(answer, streamed)
            reported = cached_in(usage)
            if reported is not None and not decision.prefilled_elsewhere:
                self.metrics.observe_prediction(decision, reported)
            tokens = output_in(usage)
            generated = request.method == "POST" and request.path in _GENERATING
            if tokens is not None and generated:
                self.router.answered(tokens / decision.choices)  # (usage counts them all)
            if streamed:
                learned = self.router.seconds_per_token(decision.worker)
                if not math.isnan(learned):
                    self.metrics.seconds_per_token.labels(decision.worker).set(learned)
        return response

    async def exchange(
        self, request: web.Request, data: bytes, decision: Decision, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """A hop the client does not see (P/D's prefill): ``data`` posted to
        ``decision``'s worker at the request's path, its status and whole answer (at most
        `MAX_HOP_ANSWER` bytes), all within ``--worker-timeout``."""
        assert self.session is not None
        base, rank, slots = self._worker_address(decision.worker)
        await self._take(slots)
        try:
            async with asyncio.timeout(self.worker_timeout):
                async with self.session.post(
                    base + request.path_qs, data=data, headers=self._headers(request, rank, headers)
                ) as upstream:
                    answer = bytearray()
                    async for chunk in upstream.content.iter_any():
                        answer += chunk
                        if len(answer) > MAX_HOP_ANSWER:
                            raise AnswerTooLarge(len(answer))
        except (aiohttp.ClientError, TimeoutError) as error:
            raise WorkerUnreachable(failure_text(error, self.worker_timeout)) from error
        finally:
            slots.release()
        if upstream.status == 200:
            self.router.started(decision)
        return upstream.status, bytes(answer)

    async def _take(self, slots: asyncio.Semaphore) -> None:
        """One of a worker's connections; `WorkerBusy` after ``--pool-timeout``."""
        if not slots.locked():
            await slots.acquire()  # at once: no timer to set and cancel
            return
        try:  # a wait for a connection is no fault of the worker's: timed apart
            async with asyncio.timeout(self.pool_timeout):
                await slots.acquire()
        except TimeoutError:
            raise WorkerBusy from None

    @staticmethod
    def _headers(
        request: web.Request, rank: str | None, given: dict[str, str] | None
    ) -> dict[str, str]:
        sent = request.headers
        headers = {k: sent[k] for k in _FORWARDED if k in sent}
        # The router reads usage from the body, and compressing on loopback or a LAN
        # costs more than it saves (a worker that compresses anyway: `_copy_headers`).
        headers["Accept-Encoding"] = "identity"
        if rank is not None:
            headers["X-data-parallel-rank"] = rank
        if given:
            headers.update(given)
        return headers

    def forget_address(self, name: str) -> None:
        """Worker ``name`` (its ranks too) moved: its address is looked up again."""
        for worker in [w for w in self._bases if RANK.sub("", w) == name]:
            del self._bases[worker]

    def _worker_address(self, worker: str) -> tuple[str, str | None, asyncio.Semaphore]:
        """A worker's (``NAME/dpR``) base URL, data-parallel rank and connection slots
        (one set per address, as aiohttp pools connections), remembered."""
        known = self._bases.get(worker)
        if known is None:
            rank = RANK.search(worker)
            base = self.workers[RANK.sub("", worker)]
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
        response.headers["x-kvbus-kv-seq"] = str(decision.kv_seq)

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
            self._stalled(decision)
        except ConnectionError:  # it left
            pass
        _drop(request)
        return False

    def _stalled(self, decision: Decision) -> None:
        self.metrics.stalled_clients.inc()
        log.info("a client of %s stopped reading; dropped", decision.worker)

    async def _relay_stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, decision: Decision
    ) -> tuple[web.StreamResponse, bytearray]:
        """Pass a streamed response on chunk by chunk; returns its tail (the usage). The
        gaps between a completion's chunks time its worker's steps (`_step`). A
        worker silent for --worker-timeout has stalled (not one still generating: tokens
        come every few milliseconds to seconds); a client that reads nothing for
        --client-write-timeout is dropped (`StreamWatch`)."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        self._copy_headers(upstream, response, decision)
        await response.prepare(request)
        watch = StreamWatch(
            self.worker_timeout,
            self.client_write_timeout,
            upstream.content,
            request.transport,
            lambda: self._stalled(decision),
        )
        tail = bytearray()
        timed = request.path in STEPPED_PATHS
        came = ready = 0.0  # when the latest chunk came, and when it was written
        chunks = 0
        # A Responses API stream's preamble comes before the prefill (`ResponsesOpening`).
        opening = ResponsesOpening() if request.path == "/v1/responses" else None
        began = False
        live = decision.choices  # its choices still generating (`_step`)
        try:
            while True:
                watch.reading()
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as error:
                    # The client has part of a stream: cut it off, as the worker did.
                    self.router.mark_down(decision.worker, self.down_for)
                    self.say_unreachable(
                        decision.worker,
                        f"broke off a stream ({failure_text(error, self.worker_timeout)})",
                    )
                    if request.transport is not None:
                        request.transport.close()
                    return response, bytearray()
                if not chunk:
                    break
                chunks += 1
                if not tail and self.answered is not None:  # the first bytes
                    self.answered(request, decision, upstream.status, bytes(chunk[:_HEAD]))
                if not began:
                    began = opening is None or opening.passed(chunk)
                    if began:  # the engine is past this prompt's prefill
                        self.router.started(decision)
                if timed:
                    now = time.perf_counter()
                    # Not the first gap (a server may send a chat's role before the
                    # prefill; vLLM does not), nor one that came within MIN_STEP of the
                    # last one's write: the same step's (its usage and [DONE]), or one
                    # that waited on the client's reading, not on the engine's step.
                    if chunks > 2 and now - ready >= MIN_STEP:
                        self._step(decision, now - came, chunk, live)
                    if live > 1:  # choices that finished send no more events
                        live = max(1, live - _finished(chunk))
                    came = now
                watch.writing()
                try:
                    await response.write(chunk)
                    left = watch.stalled is not None  # dropped by `watch`
                except ConnectionError:  # it left, or `watch` dropped it
                    left = True
                if left:  # (a stalled one is counted already)
                    _drop(request)
                    return response, bytearray()
                tail += chunk
                del tail[: max(0, len(tail) - _STREAM_TAIL)]  # usage rides on the last event
                if timed:
                    ready = time.perf_counter()
        finally:
            watch.close()
        await self._send(request, response.write_eof(), decision)
        return response, tail

    def _step(self, decision: Decision, seconds: float, chunk: bytes, live: int) -> None:
        """``chunk`` of ``decision``'s stream came ``seconds`` after the one before: that
        long per step in it (several: steps the relay read at once; a step brings an
        event for each of the ``live`` choices still generating). Not counted: ``[DONE]``
        and the usage event (no choices), which vLLM sends with the last token; a chunk
        of nothing else is no step."""
        events = chunk.count(b"data:") - chunk.count(b"data: [DONE]")
        events -= chunk.count(b'"choices":[]') + chunk.count(b'"choices": []')
        if events > 0:
            self.router.stepped(decision, seconds / max(1.0, events / live))


class ResponsesOpening:
    """Where a Responses API stream passes its preamble: `response.created` and
    `response.in_progress`, sent on accepting the request (vLLM's
    ``responses/serving.py``), before any step. Its first other event comes with the
    first output (every other stream's first bytes do: a chat's role chunk too, as vLLM
    sends it). Fed the chunks as read, split anywhere: an event line cut in two is
    judged whole, with the next chunk."""

    PREAMBLE: Final = (b"\nevent: response.created\n", b"\nevent: response.in_progress\n")
    KEPT: Final = 64
    """Bytes of an unfinished line kept for the next chunk: an event line's name."""

    def __init__(self) -> None:
        self.evented = False
        """An ``event:`` line came (a server may name no events: then its first data)."""
        self.partial = b"\n"
        """The unfinished last line so far (its start), after the newline before it."""

    def passed(self, chunk: bytes) -> bool:
        text = self.partial + chunk
        cut = text.rfind(b"\n")
        lines = text[: cut + 1]  # whole lines, each after a newline
        self.partial = b"\n" + text[cut + 1 : cut + 1 + self.KEPT]
        events = lines.count(b"\nevent:")
        if events:
            self.evented = True
            return events > sum(lines.count(kind) for kind in self.PREAMBLE)
        return not self.evented and b"\ndata:" in lines


def _finished(chunk: bytes) -> int:
    """Choices that ``chunk`` of a completion or chat stream ends (a finish reason)."""
    return chunk.count(b'"finish_reason":"') + chunk.count(b'"finish_reason": "')


def _drop(request: web.Request) -> None:
    """The client's connection goes at once: it left, or reads nothing."""
    if request.transport is not None:
        request.transport.abort()  # close() would wait to flush to it


class WorkerUnreachable(Exception):
    """The worker refused or dropped the connection before answering (safe to retry);
    its text says how, in a few words (`failure_text`)."""


_CONNECTION_ERRORS: Final = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
}


def failure_text(error: BaseException, worker_timeout: float) -> str:
    """How a request to a worker failed, in a few words for a log line ("connection
    refused"), not the client library's repr."""
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "no connection in time"
    if isinstance(error, TimeoutError):  # --worker-timeout (aiohttp's read timeouts too)
        return f"no answer within {worker_timeout:g}s"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "it closed the connection without answering"
    if isinstance(error, aiohttp.ClientResponseError):  # it answered, but not in HTTP
        return f"not an HTTP answer ({displayable(error.message, SHOWN_ERROR)})"
    cause = error.os_error if isinstance(error, aiohttp.ClientConnectorError) else error
    if isinstance(cause, socket.gaierror):
        return f"host not found ({cause.strerror})"
    if isinstance(cause, OSError) and cause.errno in _CONNECTION_ERRORS:
        return _CONNECTION_ERRORS[cause.errno]
    text = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(error)
    return displayable(" ".join(text.split()) or type(error).__name__, SHOWN_ERROR)


class AnswerTooLarge(Exception):
    """A hop the client does not see got an answer over `MAX_HOP_ANSWER` bytes (a
    request asking for much more than one token's answer; not the worker's fault)."""


class WorkerBusy(Exception):
    """All of a worker's connections stayed in use for ``--pool-timeout`` (safe to send
    elsewhere; the worker is not at fault)."""


def usage_of(body: bytes | bytearray, streamed: bool) -> dict[str, Any] | None:
    """A response's ``usage`` (a stream's is in its last data event, sent with
    ``stream_options.include_usage``; the Responses API's in its ``response.completed``
    event); None: none."""
    if streamed:
        events = [line[6:] for line in body.splitlines() if line.startswith(b"data: {")]
        body = events[-1] if events else b""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        answer = json.loads(body)
        usage = answer.get("usage") or (answer.get("response") or {}).get("usage")
        return usage if isinstance(usage, dict) else None
    return None


def cached_tokens(body: bytes | bytearray, streamed: bool) -> int | Unreported | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a response (`usage_of`); the
    Responses API's ``input_tokens_details.cached_tokens``, the Anthropic API's
    ``cache_read_input_tokens``; `UNREPORTED`: usage without it; None: no usage."""
    return cached_in(usage_of(body, streamed))


def cached_in(usage: dict[str, Any] | None) -> int | Unreported | None:
    """`cached_tokens` of a response's usage."""
    if usage is None:
        return None
    # (OverflowError: json reads Infinity, and int() of it raises that.)
    with contextlib.suppress(ValueError, TypeError, AttributeError, OverflowError):
        if usage.get("cache_read_input_tokens") is not None:
            return int(usage["cache_read_input_tokens"])
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        cached = None if details is None else details.get("cached_tokens")
        return UNREPORTED if cached is None else int(cached)
    return None


def output_in(usage: dict[str, Any] | None) -> int | None:
    """Output tokens of a response's usage (``completion_tokens``; the Responses and
    Anthropic APIs' ``output_tokens``); None: not said."""
    if usage is None:
        return None
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
