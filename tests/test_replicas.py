"""Router replicas behind one address share their requests in flight (the routes
stream): the logic on hand-fed items, then two `kvbus router` services on one bus in
front of scripted workers, in this process and in two processes of their own on a real
nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cluster import beat_idle_load

import kvbus
from kvbus import (
    BlockRemoved,
    BlockStored,
    Kind,
    KVEventBatch,
    LoadMetrics,
    Message,
)
from kvbus.bus.subscription import Resync, ResyncReason
from kvbus.routing.router import MAX_KV_CACHE_BLOCKS, MAX_PEER_KEYS, MAX_PEERS, CostWeights, Router
from kvbus.service.gateway import RouterApp, start, stop
from kvbus.wire.events import RouteEvent, SourceStopped

from .servers import NatsServer, free_port
from .test_gateway_limits import Fleet, answer
from .test_gateway_limits import tokenizer as tokenizer
from .test_router import PROMPT, B, Clock, busy_cache, capacity, kv, load

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
    for router in alone.routers:
        router.weights = CostWeights(affinity=0)
    first, second = (r.route(PROMPT) for r in alone.routers)
    assert first is not None and second is not None
    assert first.worker != second.worker  # each replica's own tie-break splits the burst
    # The affinity term breaks the tie alike in both, with nothing shared.
    alone = Replicas(share=False)
    first, second = (r.route(PROMPT) for r in alone.routers)
    assert first is not None and second is not None
    assert first.worker == second.worker

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


def routed(peer: str, request: int, keys: list[int], worker: str = "a") -> Message:
    event = RouteEvent(ts=0.0, request=request, phase="routed", worker=worker, keys=keys)
    return Message(peer, 1, request, Kind.ROUTES, 0.0, event, b"", 0)


def ended(peer: str, request: int, phase: str = "finished") -> Message:
    event = RouteEvent(ts=0.0, request=request, phase=phase)
    return Message(peer, 1, request, Kind.ROUTES, 0.0, event, b"", 0)


def test_an_idle_replica_expires_its_peers_requests_as_routes_arrive() -> None:
    shared = Replicas()
    one, idle = shared.routers
    decision = one.route(PROMPT)
    assert decision is not None and idle.peer_requests == 1
    shared.clock.now += idle.peer_timeout + 1  # its end was lost
    idle.apply_routes(ended("r3", 1, "started"))  # any item of the stream, from anyone
    assert idle.peer_requests == 0 and idle.peers == 0


class Keys(list[int]):
    """A prompt's keys that a test can hold a weak reference to."""

    __slots__ = ("__weakref__",)


@pytest.mark.parametrize("routing", [False, True], ids=["idle", "busy"])
def test_a_finished_peer_request_lets_go_of_its_keys_at_once(routing: bool) -> None:
    router = Replicas(share=False).routers[1]
    rng = random.Random(1)
    held, every_key = [], set()
    for request in range(1, 101):  # 100 peer requests of 2,000 keys each
        keys = Keys(rng.randrange(-(2**63), 2**63) for _ in range(2000))
        held.append(weakref.ref(keys))
        every_key.update(keys)
        router.apply_routes(routed("r1", request, keys))
        del keys
    gc.collect()
    assert router.peer_requests == 100
    assert all(ref() is not None for ref in held) and router._pending  # type: ignore[attr-defined]
    for request in range(1, 101):
        router.apply_routes(ended("r1", request))
    router._clock.now += router.linger + 1  # type: ignore[attr-defined]
    if routing:  # a busy replica: its own requests come and go
        decision = router.route(PROMPT)
        assert decision is not None
        router.finished(decision)
    else:  # one that routes nothing: only the routes stream goes on
        router.apply_routes(ended("r1", 1))
    # Their keys went with them: not kept for peer_timeout (600 s), nor until it routes
    # (no list of them left, nor a count of any of them in what the router holds).
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
    pending = router._pending  # type: ignore[attr-defined]
    assert not any(every_key.intersection(counts) for counts in pending.values())
    assert not every_key.intersection(router._pending_masks)  # type: ignore[attr-defined]
    assert router.peer_requests == 0 and router.peers == 0


def test_peers_take_room_only_while_they_have_requests_in_flight() -> None:
    router = Replicas(share=False).routers[1]
    for peer in range(5000):  # sources that only ever said "finished" or "started"
        router.apply_routes(ended(f"p{peer}", 1, ("finished", "started")[peer % 2]))
    assert router.peers == 0
    for peer in range(3):  # a routed request that ends: its replica goes with it
        router.apply_routes(routed(f"q{peer}", 1, [1, 2]))
        router.apply_routes(ended(f"q{peer}", 1))
    assert router.peers == 0 and router.peer_requests == 0
    for peer in range(MAX_PEERS):
        router.apply_routes(routed(f"q{peer}", 1, [peer]))
    assert router.peers == MAX_PEERS and router.peer_rejected == 0
    router.apply_routes(routed("one-too-many", 1, [1]))
    assert router.peers == MAX_PEERS and router.peer_rejected == 1
    router.apply_routes(routed("q0", 2, [7]))  # a known peer's next request is welcome
    assert router.peer_requests == MAX_PEERS + 1 and router.peer_rejected == 1
    router.apply_routes(ended("q0", 1))
    router.apply_routes(ended("q1", 1))  # q1 had one request: its room frees
    router.apply_routes(routed("one-too-many", 1, [1]))
    assert router.peers == MAX_PEERS and router.peer_rejected == 1


def metrics(source: str, **figures: float) -> Message:
    body = LoadMetrics(ts=0.0, running=0, waiting=0, **figures)  # type: ignore[arg-type]
    return Message(source, 1, 1, Kind.METRICS, 0.0, body, b"", 0)


def churn(router: Router, worker: str, blocks: int, first_hash: int) -> None:
    """``worker`` newly caches ``blocks`` blocks, 20 at a time, each time evicting all
    (it holds at most 20: its capacity is what it reports, not what it cached)."""
    for first in range(first_hash, first_hash + blocks, 20):
        busy_cache(router, worker, 20, first)
        # Evicted one by one, as an LRU cache does (a clear would be a reset: its
        # insertions then evict nothing and no longer count).
        router.apply_kv(kv(worker, BlockRemoved(list(range(first, first + 20)), "GPU")))


def test_a_load_record_out_of_range_is_clamped_and_counted() -> None:
    clock = Clock()
    router = Router("kv", block_size=B, seed=1, clock=clock, weights=CostWeights(eviction=2))
    for worker in ("a", "b"):
        router.apply_metrics(capacity(worker, 100))
    # One forged record claims a cache no fleet has, and is never heard from again.
    router.apply_metrics(metrics("forged", kv_cache_usage=0.0, kv_cache_blocks=2**62))
    clock.now += router.stale_after + 1
    for worker in ("a", "b"):
        router.apply_metrics(capacity(worker, 100))
    # a cached 1,000 blocks long ago, b the fleet's last 200 (a fleet capacity): the
    # insertion window holds only b's, so b evicts the fleet's freshest blocks, a none.
    churn(router, "a", 1000, 10_000)
    churn(router, "b", 200, 20_000)
    decision = router.route(PROMPT)
    assert decision is not None and decision.worker == "a", decision.explain()
    assert decision.excess == 0.0 and decision.runner_up == "b"
    assert decision.runner_up_cost > decision.cost + 1  # b's excess: no tie drawn
    assert router.load_clamped == 1
    assert MAX_KV_CACHE_BLOCKS < 2**62
    router.finished(decision)
    # A usage below 0 would draw every request; a NaN one would make the cost NaN.
    for usage in (-1e300, math.nan, math.inf):
        router.apply_metrics(metrics("b", kv_cache_usage=usage, kv_cache_blocks=100))
        decision = router.route(PROMPT)
        assert decision is not None and decision.worker == "a" and math.isfinite(decision.cost)
        router.finished(decision)
    assert router.load_clamped == 4


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


# --- two `kvbus router` processes on a real nats-server -----------------------------------


@contextlib.contextmanager
def router_processes(
    url: str, tokenizer: Path, workers: dict[str, str], streams: dict[str, str], logs: Path
) -> Iterator[list[str]]:
    """Two ``kvbus router`` replicas, each a process with a hash seed of its own; yields
    their base URLs."""
    processes, bases, logged = [], [], []
    try:
        for number in (1, 2):
            port = free_port()
            command = [sys.executable, "-m", "kvbus.cli", "router", "--port", str(port)]
            command += [f"--worker={name}={base}" for name, base in workers.items()]
            command += ["--url", url, "--tokenizer", str(tokenizer), "--block-size", "16"]
            command += ["--kv-stream", streams["kv"], "--metrics-stream", streams["metrics"]]
            command += ["--routes-stream", streams["routes"], "--replica", f"r{number}"]
            env = {**os.environ, "PYTHONHASHSEED": str(number)}
            logged.append(open(logs / f"router-{number}.log", "wb"))
            out = logged[-1]
            processes.append(subprocess.Popen(command, env=env, stdout=out, stderr=out))
            bases.append(f"http://127.0.0.1:{port}")
        yield bases
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for out in logged:
            out.close()


async def peer_requests(session: aiohttp.ClientSession, base: str) -> float:
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    found = re.search(r"^kvbus_router_peer_requests (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else -1.0


async def ready(session: aiohttp.ClientSession, base: str) -> bool:
    try:
        async with session.get(f"{base}/health") as response:
            return response.status == 200
    except aiohttp.ClientConnectionError:
        return False  # not listening yet


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "not reached"
        await asyncio.sleep(0.05)


async def test_replicas_in_processes_of_their_own_send_a_burst_to_one_worker(
    nats_server: NatsServer, tokenizer: Path, tmp_path: Path
) -> None:
    """Their keys mean the same in both processes: a request routed by one replica makes
    the other see its prompt's blocks about to be cached on that worker (keys that
    meant nothing there would leave only its load, pushing the burst elsewhere)."""
    tag = uuid.uuid4().hex[:8]
    streams = {name: f"{name}-{tag}" for name in ("kv", "metrics", "routes")}
    fleet, held = Fleet(nats_server.url), Held()
    for name in WORKERS:
        await fleet.worker(name, held.generate)
    beating = asyncio.create_task(
        beat_idle_load(nats_server.url, streams["metrics"], list(WORKERS))
    )
    body = json.dumps({"model": "m", "prompt": " ".join(f"w{i}" for i in range(200))})

    async def post(session: aiohttp.ClientSession, base: str) -> tuple[str, int]:
        async with session.post(f"{base}/v1/completions", data=body) as response:
            assert response.status == 200
            headers = response.headers
            return headers["x-kvbus-worker"], int(headers["x-kvbus-predicted-cached-tokens"])

    try:
        with router_processes(
            nats_server.url, tokenizer, fleet.workers, streams, tmp_path
        ) as bases:
            async with aiohttp.ClientSession() as session:
                for base in bases:
                    await eventually(functools.partial(ready, session, base))
                burst = []
                for number in range(4):  # to each replica in turn
                    burst.append(asyncio.create_task(post(session, bases[number % 2])))
                    other, sent_there = bases[(number + 1) % 2], number // 2 + 1

                    async def seen(other: str = other, sent_there: int = sent_there) -> bool:
                        return await peer_requests(session, other) == sent_there

                    await eventually(seen)  # the other replica counts them all
                held.release.set()
                answers = await asyncio.wait_for(asyncio.gather(*burst), 30)
    finally:
        held.release.set()
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await fleet.close()
    workers = {worker for worker, _ in answers}
    assert len(workers) == 1, answers
    # Each request after the first found the burst's blocks where it went.
    assert [predicted > 0 for _, predicted in answers] == [False, True, True, True], answers
