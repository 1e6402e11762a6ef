"""``kvbus router --send-token-ids``: a completion's text prompt goes on to its engine as
the token ids the router routed it by, once the engine's /tokenize agrees with the
router's tokenizer, and only where the answer cannot tell. The body's rewriting is
checked alone; what a worker receives, through the router (in this process, on a
memory:// bus) in front of scripted workers. That a real vLLM engine answers the ids as
it answers the text is in ``test_router_e2e.py``."""

from __future__ import annotations

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
    raw = '{"model":"m","prompt":"w5 w6","temperature":NaN,"user":"café 🙂","n":2}'
    body = json.loads(raw)
    sent = ids_body(body, [5, 6])
    assert sent is not None
    got = json.loads(sent)
    assert got.pop("prompt") == [5, 6]
    assert math.isnan(got.pop("temperature"))  # as the client sent it, not null
    assert got == {"model": "m", "user": "café 🙂", "n": 2}
    assert json.loads(ids_body({"prompt": "w5"}, [5]) or b"") == {"prompt": [5]}


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "w5", "echo": True},  # answers with the prompt's text
        {"prompt": "w5", "truncate_prompt_tokens": 1},
        {"prompt": ["w5", "w6"]},  # a batch
        {"prompt": [5, 6]},  # ids already
        {"prompt_embeds": "AAAA"},
    ],
)
def test_a_prompt_the_answer_would_tell_apart_goes_as_sent(body: dict[str, Any]) -> None:
    assert ids_body(body, [5, 6]) is None


def test_no_ids_no_rewrite() -> None:
    assert ids_body({"prompt": ""}, []) is None


async def worker_tokenizing(
    fleet: Fleet, tokenizer: Path, seen: list[dict[str, Any]], off_by: int = 0
) -> None:
    """A worker whose /tokenize answers as the router's tokenizer does (or ``off_by``
    added to each id), keeping every completion's body in ``seen``."""
    ours = Tokenizer(str(tokenizer))

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        ids = ours.encode(body["prompt"], body.get("add_special_tokens", True))
        return web.json_response({"count": len(ids), "tokens": [i + off_by for i in ids]})

    async def generate(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        return web.json_response({"id": "cmpl-1", "choices": [], "usage": USAGE})

    await fleet.worker("a", generate, tokenize)


async def test_the_engine_gets_the_ids_the_router_routed_by(fleet: Fleet, tokenizer: Path) -> None:
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen)
    await fleet.run_router(tokenizer, send_token_ids=True)
    assert fleet.app is not None and fleet.app.served.ids_agreed
    text = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1, "stream": False}
    kept = [
        text | {"echo": True},
        text | {"prompt": ["w5 w6", "w7"]},
        text | {"prompt": [5, 6, 7]},
    ]
    for body in [text, *kept]:
        status, answer, _ = await complete(fleet, body)
        assert status == 200, answer
    assert seen[0] == text | {"prompt": [5, 6, 7, 8]}
    assert seen[1:] == kept  # as sent


async def test_an_engine_that_tokenizes_otherwise_gets_text(fleet: Fleet, tokenizer: Path) -> None:
    """A router given another tokenizer than the engines' would change what they compute:
    the engine's /tokenize disagreeing on a probe, prompts go as text."""
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen, off_by=1)
    await fleet.run_router(tokenizer, send_token_ids=True)
    assert fleet.app is not None and not fleet.app.served.ids_agreed
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
