"""zmq://: what a peer of the publishing process can make it spend (the endpoint lives in
the engine's process, so its memory and its thread are the engine's)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest
import zmq
import zmq.asyncio
from kvbus.transports import zmq as zmq_transport
from kvbus.transports import zmq_server

import kvbus
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode
from kvbus.wire.snapshot import SourceFold

from .conftest import kv_payload, last_seq_is, read_until, seqs
from .servers import free_port


def _server(port: int) -> zmq_server.Server:
    return next(s for e, s in zmq_server.servers.items() if e.port == port)


async def test_hostile_replay_requests_are_refused_and_the_endpoint_lives() -> None:
    """A 5,000-digit position used to kill the endpoint's thread: subscribers went
    silent and the engine's outbox grew."""
    port = free_port(pair=True)
    url = f"zmq://127.0.0.1:{port}?timeout=1"
    publisher = kvbus.Publisher(url, source="engine")
    publisher.publish(kv_payload(1))
    assert publisher.flush()
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port + 1}")
    await dealer.send_multipart([b"x"])
    await dealer.send_multipart([b"1", b"kv", b"", b"extra"])
    for after in (b"9" * 21, b"-1", b"1e9", str(2**64).encode(), b"9" * 5000):
        await dealer.send_multipart([b"1", b"kv", after])
    await asyncio.sleep(0.3)
    dealer.close(0)
    # The last one is over 1 KiB: ZeroMQ cuts the peer off before anything parses it.
    assert _server(port).refused_requests == 6
    publisher.publish(kv_payload(2))
    assert publisher.flush()
    items = [i async for i in kvbus.subscribe(url=url, follow=False)]
    assert seqs(items) == [1, 2, 3]
    publisher.close()


async def test_a_peer_flooding_replay_requests_gets_one_replay() -> None:
    """100k replay requests never read used to queue 100k replays, each stepped in turn
    ahead of the live stream."""
    port = free_port(pair=True)
    url = f"zmq://127.0.0.1:{port}?timeout=1"
    publisher = kvbus.Publisher(url, source="engine", max_batch=1)
    for i in range(2000):  # 8 MB of history: more than the socket buffers take
        publisher.publish(kv_payload(i, blocks=256))
    assert publisher.flush()
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect(f"tcp://127.0.0.1:{port + 1}")
    for n in range(20_000):
        await dealer.send_multipart([str(n).encode(), b"kv", b""])
    await asyncio.sleep(0.5)
    assert len(_server(port)._replays) == 1
    sub = kvbus.subscribe(url=url, cursor="latest")
    reader = asyncio.create_task(read_until(sub, last_seq_is("engine", 2002), timeout=20))
    await asyncio.sleep(0.5)
    publisher.publish(kv_payload(9999))
    items = await reader
    assert seqs(items)[-1] == 2002
    await sub.aclose()
    dealer.close(0)
    publisher.close()


_NEVER_READS = """
import resource, sys, time, zmq, kvbus
from kvbus.transports import zmq_server
port = int(sys.argv[1])
def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()
publisher = kvbus.Publisher(f"zmq://127.0.0.1:{port}", source="engine", max_queue=100_000)
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.RCVHWM, 1)
sub.connect(f"tcp://127.0.0.1:{port}")
sub.setsockopt(zmq.SUBSCRIBE, b"")
time.sleep(0.3)
before, payload = rss(), bytes(20_000)
for _ in range(45):
    for _ in range(1000):
        publisher.publish(payload)
    assert publisher.flush(30)
ring = next(iter(zmq_server.servers.values()))._rings[b"kv\\0"]
print(rss() - before, ring.bytes, publisher.stats.dropped)
"""


def test_a_subscriber_that_never_reads_costs_bounded_memory() -> None:
    """45k x 20 KB messages with one subscriber that never reads: the publishing
    process (its own, so that nothing else moves its memory) used to grow by all of it
    (1.17 GB after 60k): the high-water mark counted packs of up to 512 messages, the
    ring counted messages, and packs waiting for the sending thread were not counted."""
    run = subprocess.run(
        [sys.executable, "-c", _NEVER_READS, str(free_port(pair=True))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    grown, ring_bytes, dropped = map(int, run.stdout.split())
    assert dropped == 0 and ring_bytes <= zmq_transport.DEFAULT_RING_BYTES
    # 900 MB were published; what stays is the ring (64 MiB), 16 MiB not yet sent, 16
    # MiB queued for the subscriber, and what the allocator keeps of freed memory.
    assert grown < 200 * 1024 * 1024, grown


async def _ask_for_snapshots(port: int, peers: int, each: int) -> int:
    """``peers`` peers (their own connections) each ask ``each`` times at once; returns
    how many requests were answered (an end marker) before the endpoint fell silent."""
    context = zmq.asyncio.Context.instance()
    dealers = [context.socket(zmq.DEALER) for _ in range(peers)]
    answered = 0
    try:
        for dealer in dealers:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{port + 1}")
            for n in range(each):
                await dealer.send_multipart([str(n).encode(), b"kv", b"snapshots"])
        for dealer in dealers:
            while True:
                try:
                    reply = await asyncio.wait_for(dealer.recv_multipart(), 1.0)
                except TimeoutError:
                    break
                answered += reply[1] == b"E"
                if answered == peers * each:
                    break
    finally:
        for dealer in dealers:
            dealer.close(0)
    return answered


async def test_snapshot_requests_do_not_each_fold_the_engines_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every unauthenticated snapshot request used to take every snapshot anew, in the
    engine's process and under the endpoint's lock (280 ms at 50k blocks). Snapshots
    are now taken again only when the publishing paid for it (as many blocks folded as
    are held), and a consumer starting from older ones still gets the exact state."""
    taken = 0
    events = SourceFold.events

    def counted(fold: SourceFold) -> list[Any]:
        nonlocal taken
        taken += 1
        return events(fold)

    monkeypatch.setattr(SourceFold, "events", counted)
    port = free_port(pair=True)
    url = f"zmq://127.0.0.1:{port}?timeout=1&snapshots=1"
    publisher = kvbus.Publisher(url, source="engine", max_batch=1)
    truth = PrefixIndex()

    def publish(first_hash: int, blocks: int) -> None:
        batch = KVEventBatch(0.0, [BlockStored(
            list(range(first_hash, first_hash + blocks)), None,
            list(range(first_hash * 4, (first_hash + blocks) * 4)), 4, None, "GPU", None,
        )])  # fmt: skip
        publisher.publish(encode(batch))
        truth.apply_events("engine", batch.events)
        assert publisher.flush()

    for n in range(100):
        publish(n * 1000, 20)  # 2,000 blocks held
    for n in range(30):  # 30 peers, the folds changed by one block before each
        publish(10**6 + n * 1000, 1)
        assert await _ask_for_snapshots(port, peers=1, each=1) == 1
    assert taken == 1
    # A consumer starting from those snapshots (30 blocks behind) reads the rest from
    # the ring: the same state as one that saw everything.
    consumer = PrefixIndex()
    async for item in kvbus.subscribe(url=url, follow=False, snapshot=True):
        consumer.apply(item)
    assert consumer.blocks("engine") == truth.blocks("engine")
    assert len(truth.blocks("engine")) == 2030
    # Every block evicted: the folds changed by more blocks than they hold (the
    # recently evicted included): taken again.
    removed = KVEventBatch(0.0, [BlockRemoved(sorted(truth.blocks("engine")), "GPU")])
    publisher.publish(encode(removed))
    assert publisher.flush()
    assert await _ask_for_snapshots(port, peers=1, each=1) == 1
    assert taken == 2
    publisher.close()


async def test_a_peer_flooding_snapshot_requests_is_refused() -> None:
    """One peer's 50 snapshot requests at once used to be answered 50 times, each
    with every snapshot (a 100-byte request, megabytes sent)."""
    port = free_port(pair=True)
    url = f"zmq://127.0.0.1:{port}?timeout=1&snapshots=1"
    publisher = kvbus.Publisher(url, source="engine")
    publisher.publish(kv_payload(1, blocks=16))
    assert publisher.flush()
    started = time.monotonic()
    answered = await _ask_for_snapshots(port, peers=1, each=50)
    refills = int(time.monotonic() - started) + 1  # one more each second, at most
    server = _server(port)
    assert answered + server.refused_requests == 50
    assert 4 <= answered <= 4 + refills  # the burst, then one a second
    # Another peer is served as before: its snapshot holds the 16 blocks.
    snapshots = await kvbus.transports.open_transport(url).get_snapshots("kv")
    assert set(snapshots) == {"engine", "_cursor"}
    publisher.close()
