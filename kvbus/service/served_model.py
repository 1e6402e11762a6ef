"""The model the workers serve, as the router service reads requests for it: its names
(and LoRAs) from the first worker that answers ``/v1/models``, and its tokenizer, used
the way vLLM's OpenAI server uses it, to turn a request into the token ids the router
routes by."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import json
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, NamedTuple, TypeGuard

import aiohttp

from kvbus.logs import displayable, shown
from kvbus.routing.admission import MAX_OUTPUT
from kvbus.service.prompt_ids import Agreement, EngineChecks, check_engine, ids_body
from kvbus.service.segment_tokens import (
    CACHED_BYTES,
    SEGMENTED_FROM,
    SegmentedEncoder,
    words_stay_apart,
)
from kvbus.service.upstream import QUICK, SHOWN_ERROR, Upstream
from kvbus.service.worker_names import RANK

log = logging.getLogger("kvbus.routing.router")
_INLINE_TOKENIZE_BYTES: Final = 16 * 1024
_CHECK_CONNECTIONS: Final = 2
"""Engines' /tokenize checks (``--send-token-ids``) under way at once."""
"""Bodies up to this size (~3,000 tokens, ~1.2 ms in the Rust backend) are tokenized on
the event loop. On a thread the tokenizer releases the GIL and must take it back from
the busy loop (up to its 5 ms switch interval): 1,800 tokens took 1.8 ms there against
0.7 ms in place, with the loop 30% busy. Larger ones go to the threads, so that one
huge prompt does not stall every other request for longer than that."""
_PROBES: Final = (
    "",
    "Hello, world! It's 2026: 3.14159 and 42.",
    "  two  spaces\n\ttab\r\n and trailing   ",
    "héllo wörld — 世界 🙂 naïve café",
    "w3 w17 w1023 w99999 <unk>",
)
"""Texts a tokenizer's Rust backend must encode as ``tokenizer(text)`` does before the
router uses it directly (with the model's special tokens added to them on load)."""
_TOKEN_LIMIT: Final = 2**32  # vLLM's token ids are unsigned 32-bit


class Prompt(NamedTuple):
    """What the router keys a request by: its token ids (none: routed by load alone),
    its LoRA and the extra keys vLLM hashes into its blocks."""

    tokens: list[int]
    lora: str | None = None
    extra_keys: list[tuple[str] | None] | None = None
    """vLLM's per-block extra keys beyond the LoRA's: a ``cache_salt`` goes into the
    first block's (`generate_block_hash_extra_keys`), so a salted prompt shares no
    block with the same prompt unsalted or salted otherwise."""
    max_tokens: int | None = None
    """Its output limit (None: not said; `read_max_tokens`)."""
    ignores_eos: bool = False
    """It runs to ``max_tokens`` (``ignore_eos``)."""
    choices: int = 1
    """The answers it asks for (``n``; `read_choices`)."""


LOAD_ONLY: Final = Prompt([])  # routed by load alone


def read_max_tokens(body: dict[str, Any]) -> tuple[int | None, bool]:
    """A request body's output limit (OpenAI's ``max_completion_tokens`` or
    ``max_tokens``, the Responses API's ``max_output_tokens``; None: not said or not a
    positive integer; at most `MAX_OUTPUT`) and whether it ignores EOS (vLLM's
    ``ignore_eos``: it runs to its limit)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None, False
        return min(value, MAX_OUTPUT), body.get("ignore_eos") is True
    return None, False


MAX_CHOICES: Final = 16384
"""The most choices a request's answer is counted to carry: vLLM's own limit on ``n``
(``VLLM_MAX_N_SEQUENCES``'s default)."""


def read_choices(body: dict[str, Any]) -> int:
    """How many answers a completion or chat request asks for: its ``n`` (1 when not
    said or not a positive whole number; vLLM's pydantic takes 2.0 as 2), times the
    prompts of a batched completion; at most `MAX_CHOICES`. Each step of its engine
    brings a token of each, and its usage counts all of their tokens."""
    value = body.get("n")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        value = 1
    prompt = body.get("prompt")
    if _batch(prompt):
        value *= len(prompt)  # vLLM streams each prompt's choices
    return min(value, MAX_CHOICES)


def _batch(prompt: Any) -> TypeGuard[list[Any]]:
    """Whether a completion's ``prompt`` is a batch: a list of texts or of id lists,
    not one prompt's token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


class Tokenizer:
    """The served model's tokenizer, used the way vLLM's OpenAI server uses it."""

    def __init__(self, path: str, segments_bytes: int = 0) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(path)
        self.backend: Any = _same_backend(self.hf)
        """The Rust tokenizer under ``hf`` where it encodes text as ``hf(text)`` does
        (`encode`), else None."""
        self.segments = _segmented(self.backend, self.hf, segments_bytes)
        """With ``segments_bytes`` (the router's ``--prompt-cache-mib``), where the
        backend gives the same ids in segments as whole: long texts tokenized in segments,
        those seen again kept in up to that many bytes (a shared prefix tokenized once). vLLM's
        server, which `kvbus sim` mimics, tokenizes every text whole."""
        # transformers imported torch: ~400k objects that live as long as the process.
        # Out of the collector's sight, a full collection no longer walks them all
        # (~0.3 s, a stall of every request in flight). Thawed at exit, so that they are
        # finalized as usual (triton's bindings report frozen ones as leaks).
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once, however many tokenizers load
        atexit.register(gc.unfreeze)

    def encode(self, text: str, add_special_tokens: bool, salt: Any = None) -> list[int]:
        """``text``'s token ids, as ``hf(text, add_special_tokens=...)`` gives them (as
        vLLM's server tokenizes a prompt): straight from the Rust backend without the
        offsets and the Python objects transformers builds around them, 0.7 ms instead of
        1.3 for 1,800 tokens."""
        if self.backend is None:
            return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)
        if self.segments is not None and len(text) >= SEGMENTED_FROM:
            # A salted prompt's segments are its salt's alone (`SegmentedEncoder`).
            return self.segments.encode(text, add_special_tokens, _salt(salt))
        ids: list[int] = _backend_ids(self.backend, text, add_special_tokens)
        return ids

    def completion(self, body: dict[str, Any]) -> list[int]:
        prompt = body["prompt"]
        if _batch(prompt):
            prompt = prompt[0]  # route by its first prompt
        if isinstance(prompt, list):
            tokens = [int(t) for t in prompt]
            if not all(0 <= t < _TOKEN_LIMIT for t in tokens):
                raise ValueError("not token ids vLLM could have: it says why")
            return tokens
        return self.encode(prompt, body.get("add_special_tokens", True), body.get("cache_salt"))

    def chat(self, body: dict[str, Any]) -> list[int]:
        messages = [
            {**m, "content": _text(m.get("content"))} if isinstance(m, dict) else m
            for m in body["messages"]
        ]
        return self._templated(messages, body)

    def responses(self, body: dict[str, Any]) -> list[int]:
        """A Responses API request's prompt as vLLM builds it (`construct_input_messages`):
        ``instructions`` as the system message, then ``input``, a string (one user
        message) or its message items. A ``previous_response_id``'s history is the
        engine's (the router sends such a request where that response was made)."""
        messages: list[dict[str, Any]] = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": body["instructions"]})
        given = body["input"]
        if isinstance(given, str):
            messages.append({"role": "user", "content": given})
        else:
            messages += (
                {"role": m["role"], "content": _text(m.get("content"))}
                for m in given
                if isinstance(m, dict) and m.get("type", "message") == "message"
            )
        return self._templated(messages, {"cache_salt": body.get("cache_salt")})

    def anthropic(self, body: dict[str, Any]) -> list[int]:
        """An Anthropic ``/v1/messages`` request's prompt as vLLM converts it to a chat
        (`AnthropicServingMessages.to_chat_completion_request`): the system text first
        (its blocks joined, less Claude Code's per-request billing header), then each
        message's text blocks (as chat content parts)."""
        system = body.get("system")
        blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system or []
        text = "".join(
            b.get("text") or ""
            for b in blocks
            if isinstance(b, dict)
            and b.get("type") == "text"
            and not str(b.get("text", "")).startswith("x-anthropic-billing-header")
        )
        messages = [{"role": "system", "content": text}] if text else []
        messages += (
            {"role": m["role"], "content": _text(m.get("content"))}
            for m in body["messages"]
            if isinstance(m, dict)
        )
        return self._templated(messages, {"cache_salt": body.get("cache_salt")})

    def _templated(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        text = self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tools=body.get("tools"),
            chat_template=body.get("chat_template"),
            **(body.get("chat_template_kwargs") or {}),
        )
        return self.encode(text, body.get("add_special_tokens", False), body.get("cache_salt"))


def _backend_ids(backend: Any, text: str, add_special_tokens: bool) -> Any:
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _segmented(backend: Any, hf: Any, kept_bytes: int) -> SegmentedEncoder | None:
    """A `SegmentedEncoder` of ``backend`` keeping ``kept_bytes``, where its words stay
    apart (`words_stay_apart`), no added token takes the spaces beside it (``lstrip``,
    ``rstrip``: a cut there would move a space out of it) and it `fits` (on the probe
    texts too), else None (every prompt tokenized whole)."""
    if backend is None or kept_bytes <= 0:
        return None

    def encode(texts: Sequence[str], special: bool) -> list[list[int]]:
        # One text a call: a batch is tokenized on rayon's threads, at ~1.8x the CPU
        # (18 segments of 1,800 tokens: 929 µs against 532 whole, 658 one a call).
        return [_backend_ids(backend, text, special) for text in texts]

    why = "its ids differ in segments"
    try:
        added = backend.get_added_tokens_decoder().values()
        if not words_stay_apart(backend):
            why = "a piece of its vocabulary runs over a space"
        elif any(t.lstrip or t.rstrip for t in added):
            why = "an added token takes the spaces beside it"
        else:
            segments = SegmentedEncoder(encode, cached_bytes=kept_bytes)
            if segments.fits(probe_texts(hf)):
                return segments
    except Exception as error:  # (a tokenizer that refuses a probe)
        why = f"it failed on a probe ({type(error).__name__})"
    log.info("tokenizing every prompt whole: %s", why)
    return None


def _salt(salt: Any) -> str | None:
    """A request's ``cache_salt`` as vLLM takes it (a non-empty string), else None: vLLM
    refuses any other (400), so then the key does not matter."""
    return salt if isinstance(salt, str) and salt else None


def probe_texts(hf: Any) -> list[str]:
    """`_PROBES`, and ``hf``'s special and added tokens among words: the texts a second
    tokenizer of the model's prompts (its Rust backend, an engine's) must agree on."""
    added: dict[str, int] = getattr(hf, "get_added_vocab", dict)()
    specials = " ".join(sorted({str(t) for t in [*getattr(hf, "all_special_tokens", []), *added]}))
    return [*_PROBES, specials, f"{specials} w3 {specials}"]


def _same_backend(hf: Any) -> Any:
    """``hf``'s Rust backend (`tokenizers.Tokenizer`), where it has one with
    ``encode_batch_fast`` and encodes the probe texts, with and without special tokens,
    to the ids ``hf`` gives: a tokenizer that adds its own Python-side steps (a slow
    one, one that rewrites its input) keeps going through ``hf``."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    try:
        for text in probe_texts(hf):
            for special in (True, False):
                # hf(...) first: it sets the backend as each call of it does (no
                # truncation or padding, its split_special_tokens).
                expected = list(hf(text, add_special_tokens=special).input_ids)
                if list(_backend_ids(backend, text, special)) != expected:
                    log.info("tokenizing through transformers: its backend differs")
                    return None
    except Exception:  # (a tokenizer that refuses a probe: the usual way, as before)
        return None
    return backend


def _text(content: Any) -> Any:
    """Text parts of a message joined as vLLM's 'string' content format does."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


Tokenize = Callable[[Tokenizer, dict[str, Any]], list[int]]


Read = tuple[Prompt | None, bytes | None]
"""A request's `Prompt` (None: it cannot be read), and its body with the prompt as those
token ids where it goes to the engine so (`kvbus.service.prompt_ids`)."""


class ServedModel:
    """The served model's names and tokenizer (`discover`), and a request's prompt read
    with them (`read`): in place when small, in two threads of its own when larger, by
    load alone past ``max_tokenize_bytes``."""

    def __init__(
        self,
        workers: dict[str, str],
        upstream: Upstream,
        tokenizer_path: str | None,
        max_tokenize_bytes: int,
        send_token_ids: bool = True,
        prompt_cache_bytes: int = CACHED_BYTES,
    ) -> None:
        self.workers = workers
        self.upstream = upstream
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Tokenizer | None = None
        self.tokenizer_error: str | None = None
        """Why the tokenizer did not load, and what to do (/health): requests are then
        routed by load alone."""
        self.loras: set[str] = set()
        self.models: set[str] = set()
        self.max_tokenize_bytes = max_tokenize_bytes
        self.send_token_ids = send_token_ids
        self.prompt_cache_bytes = prompt_cache_bytes
        """What the tokenizer's kept segments may take (`SegmentedEncoder`; 0: none)."""
        self.checks: EngineChecks | None = None
        """With ``--send-token-ids``, once the tokenizer is loaded: which engines'
        /tokenize agreed with it."""
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="kvbus-tokenize")

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        if self.checks is not None:
            self.checks.close()

    @property
    def ids_checked(self) -> str | None:
        """How the engines' /tokenize checks went (/health's ``token_ids``): None until
        one answered."""
        return None if self.checks is None else self.checks.summary()

    def ids_for(self, worker: str, tokens: int) -> bool:
        """Whether ``worker`` may get a prompt of ``tokens`` ids as ids (no longer than
        its engine's ``max_model_len``); its check starts where due."""
        base = self.workers.get(RANK.sub("", worker))
        return self.checks is not None and base is not None and self.checks.agrees(base, tokens)

    def forget_ids(self, worker: str) -> None:
        """``worker`` was unreachable: a restarted engine is checked again before ids."""
        base = self.workers.get(RANK.sub("", worker))
        if self.checks is not None and base is not None:
            self.checks.forget(base)

    async def read(self, raw: bytes | bytearray, tokenize: Tokenize, as_ids: bool = False) -> Read:
        """The request's `Prompt` (no tokens: routed by load alone; None when the
        request cannot be read), and with ``as_ids`` (a completion) the body to send
        instead, its prompt as token ids, where an engine may get it so (which one may:
        `ids_for`)."""
        if len(raw) > self.max_tokenize_bytes:
            return LOAD_ONLY, None
        as_ids = as_ids and self.checks is not None and self.checks.any_agree
        if len(raw) <= _INLINE_TOKENIZE_BYTES:
            return self._tokens(raw, tokenize, as_ids)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, self._tokens, raw, tokenize, as_ids)

    async def discover(self) -> None:
        """Served model names (and the tokenizer, unless given) from the first worker
        that answers."""
        session = self.upstream.session
        assert session is not None
        if self.tokenizer_path:
            await self._load_tokenizer(self.tokenizer_path, "--tokenizer")
        while True:
            for base in list(self.workers.values()):  # (found ones join meanwhile)
                root, name = None, ""
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    async with (
                        self.upstream.quick_slots,
                        session.get(f"{base}/v1/models", timeout=QUICK) as response,
                    ):
                        cards = (await response.json())["data"]
                    self.models = {c["id"] for c in cards}
                    self.loras = {c["id"] for c in cards if c.get("parent")}
                    base_card = next((c for c in cards if not c.get("parent")), None)
                    if base_card is not None:
                        name, root = base_card["id"], base_card.get("root") or base_card["id"]
                if root is None:
                    continue
                log.info("models %s", sorted(self.models))
                if self.tokenizer is None and self.tokenizer_error is None:
                    await self._load_tokenizer(root, "model")
                if self.send_token_ids and self.tokenizer is not None:
                    self._start_checks(session, name)
                return
            await asyncio.sleep(1)

    async def _load_tokenizer(self, path: str, named_by: str) -> None:
        """The tokenizer at ``path`` (named by ``--tokenizer`` or the served model's
        card); one that will not load (a model path relative to the engine's directory,
        missing files) is said once, in the log and in /health, with what to do, and
        requests are routed by load alone rather than never."""
        try:
            self.tokenizer = await asyncio.to_thread(Tokenizer, path, self.prompt_cache_bytes)
        except Exception as error:
            self.tokenizer_error = (
                f"could not load the tokenizer for {named_by} {shown(path)} "
                f"({displayable(' '.join(str(error).split()), SHOWN_ERROR)}): pass "
                "--tokenizer PATH_OR_NAME (the served model's tokenizer directory); "
                "routing by load alone until then"
            )
            log.error("%s", self.tokenizer_error)
            return
        log.info("tokenizer from %s", shown(path))

    def _start_checks(self, session: aiohttp.ClientSession, model: str) -> None:
        """``--send-token-ids``: each engine gets ids once its /tokenize gives the
        tokenizer's for the probe texts (`EngineChecks`); every known engine's check
        starts now, a later one's with its first request."""
        tokenizer = self.tokenizer
        assert tokenizer is not None
        texts = [t for t in probe_texts(tokenizer.hf) if t.strip()]  # (vLLM: no empty prompt)

        # Slots of their own, not the model lists' and load reads': an engine that takes
        # connections and never answers holds one for QUICK's timeout every RETRY_SECONDS.
        slots = asyncio.Semaphore(_CHECK_CONNECTIONS)

        async def check(base: str) -> Agreement:
            async with slots:
                return await check_engine(session, base, model, tokenizer.encode, texts, QUICK)

        self.checks = EngineChecks(check, self.workers.values)
        for base in list(self.workers.values()):
            self.checks.agrees(base)

    def _tokens(self, raw: bytes | bytearray, tokenize: Tokenize, as_ids: bool) -> Read:
        """The request's `Prompt` (None when it cannot be read) and, with ``as_ids``,
        its body with the prompt as the ids where it may go so."""
        try:
            body = json.loads(raw)
            model = body.get("model")
            if self.models and model is not None and model not in self.models:
                return None, None
            if body.get("chat_template") is not None:
                return None, None  # whether to accept one is the engine's decision
            if self.tokenizer is None:
                return LOAD_ONLY, None  # not discovered yet: load alone decides
            tokens = tokenize(self.tokenizer, body)
        except Exception:
            return None, None  # the engine says what is wrong with it
        salt = _salt(body.get("cache_salt"))
        extra: list[tuple[str] | None] | None = [(salt,)] if salt is not None else None
        lora = model if model in self.loras else None
        # (each engine's max_model_len: at the forward, EngineChecks.agrees)
        sent = ids_body(body, tokens) if as_ids and lora is None else None
        return Prompt(tokens, lora, extra, *read_max_tokens(body), read_choices(body)), sent
