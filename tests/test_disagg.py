"""Prefill/decode disaggregation's logic (kvbus.service.disagg): roles, the two hops'
bodies and headers, and what happens when the prefill hop fails, with stand-in workers
that record what they were sent. Real engines moving real KV: test_router_pd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cluster import make_model

import kvbus
from kvbus import Kind, LoadMetrics
from kvbus.routing.router import Router
from kvbus.service.disagg import (
    MAX_ROLES,
    REMOTE_DECODE,
    Role,
    WorkerRoles,
    decode_body,
    prefill_body,
    transfer_params,
    unsupported,
)
from kvbus.service.gateway import RouterApp, add_arguments, build
from kvbus.service.upstream import MAX_HOP_ANSWER

PROMPT = list(range(5, 105))  # 100 tokens: 3 whole blocks of 32 to move
HANDED = {"remote_engine_id": "p-engine", "remote_block_ids": [7, 8, 9]}


def test_a_given_role_wins_and_an_advertised_one_is_taken_within_bounds() -> None:
    roles = WorkerRoles({"p": Role.PREFILL})
    assert not WorkerRoles().any_prefill and roles.any_prefill
    roles.advertise("p/dp0", "decode")  # given on the command line: kept
    roles.advertise("x/dp0", "prefill")
    roles.advertise("y/dp1", "")  # aggregated
    roles.advertise("z/dp0", "leader")  # not a role: ignored
    assert [roles.of(w) for w in ("p/dp0", "x/dp3", "y/dp1", "z/dp0", "new/dp0")] == [
        Role.PREFILL, Role.PREFILL, Role.BOTH, Role.BOTH, Role.BOTH,
    ]  # fmt: skip
    assert roles.not_for(Role.DECODE, ["p/dp0", "x/dp0", "y/dp1"]) == {"p/dp0", "x/dp0"}
    assert roles.not_for(Role.PREFILL, ["p/dp0", "y/dp1"]) == set()

    alone = WorkerRoles()
    alone.advertise("x/dp0", "prefill")
    assert alone.any_prefill
    alone.advertise("x/dp0", "decode")  # it restarted as a decode engine
    assert not alone.any_prefill

    crowd = WorkerRoles()
    for i in range(MAX_ROLES + 10):
        crowd.advertise(f"w{i}/dp0", "prefill")
    assert len(crowd.advertised) == MAX_ROLES  # forged names cost bounded memory
    assert crowd.of(f"w{MAX_ROLES + 5}/dp0") is Role.BOTH


def test_the_prefill_body_asks_for_one_token_and_a_remote_decode() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "min_tokens": 20,  # over max_tokens 1, vLLM would refuse the request
        "logprobs": True,
        "top_logprobs": 5,
        "temperature": 0.5,
        "kv_transfer_params": {"remote_host": "10.9.9.9"},  # the client's: never sent
    }
    assert json.loads(prefill_body(chat)) == {
        "model": "m",
        "messages": chat["messages"],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "min_tokens": 0,
        "temperature": 0.5,
        "kv_transfer_params": REMOTE_DECODE,
    }
    client_params = {k: v for k, v in chat.items() if k != "kv_transfer_params"}
    decode = json.loads(decode_body(chat, HANDED) or b"")
    assert decode == {**client_params, "kv_transfer_params": HANDED}
    assert json.loads(decode_body(chat, None) or b"") == client_params  # stripped
    assert decode_body(client_params, None) is None  # nothing to change: sent as it came
    assert chat["kv_transfer_params"] == {"remote_host": "10.9.9.9"}  # not mutated


@pytest.mark.parametrize(
    ("more", "split"),
    [({}, True), ({"n": 1}, True), ({"n": 2}, False), ({"best_of": 3}, False),
     ({"use_beam_search": True}, False), ({"prompt_logprobs": 0}, False),
     ({"n": "2"}, True)],  # not a number: the engine refuses it, whoever gets it
)  # fmt: skip
def test_requests_of_several_sequences_are_not_split(more: dict[str, Any], split: bool) -> None:
    assert unsupported({"prompt": "x", **more}) is not split


def test_transfer_params_are_read_from_the_answer_alone() -> None:
    assert transfer_params(json.dumps({"kv_transfer_params": HANDED}).encode()) == HANDED
    assert transfer_params(b'{"kv_transfer_params": null, "choices": []}') is None
    assert transfer_params(b'{"choices": []}') is None
    assert transfer_params(b'{"kv_transfer_params": [1]}') is None  # not an object
    assert transfer_params(b"<html>") is None
    deep = b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert transfer_params(deep) is None


def test_an_engine_advertises_the_role_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbus.connectors.vllm_stats import engine_role

    monkeypatch.delenv("KVBUS_ROLE", raising=False)
    assert engine_role() == ""  # both: never guessed from the connector's kv_role
    for given, advertised in (("Decode", "decode"), ("prefill ", "prefill"), ("both", "")):
        monkeypatch.setenv("KVBUS_ROLE", given)
        assert engine_role() == advertised
    monkeypatch.setenv("KVBUS_ROLE", "leader")
    assert engine_role() == ""  # said in a warning


def test_the_command_line_gives_roles() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--prefill", "p=http://127.0.0.1:1", "--decode", "d=http://127.0.0.1:2",
         "--worker", "w=http://127.0.0.1:3", "--skip-prefill-above", "0.5"]
    )  # fmt: skip
    app = build(args)
    assert app.workers == {
        "p": "http://127.0.0.1:1", "d": "http://127.0.0.1:2", "w": "http://127.0.0.1:3",
    }  # fmt: skip
    assert [app.roles.of(w) for w in ("p/dp0", "d/dp0", "w/dp0")] == [
        Role.PREFILL, Role.DECODE, Role.BOTH,
    ]  # fmt: skip
    assert app.http.pd is not None and app.http.pd.skip_above == 0.5
    assert app.followers.discovery is None  # workers were given


# --- the two hops, with stand-in workers ---------------------------------------------


class Worker:
    """A stand-in vLLM server: records each request's body and headers; answers a
    prefill (``do_remote_decode``) with ``HANDED`` (or ``prefill_answer``), with
    ``status`` when not 200; drops the connection of its next ``drops`` decodes."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], Any]] = []
        self.prefill_answer: bytes | None = None
        self.status = 200
        self.drops = [0]
        """Decodes to drop (a list: workers may share one count)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((body, request.headers.copy()))  # case-insensitive
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            if self.prefill_answer is not None:
                return web.Response(body=self.prefill_answer, content_type="application/json")
            return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": HANDED})
        if self.drops[0]:
            self.drops[0] -= 1
            assert request.transport is not None
            request.transport.close()  # it read the request, then died
            return web.Response()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2}
        return web.json_response({"choices": [{"text": "decoded"}], "usage": usage})

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def _advertise(url: str, roles: dict[str, str]) -> None:
    """Fresh load records for each source, with its role, every 0.5 s."""
    publishers = {
        name: kvbus.Publisher(url, stream="metrics", source=f"{name}/dp0") for name in roles
    }
    try:
        while True:
            for name, publisher in publishers.items():
                record = LoadMetrics(
                    ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0,
                    block_size=32, kv_cache_blocks=1000, role=roles[name],
                )  # fmt: skip
                publisher.publish(record, Kind.METRICS)
                publisher.flush()
            await asyncio.sleep(0.5)
    finally:
        for publisher in publishers.values():
            publisher.close()


class Fleet:
    def __init__(self, app: RouterApp, server: TestServer, workers: dict[str, Worker]) -> None:
        self.app, self.server, self.workers = app, server, workers
        self.p, self.d = workers["p"], workers["d"]

    async def complete(
        self, prompt: list[int] = PROMPT, **more: Any
    ) -> tuple[int, dict[str, str], Any]:
        headers = more.pop("headers", {})
        body = {"model": "m", "prompt": prompt, "max_tokens": 5, "stream": False, **more}
        async with aiohttp.ClientSession() as session:
            async with session.post(
                self.server.make_url("/v1/completions"), json=body, headers=headers
            ) as response:
                return response.status, dict(response.headers), await response.json()

    def skipped(self, reason: str) -> float:
        return self.app.metrics.pd_skipped.labels(reason)._value.get()  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def running(memory_url: str, model: Path, roles: dict[str, str]) -> AsyncIterator[Fleet]:
    """Stand-in workers named as ``roles``'s keys (a role "-": advertised by a source
    that is not one of the router's workers) behind a router given them as plain
    ``--worker``s: their roles come from the bus, as engines advertise them."""
    make_model(model)
    workers = {name: Worker() for name, role in roles.items() if role != "-"}
    for worker in workers.values():
        await worker.server.start_server()
    app = RouterApp({n: w.url for n, w in workers.items()}, Router(), memory_url, str(model))
    said = {name: "prefill" if role == "-" else role for name, role in roles.items()}
    advertising = asyncio.create_task(_advertise(memory_url, said))
    server = TestServer(app.app())
    await server.start_server()
    try:
        for _ in range(200):
            if app.ready and len(app.router.eligible()) == len(workers):
                break
            await asyncio.sleep(0.05)
        assert app.ready
        yield Fleet(app, server, workers)
    finally:
        advertising.cancel()
        await server.close()
        for worker in workers.values():
            await worker.server.close()


@pytest.fixture
async def fleet(memory_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with running(memory_url, tmp_path, {"p": "prefill", "d": "decode"}) as fleet:
        yield fleet


async def test_the_prefill_answer_s_params_go_to_the_decode_hop_under_one_request_id(
    fleet: Fleet,
) -> None:
    status, headers, answer = await fleet.complete(headers={"X-Request-Id": "client-7"})
    assert (status, headers["x-kvbus-worker"], answer["choices"][0]["text"]) == (
        200, "d/dp0", "decoded",
    )  # fmt: skip
    assert int(headers["x-kvbus-predicted-cached-tokens"]) == 96  # what the prefill moved
    [(prefill, prefill_headers)] = fleet.p.seen
    [(decode, decode_headers)] = fleet.d.seen
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"] == REMOTE_DECODE
    assert decode["kv_transfer_params"] == HANDED and decode["max_tokens"] == 5
    assert prefill_headers["X-Request-Id"] == decode_headers["X-Request-Id"] == "client-7"

    # d holds the prompt now (it is about to: the router's view): no prefill hop.
    await fleet.complete()
    assert len(fleet.p.seen) == 1 and len(fleet.d.seen) == 2
    assert fleet.skipped("held") == 1
    assert "kv_transfer_params" not in fleet.d.seen[-1][0]

    await fleet.complete([p + 1000 for p in PROMPT])  # no id from the client: one given
    ids = {headers["X-Request-Id"] for _, headers in (fleet.p.seen[-1], fleet.d.seen[-1])}
    assert len(fleet.p.seen) == 2 and len(ids) == 1 and ids.pop().startswith("kvbus-")


async def test_a_prefill_answer_without_params_leaves_the_decode_body_as_sent(
    fleet: Fleet,
) -> None:
    fleet.p.prefill_answer = b'{"choices": [], "kv_transfer_params": null}'
    assert (await fleet.complete())[0] == 200
    [(decode, _)] = fleet.d.seen
    assert "kv_transfer_params" not in decode


async def test_a_prefill_worker_that_fails_sends_the_request_whole_to_decode(
    fleet: Fleet,
) -> None:
    fleet.p.status = 503  # its engine's trouble, not the request's
    status, headers, _ = await fleet.complete()
    assert (status, headers["x-kvbus-worker"]) == (200, "d/dp0")
    assert int(headers["x-kvbus-predicted-cached-tokens"]) == 0  # d computes it all
    [(decode, _)] = fleet.d.seen
    assert "kv_transfer_params" not in decode and decode["max_tokens"] == 5
    assert fleet.skipped("no_prefill_worker") == 1


async def test_a_huge_prefill_answer_fails_the_hop_not_the_worker(fleet: Fleet) -> None:
    # A client's parameters could make any answer large: the worker stays up.
    fleet.p.prefill_answer = b'{"pad": "' + b"x" * MAX_HOP_ANSWER + b'"}'
    status, headers, _ = await fleet.complete()
    assert (status, headers["x-kvbus-worker"]) == (200, "d/dp0")
    assert fleet.skipped("no_prefill_worker") == 1
    assert set(fleet.app.router.eligible()) == {"d/dp0", "p/dp0"}


async def test_a_client_s_own_transfer_params_never_reach_a_worker(fleet: Fleet) -> None:
    forged = {"remote_host": "10.9.9.9", "remote_block_ids": [1, 2], "do_remote_prefill": True}
    assert (await fleet.complete(kv_transfer_params=forged))[0] == 200  # hopped
    assert (await fleet.complete(kv_transfer_params=forged))[0] == 200  # held: no hop
    assert (await fleet.complete(list(range(5, 20)), kv_transfer_params=forged))[0] == 200
    assert fleet.skipped("held") == fleet.skipped("short") == 1
    [(prefill, _)] = fleet.p.seen
    assert prefill["kv_transfer_params"] == REMOTE_DECODE
    sent = [body.get("kv_transfer_params") for body, _ in fleet.d.seen]
    assert sent == [HANDED, None, None]


async def test_requests_that_cannot_be_split_go_whole(fleet: Fleet) -> None:
    status, _, _ = await fleet.complete(n=2, min_tokens=3)
    assert status == 200 and fleet.p.seen == [] and fleet.skipped("unsupported") == 1
    [(decode, _)] = fleet.d.seen
    assert (decode["n"], decode["min_tokens"]) == (2, 3)  # the client's request, whole


async def test_a_decode_worker_that_fails_after_the_hop_gets_its_retry_a_new_hop(
    memory_url: str, tmp_path: Path
) -> None:
    async with running(
        memory_url, tmp_path, {"p": "prefill", "d": "decode", "e": "decode"}
    ) as fleet:
        e = fleet.workers["e"]
        fleet.d.drops = e.drops = [1]  # whichever decodes first dies mid-request
        status, headers, _ = await fleet.complete()
        assert status == 200
        assert len(fleet.p.seen) == 2  # a hop for each decode worker tried
        assert len(fleet.d.seen) == len(e.seen) == 1
        assert headers["x-kvbus-worker"] in {"d/dp0", "e/dp0"}


async def test_a_foreign_prefill_role_leaves_a_fleet_aggregated(
    memory_url: str, tmp_path: Path
) -> None:
    """Another fleet's prefill engine on the same bus (or a forged record) names a
    source that is not one of this router's workers: nothing changes here."""
    async with running(memory_url, tmp_path, {"p": "both", "d": "both", "x": "-"}) as fleet:
        assert fleet.app.http.pd is not None and not fleet.app.http.pd.active()
        assert (await fleet.complete())[0] == 200
        [(body, sent)] = fleet.p.seen + fleet.d.seen
        assert "kv_transfer_params" not in body and "X-Request-Id" not in sent


async def test_a_prefill_worker_s_refusal_reaches_the_client(fleet: Fleet) -> None:
    fleet.p.status = 400
    status, _, answer = await fleet.complete()
    assert (status, answer) == (400, {"error": {"message": "no"}})
    assert fleet.d.seen == []  # nothing was decoded
    # A refusal is no fault of the worker's: it stays up.
    assert set(fleet.app.router.eligible()) == {"d/dp0", "p/dp0"}
