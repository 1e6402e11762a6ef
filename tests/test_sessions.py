"""Session affinity (kvbus.routing.sessions, Router.route's ``session``): a session's
requests stay on one worker while it may get traffic and is not overloaded, across
router replicas too; the map is bounded."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from kvbus.routing.router import Router
from kvbus.routing.sessions import Sessions, session_key

from .test_gateway_limits import Fleet
from .test_gateway_limits import fleet as fleet
from .test_gateway_limits import tokenizer as tokenizer
from .test_replicas import WORKERS, Replicas
from .test_router import PROMPT, B, Clock, load


def routed(router: Router, session: int, prompt: list[int] = PROMPT) -> str:
    decision = router.route(prompt, session=session)
    assert decision is not None
    router.finished(decision)
    return decision.worker


@pytest.mark.parametrize("policy", ["round_robin", "random"])
def test_a_cache_blind_policy_keeps_a_session_on_one_worker_until_it_leaves(policy: str) -> None:
    clock = Clock()
    r = Router(policy, block_size=B, seed=3, clock=clock)
    for worker in WORKERS:
        r.apply_metrics(load(worker))
    alice, bob = session_key("alice"), session_key("bob")
    home = routed(r, alice)
    assert {routed(r, alice) for _ in range(20)} == {home}
    assert len({routed(r, 0) for _ in range(20)}) > 1  # no session: the policy's spread
    assert len({routed(r, bob) for _ in range(5)}) == 1
    # Its worker stops getting traffic (no load record within stale_after): it moves,
    # then stays where it moved.
    clock.now += r.stale_after + 1
    for worker in WORKERS:
        if worker != home:
            r.apply_metrics(load(worker))
    moved = routed(r, alice)
    assert moved != home and {routed(r, alice) for _ in range(10)} == {moved}


def test_kv_keeps_a_session_within_its_slack_and_moves_it_off_an_overloaded_worker() -> None:
    clock = Clock()
    r = Router("kv", block_size=B, seed=1, session_slack=10.0, clock=clock)
    for worker in ("a", "b"):
        r.apply_metrics(load(worker))
    session = session_key("s")
    home = routed(r, session)
    other = "b" if home == "a" else "a"
    # A new prompt (8 blocks, held nowhere) ties on the cache: the session decides.
    assert {routed(r, session, list(range(7000 + 100 * i, 7033 + 100 * i))) for i in range(5)} == {
        home
    }
    # (Past the linger: a record then is not this router's ended requests' echo.)
    clock.now += r.linger + 0.1
    r.apply_metrics(load(other))
    r.apply_metrics(load(home, waiting=2))  # 8 blocks over the other: within 10
    assert routed(r, session, list(range(9000, 9033))) == home
    r.apply_metrics(load(home, waiting=5))  # 20 blocks over: overloaded
    assert routed(r, session, list(range(9100, 9133))) == other
    assert routed(r, session, list(range(9200, 9233))) == other  # and stays there


def test_a_replicas_session_goes_where_the_other_replica_sent_it() -> None:
    replicas = Replicas()
    one, two = replicas.routers
    for router in replicas.routers:
        router.policy = "round_robin"  # (kv would agree by the prompt alone)
    session = session_key("conversation-7")
    first = routed(one, session)
    assert {routed(two, session) for _ in range(8)} == {first}
    # Without the routes stream each replica keeps its own idea of the session.
    alone = Replicas(share=False)
    for router in alone.routers:
        router.policy = "round_robin"
    routed(alone.routers[0], 0)  # (so that the two replicas' turns differ)
    picks = {routed(router, session) for router in alone.routers for _ in range(2)}
    assert len(picks) > 1


def test_the_sessions_are_bounded_and_forgotten_when_idle() -> None:
    sessions = Sessions(ttl=10.0, limit=3)
    for n in range(3):
        sessions.assign(n + 1, f"w{n}", now=0.0)
    assert sessions.worker(1, now=5.0) == "w0"
    sessions.assign(4, "w3", now=5.0)  # past the limit: the least recently used goes
    assert len(sessions) == 3 and sessions.worker(2, now=5.0) is None
    assert sessions.worker(1, now=16.0) is None  # idle past the ttl
    assert sessions.worker(4, now=15.0) == "w3"
    assert session_key("x") == session_key(b"x") != session_key("y")
    assert session_key("") != 0
    assert session_key("caf\udcff") == session_key(b"caf\xff")  # a header not in UTF-8


async def test_the_router_keeps_a_session_named_in_its_header_on_one_worker(
    fleet: Fleet, tokenizer: Path
) -> None:
    for name in ("a", "b"):
        await fleet.worker(name)
    await fleet.run_router(tokenizer, policy="round_robin")
    body = json.dumps({"model": "m", "prompt": "w5 w6 w7"}).encode()

    async def worker_for(headers: dict[str, str]) -> str:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{fleet.router_url}/v1/completions",
                data=body,
                headers={"content-type": "application/json", **headers},
            ) as response:
                assert response.status == 200
                return response.headers["x-kvbus-worker"]

    assert len({await worker_for({}) for _ in range(4)}) == 2  # round robin
    for name in ("alice", "bob"):
        assert len({await worker_for({"x-session-id": name}) for _ in range(6)}) == 1
