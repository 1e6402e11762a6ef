"""Faults survived, against real servers: kill -9 and restart on the same store, a
network cut through a TCP proxy, a publisher whose buffer overflows during an outage.

Figures (publish() call times while the backend is down) are printed; run with ``-s``
to see them. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path

import pytest

import kvbus
from kvbus import LossNotice, Message, Resync, ResyncReason

from .conftest import Item, kv_payload, lost_seqs, seqs
from .servers import CuttableProxy, NatsServer, RedisServer, Server

SERVERS = {"nats": NatsServer, "redis": RedisServer}


class PacedPublishing:
    """An 'engine' thread publishing ``count`` messages at a steady pace, timing every
    publish() call."""

    def __init__(
        self, publisher: kvbus.Publisher, count: int, per_ms: int = 10, rate: float | None = None
    ) -> None:
        self.publisher = publisher
        self.count = count
        self.per_ms = per_ms
        self.rate = rate
        """messages per second, held to a schedule (else ``per_ms`` between 1 ms sleeps)"""
        self.durations: list[float] = []
        self.accepted: list[bool] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        payload = kv_payload(0, 16)
        began = time.perf_counter()
        for i in range(self.count):
            start = time.perf_counter()
            self.accepted.append(self.publisher.publish(payload))
            self.durations.append(time.perf_counter() - start)
            if self.rate is not None:
                ahead = began + (i + 1) / self.rate - time.perf_counter()
                if ahead > 0.001:
                    time.sleep(ahead)
            elif i % self.per_ms == 0:
                time.sleep(0.001)

    def start(self) -> PacedPublishing:
        self.thread.start()
        return self

    async def wait_published(self, n: int) -> None:
        while len(self.accepted) < n:  # noqa: ASYNC110 - polls a thread
            await asyncio.sleep(0.01)

    async def join(self) -> None:
        await asyncio.to_thread(self.thread.join)

    def figures(self, what: str) -> str:
        d = sorted(self.durations)
        return (
            f"{what}: {len(d)} publish() calls, median {statistics.median(d) * 1e6:.1f} us, "
            f"p99 {d[int(len(d) * 0.99)] * 1e6:.1f} us, max {d[-1] * 1e3:.2f} ms, "
            f"dropped {self.publisher.stats.dropped}, send errors "
            f"{self.publisher.stats.send_errors}"
        )


async def consume(sub: kvbus.Subscription, source: str, last: int, items: list[Item]) -> None:
    """Take items until seq ``last`` of ``source`` is delivered or announced lost (a
    trailing drop's LossNotice arrives as a Resync that covers it)."""
    async for item in sub:
        items.append(item)
        if item.source != source:
            continue
        if isinstance(item, Message) and item.seq >= last:
            return
        if isinstance(item, Resync) and item.lost is not None and item.lost[1] >= last:
            return


async def kill_9_and_restart(backend: str, directory: Path) -> tuple[PacedPublishing, int]:
    """One run: 4,000 messages/s into the default queue, kill -9 of the server a third of
    the way, restarted 1 s later on the same store, the publisher closed 3 s after the
    restart. Returns the engine and how many copies the subscriber dropped; asserts
    every seq arrived exactly once and nothing was dropped."""
    server: Server = SERVERS[backend](directory)
    server.start()
    total = 20_000
    publisher = kvbus.Publisher(server.url, stream="kv", source="engine")
    sub = kvbus.subscribe("kv", server.url)
    items: list[Item] = []
    reader = asyncio.create_task(consume(sub, "engine", total + 2, items))
    try:
        engine = PacedPublishing(publisher, total, rate=4000).start()
        await engine.wait_published(total // 3)
        server.kill()
        await asyncio.sleep(1.0)
        server.start()
        await asyncio.sleep(3.0)
        await engine.join()
        await publisher.aclose()
        await asyncio.wait_for(reader, 60)
        assert all(engine.accepted) and publisher.stats.dropped == 0
        assert seqs(items) == list(range(1, total + 3))  # SourceStarted ... SourceStopped
        assert not [i for i in items if isinstance(i, Resync)]
        return engine, sub.stats.duplicates
    finally:
        reader.cancel()
        await sub.aclose()
        await publisher.aclose()
        server.stop()


@pytest.mark.parametrize("backend", ["nats", "redis"])
async def test_kill_9_and_restart_on_the_same_store(backend: str, tmp_path: Path) -> None:
    """kill -9 of the server at 4,000 messages/s with the default queue (NATS:
    sync_interval always; Redis: appendonly, appendfsync always): every seq exactly once,
    nothing dropped, publish() never waits. (In-flight NATS appends used to wait out
    their 5 s ack timeout after the reconnect: 3,300 dropped.) bench/bench_recovery.py
    runs it 5 times per backend."""
    engine, copies = await kill_9_and_restart(backend, tmp_path)
    print(f"\n{engine.figures(backend + ' kill -9')}, {copies} stored copies dropped")


@pytest.mark.parametrize("backend", ["nats", "redis"])
@pytest.mark.parametrize("max_queue", [100_000, 300])
async def test_network_cut_through_a_proxy(
    backend: str, max_queue: int, request: pytest.FixtureRequest
) -> None:
    """Publisher and subscriber reach the server through a proxy that drops every
    connection for 3 s. With room in the publisher's queue nothing is lost; when the
    queue overflows, exactly the dropped seqs are announced (Resync DROPPED), nothing
    else is missing."""
    server: Server = request.getfixturevalue(f"{backend}_server")
    proxy = CuttableProxy(server.port)
    await proxy.start()
    url = f"{server.url.rsplit(':', 1)[0]}:{proxy.port}"
    url += "?timeout=2" if backend == "nats" else ""
    stream = f"cut{max_queue}{backend}"
    total = 20_000
    publisher = kvbus.Publisher(url, stream=stream, source="engine", max_queue=max_queue)
    sub = kvbus.subscribe(stream, url)
    items: list[Item] = []
    reader = asyncio.create_task(consume(sub, "engine", total + 1, items))
    try:
        engine = PacedPublishing(publisher, total, per_ms=5).start()
        await engine.wait_published(total // 4)
        proxy.cut()
        await asyncio.sleep(3.0)
        proxy.heal()
        await engine.join()
        await asyncio.wait_for(reader, 120)
        print(f"\n{engine.figures(f'{backend} cut 3 s, max_queue={max_queue}')}")
        delivered = seqs(items)
        assert delivered == sorted(set(delivered))  # in order, no duplicates
        lost = lost_seqs(items)
        assert not lost & set(delivered)
        # Every seq is delivered or announced lost (a LossNotice's own seq with them).
        assert lost | set(delivered) == set(range(1, max(lost | set(delivered)) + 1))
        assert not [i for i in items if isinstance(i, Message) and isinstance(i.body, LossNotice)]
        assert len(lost) == publisher.stats.dropped
        assert all(i.reason == ResyncReason.DROPPED for i in items if isinstance(i, Resync))
        if max_queue > total:
            assert not lost and all(engine.accepted)
        else:
            assert lost, "the cut was expected to overflow a 300-message queue"
    finally:
        reader.cancel()
        await sub.aclose()
        await publisher.aclose()
        await proxy.close()
