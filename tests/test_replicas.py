"""Router replicas behind one address share their requests in flight (the routes
stream): the logic on hand-fed items, then two `kvbus router` services on one bus in
front of scripted workers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

import kvbus
from kvbus import BlockStored, Kind, KVEventBatch, Message
from kvbus.events import RouteEvent, SourceStopped
from kvbus.gateway import RouterApp, start, stop
from kvbus.router import MAX_PEER_KEYS, Router
from kvbus.subscribe import Resync, ResyncReason

from .servers import free_port
from .test_gateway_limits import Fleet, answer
from .test_gateway_limits import tokenizer as tokenizer
from .test_router import PROMPT, B, Clock, load

WORKERS = ("a", "b", "c", "d")


class Replicas:
    """Two routers whose shared events go to each other, as the routes stream would."""

    def __init__(self, share: bool = True) -> None:
        self.clock = Clock()
        self.routers: list[Router] = []
        for seed, name in ((1, "r1"), (2, "r2")):
            router = Router("kv", block_size=B, seed=seed, clock=self.clock, replica=name)
            for worker in WORKERS:
                router.apply_metrics(load(worker))
            self.routers.append(router)
        if share:
            for router in self.routers:
                router.share = self._sender(router)
        self.seqs = 0

    def _sender(self, sender: Router) -> object:
        def send(event: RouteEvent) -> None:
            self.seqs += 1
            message = Message(str(sender.replica), 1, self.seqs, Kind.ROUTES, 0.0, event, b"", 0)
            for router in self.routers:
                router.apply_routes(message)  # its own is skipped

        return send


def test_a_burst_split_across_replicas_lands_together() -> None:
    alone = Replicas(share=False)
    first, second = (r.route(PROMPT) for r in alone.routers)
    assert first is not None and second is not None
    assert first.worker != second.worker  # each replica alone splits the burst

    shared = Replicas()
    one, two = shared.routers
    first = one.route(PROMPT)
    assert first is not None and two.peer_requests == 1
    second = two.route(PROMPT)
    assert second is not None and second.worker == first.worker
    assert second.matched_tokens == 32  # r1's request: its blocks are about to be cached
    # Another prompt goes elsewhere: r1's request is queued there, in r2's count too.
    other = two.route(list(range(500, 533)))
    assert other is not None and other.worker != first.worker


def test_a_peers_request_ends_with_its_finish_restart_stop_or_timeout() -> None:
    shared = Replicas()
    one, two = shared.routers
    decision = one.route(PROMPT)
    assert decision is not None
    one.started(decision)
    one.finished(decision)
    assert two.peer_requests == 0

    one.route(PROMPT)
    two.apply_routes(Resync("r1", 2, ResyncReason.NEW_EPOCH, None, 1))
    assert two.peer_requests == 0

    one.route(PROMPT)
    two.apply_routes(Message("r1", 2, 9, Kind.CONTROL, 0.0, SourceStopped(), b"", 0))
    assert two.peer_requests == 0

    one.route(PROMPT)
    assert two.peer_requests == 1
    shared.clock.now += two.peer_timeout + 1
    two.route(PROMPT)  # expiry runs with routing
    assert two.peer_requests == 0


def test_forged_peer_events_cost_nothing() -> None:
    router = Replicas(share=False).routers[1]

    def routed(**fields: object) -> Message:
        event = RouteEvent(ts=0.0, request=1, phase="routed", **fields)  # type: ignore[arg-type]
        return Message("evil", 1, 1, Kind.ROUTES, 0.0, event, b"", 0)

    router.apply_routes(routed(worker="not-a-worker", keys=[1]))
    router.apply_routes(routed(worker="a", keys=list(range(MAX_PEER_KEYS + 1))))
    assert router.peer_requests == 0 and router.peer_rejected == 2
    router.apply_routes(routed(worker="a", keys=[1, 2], prefill_blocks=float("nan"), new_blocks=-5))
    router.apply_routes(routed(worker="a", keys=[1, 2]))  # the same request again
    assert router.peer_requests == 1 and router.peer_rejected == 3
    decision = router.route(PROMPT)
    assert decision is not None and decision.load >= 0  # nothing negative or NaN got in


# --- two router services on one bus -------------------------------------------------------


class Held:
    """Workers that answer only when released: requests stay in flight."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def generate(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return await answer(request)


@pytest.fixture
async def two_routers(
    memory_url: str,
    tokenizer: Path,
) -> AsyncIterator[tuple[Fleet, RouterApp, str, Held]]:
    fleet, held = Fleet(memory_url), Held()
    for name in WORKERS:
        await fleet.worker(name, held.generate)
    # An engine's event tells the routers the block size (its blocks: another prompt).
    with kvbus.Publisher(memory_url, stream="kv", source="a/dp0") as engine:
        other = BlockStored([1], None, list(range(900, 916)), 16, None, "GPU", None)
        engine.publish(KVEventBatch(time.time(), [other]))
    await fleet.run_router(tokenizer, routes_stream="routes", replica="r1")
    assert fleet.app is not None
    second = RouterApp(
        fleet.workers,
        Router("kv", seed=2),
        memory_url,
        str(tokenizer),
        routes_stream="routes",
        replica="r2",
    )
    port = free_port()
    served = await start(second, "127.0.0.1", port)
    try:
        yield fleet, second, f"http://127.0.0.1:{port}", held
    finally:
        held.release.set()
        await stop(*served)
        await fleet.close()


async def until(condition: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not reached"
        await asyncio.sleep(0.02)


async def test_two_router_services_send_a_burst_to_one_worker(
    two_routers: tuple[Fleet, RouterApp, str, Held],
) -> None:
    fleet, second, second_url, held = two_routers
    assert fleet.app is not None
    await until(lambda: second.ready)
    body = json.dumps({"model": "m", "prompt": " ".join(f"w{i}" for i in range(200))})

    async def post(session: aiohttp.ClientSession, base: str) -> str:
        async with session.post(f"{base}/v1/completions", data=body) as response:
            assert response.status == 200
            return response.headers["x-kvbus-worker"]

    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(post(session, fleet.router_url))
        await until(lambda: second.router.peer_requests == 1)  # r1's request, via the bus
        then = asyncio.create_task(post(session, second_url))
        await until(lambda: fleet.app is not None and fleet.app.router.peer_requests == 1)
        held.release.set()
        workers = await asyncio.gather(first, then)
    assert workers[0] == workers[1]
    await until(lambda: second.router.peer_requests == 0)  # r1's finish arrived
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{second_url}/metrics") as response:
            metrics = await response.text()
    assert 'kvbus_publisher_published_total{source="r2",stream="routes"}' in metrics
