"""``kvbus router --send-token-ids`` (on by default): a completion's text prompt sent on to
its engine as the token ids the router computed to route it, so that the engine does
not tokenize it a second time (as Dynamo's frontend hands its workers token ids). vLLM's
API server tokenizes each text prompt itself, 1.4-1.6 ms of its CPU for 1,800 tokens of
a small vocabulary (``bench/bench_prompt_ids.py``) and more for a real model's.

The ids are sent only where the engine's answer cannot tell them from the text:

- to an engine whose own ``/tokenize`` gave the router's ids for every probe text
  (`kvbus.service.served_model.probe_texts`: the model's special and added tokens among
  them), with and without special tokens (a router given another tokenizer than the
  engines' would otherwise change what they compute, not only where it runs), checked
  per engine (`EngineChecks`): before its first, every `RECHECK_SECONDS`, and after
  it was unreachable;
- for one text prompt on ``/v1/completions`` (a batch, ids or embeddings go as sent),
  without ``echo`` (which answers with the prompt's text), ``suffix`` (rendered only
  around a text prompt), ``truncate_prompt_tokens`` (left to vLLM's own reading of it)
  or a LoRA (which may bring its own tokenizer), and no longer than the engine's
  ``max_model_len`` (its refusal of a longer prompt words the count differently).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, NamedTuple

import aiohttp
import msgspec

from kvbus.config import redact_url
from kvbus.logs import LimitedLog, displayable, shown
from kvbus.service.upstream import SHOWN_ERROR

log = logging.getLogger(__name__)
_limited_log = LimitedLog(log, 60.0)

_KEPT_AS_TEXT: Final = ("echo", "suffix", "truncate_prompt_tokens")
"""Fields that make a prompt go as sent when given (not null, not false)."""


def ids_body(body: dict[str, Any], tokens: list[int]) -> bytes | None:
    """``body`` with its text prompt replaced by ``tokens``, or None where it must go as
    the client sent it. Every other field keeps its value as Python's json read it (a
    NaN stays NaN, a lone surrogate stays escaped: the engine reads what it would
    have); only the ids, most of the bytes, go through msgspec (~10 µs for 1,800 ids
    against ~160 µs in json)."""
    if not isinstance(body.get("prompt"), str) or not tokens:
        return None
    for field in _KEPT_AS_TEXT:
        value = body.get(field)
        if value is not None and value is not False:  # (0 is given: not False)
            return None
    others = json.dumps({k: v for k, v in body.items() if k != "prompt"}).encode()
    ids = msgspec.json.encode(tokens)
    if others == b"{}":
        return b'{"prompt":' + ids + b"}"
    return b'{"prompt":' + ids + b"," + others[1:]


class Agreement(NamedTuple):
    """What an engine's ``/tokenize`` said of the router's tokenizer."""

    why_not: str | None
    """None: the same ids for every probe; else how they differed."""
    max_model_len: int | None = None


async def check_engine(
    session: aiohttp.ClientSession,
    base: str,
    model: str,
    encode: Callable[[str, bool], list[int]],
    texts: list[str],
    timeout: aiohttp.ClientTimeout,
) -> Agreement:
    """Whether the engine at ``base`` tokenizes ``texts`` as ``encode`` does, with and
    without special tokens. Raises `aiohttp.ClientError` or `TimeoutError` where it
    could not be asked (try again later); a refusal or another answer is a `why_not`."""
    max_model_len: int | None = None
    for text in texts:
        for special in (True, False):
            request = {"model": model, "prompt": text, "add_special_tokens": special}
            async with session.post(f"{base}/tokenize", json=request, timeout=timeout) as answer:
                if answer.status != 200:
                    return Agreement(f"its /tokenize answered {answer.status}")
                try:
                    said = await answer.json(content_type=None)
                except ValueError:
                    return Agreement("its /tokenize did not answer JSON")
            if not isinstance(said, dict) or said.get("tokens") != encode(text, special):
                return Agreement(f"its /tokenize gave other ids for {text[:80]!r}")
            length = said.get("max_model_len")
            max_model_len = length if type(length) is int and length > 0 else None
    return Agreement(None, max_model_len)


RECHECK_SECONDS: Final = 300.0
"""How long an engine's agreement holds before its /tokenize is asked again (an engine
restarted on its URL may serve another tokenizer); it keeps getting ids meanwhile."""
RETRY_SECONDS: Final = 2.0
"""How long after an engine did not answer its check it is asked again."""

Check = Callable[[str], Awaitable[Agreement]]
"""Asks the engine at a base URL (`check_engine` bound to the router's session and
tokenizer); raises `aiohttp.ClientError` or `TimeoutError` where it could not be asked."""


class EngineChecks:
    """Which engines may get prompts as token ids: each engine's own ``/tokenize`` is
    checked before its first (until then, and while it does not answer, it gets text),
    again every `RECHECK_SECONDS`, and again after it was unreachable (`forget`). A
    check runs in a task of its own, started by the first `agrees` that needs it; no
    request waits for one. Engines are named by base URL; ``bases`` gives the ones the
    router still routes to (those a worker moved away from are dropped: their number
    stays that of the workers)."""

    def __init__(
        self,
        check: Check,
        bases: Callable[[], Iterable[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._bases = bases
        self._clock = clock
        self._said: dict[str, tuple[Agreement, float]] = {}
        """Base URL -> its last answer and when it came."""
        self._retry_at: dict[str, float] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def agrees(self, base: str, tokens: int = 0) -> bool:
        """Whether the engine at ``base`` may get a prompt of ``tokens`` ids now (no
        longer than the ``max_model_len`` it told); starts its check where due."""
        said = self._said.get(base)
        now = self._clock()
        due = said is None or now - said[1] >= RECHECK_SECONDS
        if due and now >= self._retry_at.get(base, -math.inf):
            self._start(base)
        if said is None or said[0].why_not is not None:
            return False
        length = said[0].max_model_len
        return length is None or tokens <= length

    def forget(self, base: str) -> None:
        """The engine at ``base`` was unreachable: it gets text until checked again (a
        check of it under way is dropped: its answers may be the old engine's)."""
        self._said.pop(base, None)
        self._retry_at.pop(base, None)
        running = self._running.pop(base, None)
        if running is not None:
            running.cancel()

    @property
    def any_agree(self) -> bool:
        return any(said.why_not is None for said, _ in self._said.values())

    def summary(self) -> str | None:
        """How the checks went (/health's ``token_ids``): None before any answered."""
        if not self._said:
            return None
        refused = {base: s.why_not for base, (s, _) in self._said.items() if s.why_not}
        if not refused:
            engines = len(self._said)
            return f"sent as token ids ({engines} engine{'s' if engines > 1 else ''} checked)"
        base, why = next(iter(refused.items()))
        why = displayable(why, SHOWN_ERROR)
        if len(refused) == len(self._said):
            return f"sent as text: {why}"
        return (
            f"sent as token ids to {len(self._said) - len(refused)} of {len(self._said)} "
            f"engines checked; as text to {len(refused)}, {_url(base)}: {why}"
        )

    def _start(self, base: str) -> None:
        if base in self._running or self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._run(base))
        self._running[base] = task

        def done(finished: asyncio.Task[None]) -> None:
            if self._running.get(base) is finished:  # (not a later check's, after forget)
                del self._running[base]

        task.add_done_callback(done)

    async def _run(self, base: str) -> None:
        try:
            said = await self._check(base)
        except Exception as error:  # (unreachable; or anything else: asked again later)
            self._retry_at[base] = self._clock() + RETRY_SECONDS
            self._prune()
            if not isinstance(error, aiohttp.ClientError | TimeoutError):
                _limited_log.warning(
                    "check failed",  # one kind: a line a minute, whichever engine
                    "--send-token-ids: the check of %s failed: %s",
                    _url(base),
                    displayable(repr(error), SHOWN_ERROR),
                )
            return
        before = self._said.get(base)
        self._said[base] = (said, self._clock())
        self._prune()
        if before is not None and before[0].why_not == said.why_not:
            return
        if said.why_not is None:
            log.info("--send-token-ids: completions' prompts go to %s as token ids", _url(base))
        else:
            log.warning(
                "--send-token-ids: prompts go to %s as text, it does not tokenize as the "
                "router's tokenizer does: %s",
                _url(base),
                displayable(said.why_not, SHOWN_ERROR),
            )

    def _prune(self) -> None:
        """Forget the engines no worker is at any more (a worker found on the bus that
        moved): what is kept stays as many as the workers."""
        live = set(self._bases())
        for gone in [b for b in self._said if b not in live]:
            del self._said[gone]
        for gone in [b for b in self._retry_at if b not in live]:
            del self._retry_at[gone]

    def close(self) -> None:
        """Cancel the checks under way; none starts after."""
        self._closed = True
        for task in list(self._running.values()):
            task.cancel()


def _url(base: str) -> str:
    """An engine's base URL as logs and /health show it: its password blanked."""
    return shown(redact_url(base))
