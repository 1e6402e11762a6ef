"""What a subscription costs whatever numbers and how many sources the stream carries:
each test is a reproduction of an attack or an unlucky fleet, run against memory://
(the logic is the subscriber's, the same on every transport)."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

from kvbus.transports import Entry, Position
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus import Resync, ResyncReason

from .conftest import append_raw, collect, envelope, seqs

EPOCH = time.time_ns() - 3600 * 10**9  # a source that started an hour ago


async def test_joining_at_seq_30_million_costs_no_memory(memory_url: str) -> None:
    """A source first seen at seq N used to cost set(range(1, N)): 3 GB at N=30M."""
    await append_raw(
        memory_url, [envelope("a", EPOCH, 30_000_000), envelope("a", EPOCH, 30_000_001)]
    )
    tracemalloc.start()
    try:
        items, _ = await collect(memory_url, gap_timeout=0.05)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert items[0] == Resync("a", EPOCH, ResyncReason.JOINED, (1, 29_999_999))
    assert seqs(items) == [30_000_000, 30_000_001]
    assert peak < 2_000_000


async def test_a_forged_huge_seq_or_future_epoch_is_rejected(memory_url: str) -> None:
    """Seq 2**64-1 or epoch 2**64-1 under a real source's name would have made every
    later real message a duplicate or stale, for good."""
    now = time.time_ns()
    forged = [
        envelope("a", EPOCH, 2**64 - 1),
        envelope("a", 2**64 - 1, 1),
        envelope("a", now + 3600 * 10**9, 1),  # an hour ahead of this clock
        envelope("a", EPOCH, 3, lost_from=2**63),
        envelope("x" * 201, EPOCH, 1),
    ]
    real = [envelope("a", EPOCH, s) for s in (1, 2, 3)]
    await append_raw(memory_url, [real[0], *forged, *real[1:]])
    items, sub = await collect(memory_url)
    assert seqs(items) == [1, 2, 3] and not [i for i in items if isinstance(i, Resync)]
    assert sub.stats.implausible == 2 + 1 + 2
    # A clock a little behind the publisher's is fine (max_clock_skew, 60 s by default).
    await append_raw(memory_url, [envelope("b", now + 10 * 10**9, 1)])
    items, _ = await collect(memory_url)
    assert seqs(items, "b") == [1]


class CountingTransport(MemoryTransport):
    """memory://, counting the reads a subscription makes."""

    reads = 0

    def read(self, stream: str, after: Position | None = None, *, follow: bool = False) -> Any:
        self.reads += 1
        return super().read(stream, after, follow=follow)


async def test_two_thousand_sources_joined_mid_epoch_take_one_history_pass(
    memory_url: str,
) -> None:
    """Each source starting at seq 2 used to cost one full history read: minutes."""
    await append_raw(memory_url, [envelope(f"s{n}", EPOCH, 2) for n in range(2000)])
    transport = CountingTransport(memory_url)
    items, _ = await collect(memory_url, transport=transport, gap_timeout=0.2)
    assert len(seqs(items)) == 2000
    assert sum(isinstance(i, Resync) and i.reason is ResyncReason.JOINED for i in items) == 2000
    assert transport.reads <= 3  # the live read, and one pass per expired wave of gaps


async def test_sources_beyond_max_sources_are_forgotten_least_recent_first(
    memory_url: str,
) -> None:
    await append_raw(memory_url, [envelope(f"s{n}", EPOCH, 1) for n in range(1000)])
    sub = kvbus.subscribe(url=memory_url, follow=False, max_sources=100)
    items = [item async for item in sub]
    assert len(seqs(items)) == 1000
    assert len(sub.cursor.sources) <= 100 and sub.stats.evicted_sources >= 900
    assert "s999" in sub.cursor.sources and "s0" not in sub.cursor.sources
    # A forgotten source that comes back starts over: a JOINED resync, nothing lost.
    await append_raw(memory_url, [envelope("s0", EPOCH, 2)])
    more = [item async for item in kvbus.subscribe(url=memory_url, cursor=sub.cursor, follow=False)]
    assert more[0] == Resync("s0", EPOCH, ResyncReason.JOINED, (1, 1))
    assert seqs(more) == [2]
    await sub.aclose()


class SenderTransport(MemoryTransport):
    """memory:// whose entries name an authenticated sender, as NATS's subjects do."""

    async def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        async for entry in super().read(stream, after, follow=follow):
            sender = "a" if int(entry.position) % 2 else "evil"
            yield Entry(entry.position, entry.data, sender)


async def test_an_envelope_claiming_another_sender_is_rejected(memory_url: str) -> None:
    # Odd positions come from "a", even ones from "evil", which claims to be "a".
    data = [envelope("a", EPOCH, 1), envelope("a", EPOCH, 2), envelope("a", EPOCH, 2)]
    data.append(envelope("evil", EPOCH, 1))
    await append_raw(memory_url, data)
    items, sub = await collect(memory_url, transport=SenderTransport(memory_url))
    assert seqs(items, "a") == [1, 2] and seqs(items, "evil") == [1]
    assert sub.stats.forged == 1


async def test_a_flood_of_held_messages_declares_the_gap_at_once(memory_url: str) -> None:
    """A source that never fills its gap holds at most 65,536 messages back."""
    data = [envelope("a", EPOCH, s, b"") for s in range(2, 70_002)]
    await append_raw(memory_url, data)
    sub = kvbus.subscribe(url=memory_url, follow=False, gap_timeout=3600)
    first = await sub.__anext__()  # long before the hour is up
    assert first == Resync("a", EPOCH, ResyncReason.JOINED, (1, 1))
    await sub.aclose()


async def test_read_ahead_is_bounded_in_bytes(memory_url: str) -> None:
    """The reader runs ahead of a slow consumer by at most 64 MiB, not 1,024 entries of
    up to 16 MiB each."""
    big = [envelope("a", EPOCH, s, bytes(2**20)) for s in range(1, 201)]  # 200 MiB
    await append_raw(memory_url, big)
    sub = kvbus.subscribe(url=memory_url, follow=False)
    await sub.__anext__()  # starts the reader; then the consumer stalls
    await asyncio.sleep(0.5)
    assert 0 < sub._read_ahead.size <= 65 * 2**20
    await sub.aclose()
