"""zmq://: what a peer of the publishing process can make it spend (the endpoint lives in
the engine's process, so its memory and its thread are the engine's)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import zmq
import zmq.asyncio
from kvbus.transports import zmq as zmq_transport

import kvbus

from .conftest import kv_payload, last_seq_is, read_until, seqs
from .servers import free_port


def _server(port: int) -> zmq_transport._Server:
    return next(s for e, s in zmq_transport._servers.items() if e.port == port)


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
from kvbus.transports import zmq as zmq_transport
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
ring = next(iter(zmq_transport._servers.values()))._rings[b"kv\\0"]
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
