"""Publisher: publish() never blocks the engine thread; losses are counted and announced."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
from kvbus.transports import Record
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus import Message, Resync, ResyncReason

from .conftest import collect, kv_payload


class StalledTransport(MemoryTransport):
    """memory:// whose appends hang (stalled) or fail (down) until released."""

    def __init__(self, url: str, mode: str) -> None:
        super().__init__(url)
        self.mode = mode
        self.released = threading.Event()
        self.attempts = 0

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        self.attempts += 1
        if not self.released.is_set():
            if self.mode == "down":
                raise ConnectionError("backend down")
            await asyncio.to_thread(self.released.wait)
        await super().append(stream, records)


def lost_seqs(items: list[object]) -> set[int]:
    out: set[int] = set()
    for i in items:
        if isinstance(i, Resync) and i.lost:
            out.update(range(i.lost[0], i.lost[1] + 1))
    return out


@pytest.mark.parametrize("mode", ["stalled", "down"])
def test_publish_never_blocks_and_losses_are_exact(memory_url: str, mode: str) -> None:
    transport = StalledTransport(memory_url, mode)
    publisher = kvbus.Publisher(
        memory_url, source="engine", max_queue=10, max_batch=4, transport=transport
    )
    # The backend stays stalled until every publish() call has returned: if publish()
    # blocked on the backend this loop could never finish.
    results = [publisher.publish(kv_payload(i)) for i in range(200)]
    assert not transport.released.is_set()
    assert results.count(False) == publisher.stats.dropped > 0
    # At most the queue bound plus one batch in the sender's hands (and SourceStarted).
    assert results.count(True) <= 10 + 4
    deadline = time.monotonic() + 10
    while transport.attempts < (2 if mode == "down" else 1) and time.monotonic() < deadline:
        time.sleep(0.01)  # let the backend outage be seen by the sender for real
    transport.released.set()
    assert publisher.flush()
    for i in range(200, 205):  # the next messages after the loss carry the gap marker
        assert publisher.publish(kv_payload(i))
    publisher.close()
    if mode == "down":
        assert publisher.stats.send_errors > 0
    items, sub = asyncio.run(collect(memory_url, gap_timeout=60))
    delivered = {i.seq for i in items if isinstance(i, Message)}
    lost = lost_seqs(items)
    total = 1 + 200 + 5 + 1  # SourceStarted, the stalled burst, the recovery, SourceStopped
    assert delivered | lost == set(range(1, total + 1)) and not delivered & lost
    assert len(lost) == publisher.stats.dropped
    assert all(i.reason is ResyncReason.DROPPED for i in items if isinstance(i, Resync))
    assert sub.stats.gaps_lost >= 1


def test_publish_from_many_threads_keeps_unique_seqs(memory_url: str) -> None:
    publisher = kvbus.Publisher(memory_url, source="engine", max_queue=100_000)

    def burst() -> None:
        for i in range(2_000):
            publisher.publish(kv_payload(i))

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    publisher.close()
    items, _ = asyncio.run(collect(memory_url))
    assert [i.seq for i in items if isinstance(i, Message)] == list(range(1, 8003))


def test_close_flushes_and_publish_after_close_is_dropped(memory_url: str) -> None:
    publisher = kvbus.Publisher(memory_url, source="engine")
    for i in range(1000):
        publisher.publish(kv_payload(i))
    publisher.close()
    assert publisher.stats.sent == 1002 and publisher.stats.dropped == 0
    assert publisher.publish(kv_payload(0)) is False
    assert publisher.stats.dropped == 1
    publisher.close()  # idempotent


def test_close_gives_up_on_a_dead_backend(memory_url: str) -> None:
    transport = StalledTransport(memory_url, "down")
    publisher = kvbus.Publisher(memory_url, source="engine", transport=transport)
    publisher.publish(kv_payload(1))
    publisher.close(timeout=0.3)
    assert publisher.stats.sent == 0 and publisher.stats.dropped == 3


async def test_oversized_message_is_dropped_and_announced(memory_url: str) -> None:
    async with kvbus.Publisher(memory_url, source="e", max_message_bytes=2048) as p:
        p.publish(kv_payload(1))
        p.publish(b"\x00" * 4096)
        p.publish(kv_payload(3))
    assert p.stats.dropped == 1
    items, _ = await collect(memory_url)
    assert Resync("e", p.epoch, ResyncReason.DROPPED, (3, 3)) in items


async def test_usable_from_asyncio(memory_url: str) -> None:
    async with kvbus.Publisher(memory_url, source="e") as p:
        assert p.publish(kv_payload(1))
        assert await p.aflush()
    items, _ = await collect(memory_url)
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 2, 3]


async def test_unencodable_payload_is_dropped_and_the_sender_survives(memory_url: str) -> None:
    async with kvbus.Publisher(memory_url, source="e") as p:
        p.publish(object())  # type: ignore[arg-type]
        p.publish(kv_payload(3))
    assert p.stats.dropped == 1
    items, _ = await collect(memory_url)
    assert Resync("e", p.epoch, ResyncReason.DROPPED, (2, 2)) in items
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 3, 4]
