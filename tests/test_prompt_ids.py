"""``kvbus router --send-token-ids``: a completion's text prompt goes on to its engine as
the token ids the router routed it by, once the engine's /tokenize agrees with the
router's tokenizer, and only where the answer cannot tell. The body's rewriting is
checked alone; what a worker receives, through the router (in this process, on a
memory:// bus) in front of scripted workers. That a real vLLM engine answers the ids as
it answers the text is in ``test_router_e2e.py``."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvbus.service.prompt_ids import ids_body
from kvbus.service.served_model import Tokenizer

from .test_gateway_limits import Fleet, complete
from .test_gateway_limits import fleet as fleet  # the fixtures
from .test_gateway_limits import tokenizer as tokenizer

USAGE = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_text_prompt_becomes_its_ids_and_every_other_field_keeps_its_value() -> None:
    raw = '{"model":"m","prompt":"w5 w6","temperature":NaN,"user":"café 🙂 \\ud83d","n":2}'
    body = json.loads(raw)
    sent = ids_body(body, [5, 6], None)
    assert sent is not None
    got = json.loads(sent)
    assert got.pop("prompt") == [5, 6]
    assert math.isnan(got.pop("temperature"))  # as the client sent it, not null
    assert got == {"model": "m", "user": "café 🙂 \ud83d", "n": 2}  # a lone surrogate too
    assert json.loads(ids_body({"prompt": "w5"}, [5], 1) or b"") == {"prompt": [5]}


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "w5", "echo": True},  # answers with the prompt's text
        {"prompt": "w5", "suffix": "w9"},  # rendered around a text prompt only
        {"prompt": "w5", "truncate_prompt_tokens": 1},
        {"prompt": "w5", "truncate_prompt_tokens": 0},
        {"prompt": ["w5", "w6"]},  # a batch
        {"prompt": [5, 6]},  # ids already
        {"prompt_embeds": "AAAA"},
    ],
)
def test_a_prompt_the_answer_would_tell_apart_goes_as_sent(body: dict[str, Any]) -> None:
    assert ids_body(body, [5, 6], None) is None


def test_no_ids_or_too_many_no_rewrite() -> None:
    assert ids_body({"prompt": ""}, [], None) is None
    # The engine's refusal of a prompt over its max_model_len words the count its way.
    assert ids_body({"prompt": "w5 w6 w7"}, [5, 6, 7], 2) is None
    assert ids_body({"prompt": "w5 w6", "echo": False}, [5, 6], 2) is not None


async def worker_tokenizing(
    fleet: Fleet,
    tokenizer: Path,
    seen: list[dict[str, Any]],
    off_by: int = 0,
    max_model_len: int | None = None,
) -> None:
    """A worker whose /tokenize answers as the router's tokenizer does (or ``off_by``
    added to each id), keeping every completion's body in ``seen``."""
    ours = Tokenizer(str(tokenizer))

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        ids = ours.encode(body["prompt"], body.get("add_special_tokens", True))
        answer = {"count": len(ids), "tokens": [i + off_by for i in ids]}
        return web.json_response(answer | {"max_model_len": max_model_len})

    async def generate(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        return web.json_response({"id": "cmpl-1", "choices": [], "usage": USAGE})

    await fleet.worker("a", generate, tokenize)


async def checked(fleet: Fleet) -> str:
    """How the router's check of the engine's /tokenize went, once it is done (it runs
    beside /health's ready)."""
    assert fleet.app is not None
    for _ in range(200):
        if fleet.app.served.ids_checked is not None:
            return fleet.app.served.ids_checked
        await asyncio.sleep(0.05)
    raise AssertionError("the router never checked the engine's /tokenize")


async def test_the_engine_gets_the_ids_the_router_routed_by(fleet: Fleet, tokenizer: Path) -> None:
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen, max_model_len=4)
    await fleet.run_router(tokenizer, send_token_ids=True)
    assert await checked(fleet) == "sent as token ids"
    assert fleet.app is not None
    text = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1, "stream": False}
    kept = [
        text | {"echo": True},
        text | {"prompt": ["w5 w6", "w7"]},
        text | {"prompt": [5, 6, 7]},
        text | {"prompt": "w5 w6 w7 w8 w9"},  # over the engine's max_model_len
    ]
    for body in [text, *kept]:
        status, answer, _ = await complete(fleet, body)
        assert status == 200, answer
    assert seen[0] == text | {"prompt": [5, 6, 7, 8]}
    assert seen[1:] == kept  # as sent
    assert fleet.app.metrics.prompts_as_ids._value.get() == 1


async def test_an_engine_that_tokenizes_otherwise_gets_text(fleet: Fleet, tokenizer: Path) -> None:
    """A router given another tokenizer than the engines' would change what they compute:
    the engine's /tokenize disagreeing on a probe, prompts go as text."""
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen, off_by=1)
    await fleet.run_router(tokenizer, send_token_ids=True)
    assert (await checked(fleet)).startswith("sent as text: its /tokenize gave other ids")
    body = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1}
    assert (await complete(fleet, body))[0] == 200
    assert seen == [body]


async def test_without_the_option_prompts_go_as_text(fleet: Fleet, tokenizer: Path) -> None:
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen)
    await fleet.run_router(tokenizer)
    body = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1}
    assert (await complete(fleet, body))[0] == 200
    assert seen == [body]
    assert fleet.app is not None and fleet.app.served.ids_checked is None
