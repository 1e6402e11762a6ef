"""``kvbus router --send-token-ids``: a completion's text prompt sent on to its engine as the
token ids the router computed to route it, so that the engine does not tokenize it a
second time (as Dynamo's frontend hands its workers token ids). vLLM's API server
tokenizes each text prompt itself, 1.4-1.6 ms of its CPU for 1,800 tokens of a small
vocabulary (``bench/bench_prompt_ids.py``) and more for a real model's.

The ids are sent only where the engine's answer cannot tell them from the text:

- once an engine's own ``/tokenize`` gave the router's ids for every probe text
  (`kvbus.service.served_model.probe_texts`: the model's special and added tokens among
  them), with and without special tokens (a
  router given another tokenizer than the engines' would otherwise change what they
  compute, not only where it runs); the router assumes, as it does for routing, that
  every worker serves that one model;
- for one text prompt on ``/v1/completions`` (a batch, ids or embeddings go as sent),
  without ``echo`` (which answers with the prompt's text), ``suffix`` (rendered only
  around a text prompt), ``truncate_prompt_tokens`` (left to vLLM's own reading of it)
  or a LoRA (which may bring its own tokenizer), and no longer than the engine's
  ``max_model_len`` (its refusal of a longer prompt words the count differently).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import aiohttp
import msgspec

_KEPT_AS_TEXT: Final = ("echo", "suffix", "truncate_prompt_tokens")
"""Fields that make a prompt go as sent when given (not null, not false)."""


def ids_body(body: dict[str, Any], tokens: list[int], max_model_len: int | None) -> bytes | None:
    """``body`` with its text prompt replaced by ``tokens``, or None where it must go as
    the client sent it. Every other field keeps its value as Python's json read it (a
    NaN stays NaN, a lone surrogate stays escaped: the engine reads what it would
    have); only the ids, most of the bytes, go through msgspec (~10 µs for 1,800 ids
    against ~160 µs in json)."""
    if not isinstance(body.get("prompt"), str) or not tokens:
        return None
    if max_model_len is not None and len(tokens) > max_model_len:
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
