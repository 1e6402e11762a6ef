"""A simulated engine's HTTP server: the parts of vLLM's OpenAI API that clients and
routers call, with vLLM's request and response shapes and error bodies.

Served: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not; ``n``;
``usage.prompt_tokens_details.cached_tokens``, as ``--enable-prompt-tokens-details``
gives it), ``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``,
``/reset_prefix_cache`` (vLLM serves it in dev mode), and ``/v1/completions/render`` and
``/v1/chat/completions/render`` (the prompt's token ids, where vllm-router reads them)
as a server with ``--enable-scale-out`` serves them, or answering 403 as one without it
does (vllm-router then routes with no prefix at all). Simulation only:
``POST /sim/restart`` (the engine's process restarts) and ``GET /sim/state``.
Prompts are tokenized as vLLM's server does (`kvbus.service.served_model.Tokenizer`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.sampling_params import SamplingParams

from kvbus.service.handlers import error_body
from kvbus.service.served_model import Tokenizer
from kvbus.sim.engine import EngineStopped, RequestStream, SimEngine

MAX_N: Final = 64
"""The most choices one request may ask for (each is a request of the engine)."""
MAX_BODY: Final = 64 * 1024 * 1024


def _bad_request(message: str) -> web.Response:
    return error_body(message, "BadRequestError", 400)


class _Invalid(Exception):
    pass


@dataclass(frozen=True)
class _Parsed:
    """What a generation request asks of the engine."""

    prompt: list[int]
    max_tokens: int
    n: int
    salt: str | None


def _int_field(body: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None and default is None:
        return high
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _Invalid(f"{name}={value!r}: an integer in [{low}, {high}]")
    return value


class EngineAPI:
    """The HTTP front end of one `SimEngine`."""

    def __init__(
        self, engine: SimEngine, tokenizer: Tokenizer, model_dir: str, scale_out: bool = False
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.scale_out = scale_out
        self.max_model_len = int(engine.config.model_config.max_model_len)
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/v1/completions/render", self.render_completion)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        app.router.add_post("/sim/restart", self.restart)
        app.router.add_get("/sim/state", self.state)
        return app

    # --- generation ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body, parsed = await self._parse(request, chat)
        except (_Invalid, ValueError, KeyError, TypeError) as error:
            return _bad_request(str(error))
        sampling = SamplingParams(max_tokens=parsed.max_tokens, ignore_eos=True, detokenize=False)
        streams = [
            self.engine.submit(parsed.prompt, sampling, parsed.salt) for _ in range(parsed.n)
        ]
        reply = _Reply(self, body, chat, streams)
        try:
            if body.get("stream"):
                return await reply.stream(request)
            return await reply.whole()
        except EngineStopped as stopped:
            return error_body(str(stopped), "InternalServerError", 500)
        finally:
            for stream in streams:
                if not stream.done:
                    self.engine.cancel(stream)

    async def _parse(self, request: web.Request, chat: bool) -> tuple[dict[str, Any], _Parsed]:
        """The request's body and what the engine takes from it; raises on what vLLM's
        server answers 400."""
        body = await request.json()
        if not isinstance(body, dict):
            raise _Invalid("the body must be a JSON object")
        prompt = self._prompt(body, chat)
        room = self.max_model_len - len(prompt)
        default = room if chat else 16
        if room < 1:
            raise _Invalid(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {len(prompt)} input tokens."
            )
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = _int_field(body, key, default, 1, room)
        n = _int_field(body, "n", 1, 1, MAX_N)
        salt = body.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and salt):
            raise _Invalid("cache_salt must be a non-empty string")
        return body, _Parsed(prompt, max_tokens, n, salt)

    def _prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise _Invalid("messages: a non-empty list")
            return self.tokenizer.chat(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            body = {**body, "prompt": prompt[0]}
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(type(t) is int and 0 <= t < 2**32 for t in prompt):
                raise _Invalid("prompt: a string, or a non-empty list of token ids")
            return list(prompt)
        if not isinstance(prompt, str) or not prompt:
            raise _Invalid("prompt: a non-empty string or list of token ids (one prompt)")
        return self.tokenizer.completion(body)

    def text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.hf.decode(tokens, skip_special_tokens=True))

    # --- the rest of the API -------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.engine.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model_dir,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        running, waiting = self.engine.load
        self.engine.metrics.running.set(running)
        self.engine.metrics.waiting.set(waiting)
        return web.Response(
            body=self.engine.metrics.exposition(),
            content_type="text/plain",
            charset="utf-8",
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            chat = isinstance(body, dict) and "messages" in body
            tokens = self._prompt(body, chat)
        except (_Invalid, ValueError, KeyError, TypeError) as error:
            return _bad_request(str(error))
        reply = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        return web.json_response({**reply, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            tokens = (await request.json())["tokens"]
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise _Invalid("tokens: a list of token ids")
        except (_Invalid, ValueError, KeyError, TypeError) as error:
            return _bad_request(str(error))
        return web.json_response({"prompt": self.text(tokens)})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """As vLLM 0.32 answers it: ``{"success": false}`` while requests hold blocks,
        unless ``?reset_running_requests=true`` preempts them (they recompute)."""
        running = request.query.get("reset_running_requests", "false").lower()
        if running not in ("true", "false", "1", "0"):
            return _bad_request("reset_running_requests: true or false")
        done = await self.engine.reset_prefix_cache(running in ("true", "1"))
        return web.json_response({"success": done})

    async def render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        """The request as the engine would take it (vLLM's ``GenerateRequest``: a list
        of one for completions, one for chat), with ``--enable-scale-out``; without it,
        403 as vLLM answers."""
        if not self.scale_out:
            message = (
                "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them."
            )
            return error_body(message, "PermissionDeniedError", 403)
        try:
            body, parsed = await self._parse(request, chat)
            sampling = SamplingParams(
                max_tokens=parsed.max_tokens, ignore_eos=bool(body.get("ignore_eos"))
            )
            rendered = GenerateRequest(  # pydantic's ValidationError is a ValueError
                request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                token_ids=parsed.prompt,
                sampling_params=sampling,
                model=body.get("model"),
                stream=bool(body.get("stream")),
                stream_options=body.get("stream_options") if body.get("stream") else None,
                cache_salt=parsed.salt,
                priority=body.get("priority") or 0,
            ).model_dump()
        except (_Invalid, ValueError, KeyError, TypeError) as error:
            return _bad_request(str(error))
        return web.json_response(rendered if chat else [rendered])

    async def restart(self, request: web.Request) -> web.Response:
        await self.engine.restart()
        return web.json_response({"restarts": self.engine.restarts})

    async def state(self, request: web.Request) -> web.Response:
        running, waiting = self.engine.load
        limits = self.engine.config.scheduler_config
        return web.json_response(
            {
                "name": self.engine.name,
                "running": running,
                "waiting": waiting,
                "steps": self.engine.steps,
                "step_seconds": self.engine.step_seconds,
                "slowdown": self.engine.timing.slowdown,
                "restarts": self.engine.restarts,
                "kv_blocks": self.engine.core.num_blocks,
                "max_num_seqs": limits.max_num_seqs,
                "max_num_batched_tokens": limits.max_num_batched_tokens,
            }
        )


class _Reply:
    """The answer to one generation request, whole or as server-sent events."""

    def __init__(
        self, api: EngineAPI, body: dict[str, Any], chat: bool, streams: list[RequestStream]
    ) -> None:
        self.api = api
        self.chat = chat
        self.streams = streams
        # The engine's name in the id (``cmpl-sim-3-<hex>``): a router in front that adds
        # no header of its own still shows, through its answers, where it sent each request.
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{api.engine.name}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = body.get("model") or api.engine.model_name
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

    def usage(self) -> dict[str, Any]:
        prompt = self.streams[0].prompt_tokens
        completion = sum(len(s.tokens) for s in self.streams)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": self.streams[0].cached_tokens},
        }

    async def _updates(self) -> AsyncIterator[None]:
        """Yields each time a stream changed, until all are done."""
        while True:
            for stream in self.streams:
                if stream.error is not None:
                    raise stream.error
            if all(s.done for s in self.streams):
                return
            waiting = next(s for s in self.streams if not s.done)
            await waiting.changed.wait()
            waiting.changed.clear()
            yield

    async def whole(self) -> web.Response:
        async for _ in self._updates():
            pass
        choices = []
        for index, stream in enumerate(self.streams):
            text = self.api.text(stream.tokens)
            choice: dict[str, Any] = {"index": index, "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append({**choice, "finish_reason": stream.finish_reason, "stop_reason": None})
        return web.json_response(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": self.usage(),
            }
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        texts = [_Detokenizer(self.api.text) for _ in self.streams]
        finished = [False] * len(self.streams)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        # vLLM sends a chat answer's role chunks with its first output, after the
        # prefill, not on accepting the request: the time to the first chunk is the
        # time to the first token, as routers and clients measure it.
        roles_sent = not self.chat
        try:
            async for _ in self._updates():
                if not roles_sent:
                    roles_sent = True
                    for index in range(len(self.streams)):
                        role = {"delta": {"role": "assistant", "content": ""}}
                        await self._event(response, kind, index, {**role, "finish_reason": None})
                for index, stream in enumerate(self.streams):
                    fresh = texts[index].read < len(stream.tokens)
                    if finished[index] or not (fresh or stream.done):
                        continue
                    delta = texts[index].delta(stream.tokens)
                    finished[index] = stream.done
                    part: dict[str, Any] = (
                        {"delta": {"content": delta}} if self.chat else {"text": delta}
                    )
                    part["finish_reason"] = stream.finish_reason
                    await self._event(response, kind, index, part)
            if self.include_usage:
                usage = {**self._head(kind), "choices": [], "usage": self.usage()}
                await self._write(response, usage)
        except EngineStopped as stopped:
            error = {"message": str(stopped), "type": "InternalServerError", "param": None}
            await self._write(response, {"error": {**error, "code": 500}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    async def _event(
        self, response: web.StreamResponse, kind: str, index: int, part: dict[str, Any]
    ) -> None:
        choice = {"index": index, "logprobs": None, **part}
        await self._write(response, {**self._head(kind), "choices": [choice]})

    async def _write(self, response: web.StreamResponse, chunk: dict[str, Any]) -> None:
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


class _Detokenizer:
    """A stream's text, decoded a few tokens at a time (as vLLM's incremental
    detokenizer does): each step decodes a short window, not the whole output again,
    and holds back a piece that ends in a partial character."""

    _CONTEXT: Final = 4
    """Tokens decoded before the new ones, so that word joins come out as in the whole."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.prefix = 0
        self.read = 0

    def delta(self, tokens: list[int]) -> str:
        before = self.decode(tokens[self.prefix : self.read])
        after = self.decode(tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing whole yet: sent with a later token
        self.prefix = max(self.prefix, len(tokens) - self._CONTEXT)
        self.read = len(tokens)
        return after[len(before) :]
