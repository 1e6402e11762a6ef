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

from kvbus.service.prompt_ids import (
    RECHECK_SECONDS,
    RETRY_SECONDS,
    Agreement,
    EngineChecks,
    ids_body,
)
from kvbus.service.served_model import Tokenizer

from .test_gateway_limits import Fleet, complete
from .test_gateway_limits import fleet as fleet  # the fixtures
from .test_gateway_limits import tokenizer as tokenizer

USAGE = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_text_prompt_becomes_its_ids_and_every_other_field_keeps_its_value() -> None:
    raw = '{"model":"m","prompt":"w5 w6","temperature":NaN,"user":"café 🙂 \\ud83d","n":2}'
    body = json.loads(raw)
    sent = ids_body(body, [5, 6])
    assert sent is not None
    got = json.loads(sent)
    assert got.pop("prompt") == [5, 6]
    assert math.isnan(got.pop("temperature"))  # as the client sent it, not null
    assert got == {"model": "m", "user": "café 🙂 \ud83d", "n": 2}  # a lone surrogate too
    assert json.loads(ids_body({"prompt": "w5"}, [5]) or b"") == {"prompt": [5]}


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
    assert ids_body(body, [5, 6]) is None


def test_no_ids_no_rewrite_and_echo_false_is_not_echo() -> None:
    assert ids_body({"prompt": ""}, []) is None
    assert ids_body({"prompt": "w5 w6", "echo": False}, [5, 6]) is not None


async def worker_tokenizing(
    fleet: Fleet,
    tokenizer: Path,
    seen: list[dict[str, Any]],
    off_by: int = 0,
    max_model_len: int | None = None,
    name: str = "a",
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

    await fleet.worker(name, generate, tokenize)


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
    assert await checked(fleet) == "sent as token ids (1 engine checked)"
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
    """``--no-send-token-ids``: every body as the client sent it, and no check."""
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen)
    await fleet.run_router(tokenizer, send_token_ids=False)
    body = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1}
    assert (await complete(fleet, body))[0] == 200
    assert seen == [body]
    assert fleet.app is not None and fleet.app.served.ids_checked is None


async def test_by_default_each_engine_gets_ids_once_its_own_tokenize_agrees(
    fleet: Fleet, tokenizer: Path
) -> None:
    """Two engines, one of them tokenizing otherwise (another tokenizer revision): the
    router's default sends ids to the one that agreed and text to the other, and
    /health says which."""
    seen: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    await worker_tokenizing(fleet, tokenizer, seen["a"], name="a")
    await worker_tokenizing(fleet, tokenizer, seen["b"], off_by=1, name="b")
    await fleet.run_router(tokenizer)  # the default: on
    assert fleet.app is not None
    for _ in range(200):  # both checks answered
        if "of 2 engines" in (summary := await checked(fleet)):
            break
        await asyncio.sleep(0.05)
    assert summary.startswith("sent as token ids to 1 of 2 engines checked; as text to 1")
    assert "its /tokenize gave other ids" in summary
    served: dict[str, int] = {"a": 0, "b": 0}
    for i in range(40):
        body = {"model": "m", "prompt": f"w{5 + i % 20} w6 w7 w8", "max_tokens": 1}
        status, answer, worker = await complete(fleet, body)
        assert status == 200, answer
        served[worker.split("/")[0]] += 1
        if min(served.values()) >= 2:
            break
    assert min(served.values()) >= 2, served  # both engines got some
    assert all(isinstance(body["prompt"], list) for body in seen["a"])
    assert all(isinstance(body["prompt"], str) for body in seen["b"])
    assert fleet.app.metrics.prompts_as_ids._value.get() == len(seen["a"])


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_engine_checks_start_once_retry_late_and_recheck() -> None:
    """The checks' rules, with a scripted check: one task an engine at a time, text until
    it answers, a retry only after RETRY_SECONDS, a recheck after RECHECK_SECONDS (ids
    meanwhile), an engine forgotten gets text until checked again (a check under way
    dropped), and a prompt over the max_model_len an engine told gets text."""
    asked: list[str] = []
    answers: dict[str, Agreement | Exception] = {"a": Agreement(None, 100), "b": TimeoutError()}
    gate = asyncio.Event()

    async def check(base: str) -> Agreement:
        asked.append(base)
        await gate.wait()
        answer = answers[base]
        if isinstance(answer, Exception):
            raise answer
        return answer

    clock = _Clock()
    checks = EngineChecks(check, lambda: ["a", "b"], clock)
    assert not checks.agrees("a") and not checks.agrees("a") and not checks.agrees("b")
    await asyncio.sleep(0)
    assert asked == ["a", "b"]  # one check each, however often asked
    assert checks.summary() is None and not checks.any_agree
    gate.set()
    await asyncio.sleep(0.01)
    assert checks.agrees("a", 100) and not checks.agrees("a", 101)  # its max_model_len
    assert checks.summary() == "sent as token ids (1 engine checked)"
    assert not checks.agrees("b")  # did not answer: not asked again yet
    await asyncio.sleep(0.01)
    assert asked == ["a", "b"]
    clock.now = RETRY_SECONDS
    answers["b"] = ValueError("not JSON")  # any failure: asked again later, not at once
    assert not checks.agrees("b")
    await asyncio.sleep(0.01)
    assert asked == ["a", "b", "b"] and not checks.agrees("b")
    await asyncio.sleep(0.01)
    assert asked == ["a", "b", "b"]
    answers["a"] = Agreement("its /tokenize gave other ids for 'w5'")
    clock.now = RECHECK_SECONDS
    assert checks.agrees("a")  # due again: still ids while it is asked
    await asyncio.sleep(0.01)
    assert asked[-1] == "a" and not checks.agrees("a")
    assert checks.summary() == "sent as text: its /tokenize gave other ids for 'w5'"
    answers["a"] = Agreement(None, 50)
    checks.forget("a")
    assert not checks.agrees("a")  # forgotten: text until its new answer
    await asyncio.sleep(0.01)
    assert checks.agrees("a", 50)
    gate.clear()  # a check under way when the engine is forgotten is dropped
    clock.now = 2 * RECHECK_SECONDS
    assert checks.agrees("a")
    await asyncio.sleep(0)
    checks.forget("a")
    gate.set()
    await asyncio.sleep(0.01)
    assert not checks.any_agree and checks.summary() is None
    checks.close()
    asked.clear()
    assert not checks.agrees("a")  # closed: no check starts
    await asyncio.sleep(0.01)
    assert asked == []


async def test_engine_checks_keep_only_the_routed_engines_and_show_no_password() -> None:
    """A worker that moved (its old URL no longer routed to) leaves the checks, so their
    number stays the workers'; /health and the log show an engine's URL without its
    password."""
    bases = ["http://user:secret@h1:8000", "http://h2:8000"]
    answers = {bases[0]: Agreement("its /tokenize answered 404"), bases[1]: Agreement(None)}

    async def check(base: str) -> Agreement:
        return answers.get(base, Agreement(None))

    checks = EngineChecks(check, lambda: bases)
    for base in bases:
        checks.agrees(base)
    await asyncio.sleep(0.01)
    summary = checks.summary() or ""
    assert summary.startswith("sent as token ids to 1 of 2 engines checked; as text to 1")
    assert "secret" not in summary and "***" in summary
    bases[0] = "http://h3:8000"  # the first worker moved
    checks.agrees(bases[0])
    await asyncio.sleep(0.01)
    assert checks.summary() == "sent as token ids (2 engines checked)"
    checks.close()


async def test_an_engine_forgotten_is_checked_again_by_its_next_request(
    fleet: Fleet, tokenizer: Path
) -> None:
    """One engine found unreachable (a refused connection, or a stream it broke off:
    both are said through `Upstream.say_unreachable`) is forgotten: no engine agrees
    any more, yet its next completion starts its check, and the ones after go as ids
    again."""
    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen)
    await fleet.run_router(tokenizer)
    assert await checked(fleet) == "sent as token ids (1 engine checked)"
    assert fleet.app is not None
    body = {"model": "m", "prompt": "w5 w6 w7 w8", "max_tokens": 1}
    assert (await complete(fleet, body))[0] == 200
    fleet.app.upstream.say_unreachable("a/dp0", "its connection dropped")
    assert fleet.app.served.ids_checked is None
    for _ in range(100):
        assert (await complete(fleet, body))[0] == 200
        if isinstance(seen[-1]["prompt"], list) and len(seen) > 2:
            break
        await asyncio.sleep(0.05)
    assert isinstance(seen[0]["prompt"], list) and seen[1] == body  # text once forgotten
    assert isinstance(seen[-1]["prompt"], list)  # then ids again
