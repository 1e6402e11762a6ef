"""Issue 28, the subscriber's share: what one gap-opening message may cost (history read,
snapshots read and decoded, sources tracked, bytes held back, log lines). Each test
reproduces a finding against memory:// (the logic is the subscriber's, the same on
every transport) and counts the work done rather than timing it."""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from kvbus.transports import Entry, Position
from kvbus.transports.memory import MemoryTransport

import kvbus
import kvbus.logs
from kvbus import Message, Resync, ResyncReason
from kvbus.logs import LimitedLog
from kvbus.wire.events import KVEventBatch
from kvbus.wire.snapshot import CURSOR_NAME, Snapshot, encode_snapshot

from .conftest import append_raw, collect, envelope, kv_payload, read_until, seqs

# The module, not the function `kvbus.subscribe` that its name is shadowed by.
subscribe_module = importlib.import_module("kvbus.bus.subscription")
EPOCH = time.time_ns() - 3600 * 10**9  # a source that started an hour ago
SMALL = kv_payload(0)  # one block
KIB_100 = kv_payload(0, blocks=2000)  # about 100 KiB
KIB_300 = kv_payload(0, blocks=6000)  # about 360 KiB


class CountingTransport(MemoryTransport):
    """memory://, counting the entries read live and those read back from history (gap
    searches), the history reads, and the reads of the stored snapshots. History is
    handed over an entry at a time, as a backend with small pages would: what is
    counted is what the subscriber asked for."""

    live_entries = 0
    history_entries = 0
    history_reads = 0
    snapshot_reads = 0

    def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        if not follow:
            self.history_reads += 1
        return self._counted(super().read_pages(stream, after, follow=follow), follow)

    async def _counted(
        self, pages: AsyncIterator[Sequence[Entry]], live: bool
    ) -> AsyncIterator[Sequence[Entry]]:
        async for page in pages:
            if live:
                self.live_entries += len(page)
                yield page
                continue
            for entry in page:
                self.history_entries += 1
                yield [entry]

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        self.snapshot_reads += 1
        return await super().get_snapshots(stream)


def resynced(source: str, items: list[Any]) -> bool:
    return any(isinstance(i, Resync) and i.source == source for i in items)


# --- 1. a gap costs a bounded history search ------------------------------------------


async def test_a_gap_search_stops_at_the_message_that_opened_it(memory_url: str) -> None:
    """Seq 2 of "a" is lost for good; 3 opened the gap, and a thousand entries of
    another source came after it. The search reads from "a"'s last position to 3, once:
    it used to read on to the live position, and all of it again when the gap expired."""
    filler = [envelope("f", EPOCH, s, SMALL) for s in range(1, 1001)]
    await append_raw(memory_url, [envelope("a", EPOCH, 1), envelope("a", EPOCH, 3), *filler])
    transport = CountingTransport(memory_url)
    sub = kvbus.subscribe(url=memory_url, transport=transport, gap_timeout=0.05)
    items = await read_until(sub, lambda got: len(seqs(got)) == 1002)
    await sub.aclose()
    assert Resync("a", EPOCH, ResyncReason.GAP, (2, 2)) in items
    assert seqs(items, "a") == [1, 3] and len(seqs(items, "f")) == 1000
    assert transport.history_reads == 1
    assert transport.history_entries <= 2  # entries from the gap to its opener
    assert sub.stats.repair_entries == transport.history_entries


class LossyLiveTransport(CountingTransport):
    """A live path that loses the entry at position 2 (history still has it)."""

    def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        pages = super().read_pages(stream, after, follow=follow)
        return self._lossy(pages) if follow else pages

    async def _lossy(self, pages: AsyncIterator[Sequence[Entry]]) -> AsyncIterator[Sequence[Entry]]:
        async for page in pages:
            kept = [entry for entry in page if entry.position != 2]
            if kept:
                yield kept


async def test_a_message_lost_on_the_live_path_is_still_found_in_history(
    memory_url: str,
) -> None:
    filler = [envelope("f", EPOCH, s, SMALL) for s in range(1, 501)]
    await append_raw(memory_url, [envelope("a", EPOCH, s) for s in (1, 2, 3)] + filler)
    transport = LossyLiveTransport(memory_url)
    sub = kvbus.subscribe(url=memory_url, transport=transport, gap_timeout=30)
    items = await read_until(sub, lambda got: len(seqs(got)) == 503)
    await sub.aclose()
    assert seqs(items, "a") == [1, 2, 3] and not [i for i in items if isinstance(i, Resync)]
    assert sub.stats.gaps_repaired == 1 and transport.history_entries <= 2


async def test_gap_opening_messages_cost_one_history_entry_each_beyond_an_allowance(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of 20 sources spoke once, 3,000 entries ago; then a message of each opens a
    gap. Each used to cost two reads of those 3,000 entries (once when the gap opened,
    once when it expired): O(history) per hostile message. Now gap searches read at most
    one history entry per entry read live, beyond an allowance (500 here)."""
    allowance, sources, history = 500, 20, 3000
    monkeypatch.setattr(subscribe_module, "_REPAIR_ALLOWANCE", allowance, raising=False)
    old = [f"old{n}" for n in range(sources)]
    filler = [envelope("f", EPOCH, s, SMALL) for s in range(1, history + 1)]
    await append_raw(memory_url, [envelope(name, EPOCH, 1) for name in old] + filler)
    transport = CountingTransport(memory_url)
    sub = kvbus.subscribe(url=memory_url, transport=transport, gap_timeout=0.02)
    await read_until(sub, lambda got: len(seqs(got)) == sources + history)
    read_before, live_before = transport.history_entries, transport.live_entries
    for name in old:  # one at a time: each gap searched and expired before the next
        await append_raw(memory_url, [envelope(name, EPOCH, 3)])
        got = await read_until(sub, lambda got: len(seqs(got)) == 1)
        assert got == [Resync(name, EPOCH, ResyncReason.GAP, (2, 2)), got[-1]]
        assert isinstance(got[-1], Message) and got[-1].seq == 3
    await sub.aclose()
    live = transport.live_entries - live_before
    assert live == sources
    assert transport.history_entries - read_before <= allowance + live
    assert sub.stats.repairs_limited >= 1


# --- 2. snapshot mode: an expiring gap reads only what it needs ------------------------


async def test_gap_expiries_do_not_read_and_decode_every_snapshot(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every gap expiry used to read all stored snapshots and decode each one (430 ms
    for 50 of 10k blocks): now they are read at most once a second (once here: the
    window is widened to make the count exact), and only the involved sources'
    snapshots are decoded, only when they cover the gap."""
    monkeypatch.setattr(subscribe_module, "_SNAPSHOTS_REUSED_FOR", 3600.0, raising=False)
    decoded: list[bytes] = []
    decode = subscribe_module.decode_kv_batch

    def counting_decode(payload: bytes) -> Any:
        decoded.append(payload)
        return decode(payload)

    monkeypatch.setattr(subscribe_module, "decode_kv_batch", counting_decode)
    names = [f"engine-{n}" for n in range(20)]
    transport = CountingTransport(memory_url)
    for name in names:
        snapshot = Snapshot(name, EPOCH, 10, None, 0.0, kv_payload(0, blocks=64))
        await transport.put_snapshot("kv", name, encode_snapshot(snapshot))
    await transport.put_snapshot("kv", CURSOR_NAME, kvbus.Cursor().to_bytes())
    sub = kvbus.subscribe(url=memory_url, transport=transport, snapshot=True, gap_timeout=0.02)
    start = await read_until(sub, lambda got: len(got) == len(names))
    assert {m.source for m in start if isinstance(m, Message)} == set(names)
    assert transport.snapshot_reads == 1 and len(decoded) == len(names)
    for name in names[:5]:  # seq 11 lost: a gap no snapshot covers (they are at 10)
        await append_raw(memory_url, [envelope(name, EPOCH, 12)])
        got = await read_until(sub, lambda got: len(seqs(got)) == 1)
        assert got[0] == Resync(name, EPOCH, ResyncReason.GAP, (11, 11))
    await sub.aclose()
    assert transport.snapshot_reads == 1 and len(decoded) == len(names)


async def test_a_gap_a_snapshot_covers_decodes_only_that_snapshot(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[bytes] = []
    decode = subscribe_module.decode_kv_batch

    def counting_decode(payload: bytes) -> Any:
        decoded.append(payload)
        return decode(payload)

    monkeypatch.setattr(subscribe_module, "decode_kv_batch", counting_decode)
    transport = CountingTransport(memory_url)
    payloads = [kv_payload(n) for n in range(20)]
    for n, payload in enumerate(payloads):
        snapshot = Snapshot(f"engine-{n}", EPOCH, 10, None, 0.0, payload)
        await transport.put_snapshot("kv", f"engine-{n}", encode_snapshot(snapshot))
    # Started from a cursor (not the snapshots): engine-3 is first seen at seq 11, the
    # one after its snapshot.
    await append_raw(memory_url, [envelope("engine-3", EPOCH, 11)])
    start = kvbus.Cursor(position=0)
    items, _ = await collect(
        memory_url, transport=transport, snapshot=True, cursor=start, gap_timeout=0.02
    )
    assert items[0] == Resync("engine-3", EPOCH, ResyncReason.JOINED)  # nothing lost
    assert [(i.source, i.seq) for i in items[1:]] == [("engine-3", 10), ("engine-3", 11)]
    assert isinstance(items[1], Message) and isinstance(items[1].body, KVEventBatch)
    assert transport.snapshot_reads == 1 and decoded == [payloads[3]]


# --- 3. every tracked source counts against max_sources --------------------------------


async def test_sources_holding_messages_back_count_against_max_sources(
    memory_url: str,
) -> None:
    """20,000 sources whose first message opens a gap (seq 2) used to be tracked all
    (none could be evicted), each new one scanning them all. Now the least recently
    active is forgotten, its gap declared lost first: nothing it held goes unannounced."""
    count, limit = 20_000, 1_000
    await append_raw(memory_url, [envelope(f"s{n}", EPOCH, 2, SMALL) for n in range(count)])
    async with asyncio.timeout(60):  # liveness: a quadratic scan would take minutes
        items, sub = await collect(memory_url, max_sources=limit, gap_timeout=3600)
    assert sub.stats.evicted_sources == count - limit
    assert len(sub.cursor.sources) <= limit
    # Forgotten or expired at the end, every source's gap was announced, then its message.
    for n in (0, count - limit - 1, count - 1):
        mine = [i for i in items if i.source == f"s{n}"]
        assert mine[0] == Resync(f"s{n}", EPOCH, ResyncReason.JOINED, (1, 1))
        assert seqs(mine) == [2]


async def test_eviction_forgets_the_least_recently_active(memory_url: str) -> None:
    """ "keep" speaks between every new source: it stays tracked, the idle ones go."""
    data = []
    for n in range(300):
        data += [envelope(f"s{n}", EPOCH, 1, SMALL), envelope("keep", EPOCH, n + 1, SMALL)]
    await append_raw(memory_url, data)
    items, sub = await collect(memory_url, max_sources=50)
    assert seqs(items, "keep") == list(range(1, 301))
    assert not [i for i in items if isinstance(i, Resync)]
    tracked = sub.cursor.sources
    assert "keep" in tracked and "s299" in tracked and "s0" not in tracked
    assert len(tracked) <= 50 and sub.stats.evicted_sources == 301 - 50


# --- 4. held-back messages are capped in bytes ---------------------------------------


async def test_held_back_messages_are_capped_in_bytes(memory_url: str) -> None:
    """One missing seq before 40 messages of 100 KiB: with max_held_bytes=1 MiB the gap
    is declared lost (a Resync) once they pass 1 MiB, long before gap_timeout, and the
    rest flows. Before, 400 x 0.7 MiB messages held 285 MiB back for an hour."""
    big = [envelope("a", EPOCH, s, KIB_100) for s in (1, *range(3, 43))]
    await append_raw(memory_url, big)
    sub = kvbus.subscribe(url=memory_url, gap_timeout=3600, max_held_bytes=2**20)
    items = await read_until(sub, lambda got: len(seqs(got)) == 41)
    assert items[1] == Resync("a", EPOCH, ResyncReason.GAP, (2, 2))
    assert seqs(items) == [1, *range(3, 43)]
    assert sub.stats.gaps_declared_early == 1
    assert sub.backlog == 0
    await sub.aclose()


async def test_the_bytes_cap_declares_the_oldest_gap_first(memory_url: str) -> None:
    small = [envelope("old", EPOCH, s, SMALL) for s in (1, 3)]  # opens the first gap
    big = [envelope("big", EPOCH, s, KIB_300) for s in (1, *range(3, 8))]
    await append_raw(memory_url, small + big)
    sub = kvbus.subscribe(url=memory_url, gap_timeout=3600, max_held_bytes=2**20)
    items = await read_until(sub, lambda got: resynced("big", got))
    await sub.aclose()
    resyncs = [i for i in items if isinstance(i, Resync)]
    assert resyncs == [
        Resync("old", EPOCH, ResyncReason.GAP, (2, 2)),
        Resync("big", EPOCH, ResyncReason.GAP, (2, 2)),
    ]
    assert sub.stats.gaps_declared_early == 2


# --- 5. resyncs are logged at a bounded rate ------------------------------------------


async def test_resyncs_are_logged_at_most_once_a_second_per_reason(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """10,000 messages, each seq one past a missing one: 10,000 resyncs used to be
    10,000 INFO lines. (A fresh limiter whose second lasts an hour, so that the count is exact.)"""
    monkeypatch.setattr(
        subscribe_module, "_limited", LimitedLog(subscribe_module.log, interval=3600)
    )
    await append_raw(memory_url, [envelope("a", EPOCH, s, SMALL) for s in range(2, 20_001, 2)])
    with caplog.at_level(logging.INFO, logger="kvbus.bus.subscription"):
        items, sub = await collect(memory_url, gap_timeout=0)
    assert sum(isinstance(i, Resync) for i in items) == sub.stats.resyncs == 10_000
    lines = [r for r in caplog.records if "resync" in r.getMessage()]
    assert len(lines) == 1  # one GAP (a source joining is logged at DEBUG: not news)
    assert len([r for r in caplog.records if "joined at seq" in r.getMessage()]) == 0


def test_a_limited_log_says_how_many_lines_it_held_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(kvbus.logs, "time", SimpleNamespace(monotonic=lambda: now[0]))
    limited = LimitedLog(logging.getLogger("kvbus.test_limited"))
    with caplog.at_level(logging.INFO, logger="kvbus.test_limited"):
        for n in range(5):
            limited.info("resync", "resync %d", n)
        now[0] += 1.0
        limited.info("resync", "resync %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "resync 0",
        "resync 5 (and 4 more like it since the previous one shown)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


class ReaderKilled(BaseException):
    """What no retry catches (a BaseException, as a cancel from inside the client is)."""


class DyingTransport(MemoryTransport):
    """Reads one page, then its reader dies of something that is not retried."""

    def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        return self._dying(super().read_pages(stream, after, follow=follow))

    async def _dying(self, pages: AsyncIterator[Sequence[Entry]]) -> AsyncIterator[Sequence[Entry]]:
        async for page in pages:
            yield page
            raise ReaderKilled


async def test_a_reader_that_dies_is_raised_to_the_consumer_not_a_silent_hang(
    memory_url: str,
) -> None:
    await append_raw(memory_url, [envelope("a", EPOCH, 1)])
    sub = kvbus.subscribe(url=memory_url, transport=DyingTransport(memory_url), follow=True)
    items: list[Any] = []
    with pytest.raises(ReaderKilled):
        async with asyncio.timeout(30):  # it used to wait for ever
            async for item in sub:
                items.append(item)
    await sub.aclose()
    assert seqs(items, "a") == [1]


async def test_a_snapshot_stored_under_another_name_is_not_a_start(memory_url: str) -> None:
    """A snapshot stored under "mallory" claiming engine-a's seq 5 was delivered after
    engine-a's own (seq 10) and replaced its state; only a source's own name counts."""
    transport = MemoryTransport(memory_url)
    own = Snapshot("engine-a", EPOCH, 10, None, 0.0, kv_payload(1))
    forged = Snapshot("engine-a", EPOCH, 5, None, 0.0, kv_payload(2))
    await transport.put_snapshot("kv", "engine-a", encode_snapshot(own))
    await transport.put_snapshot("kv", "mallory", encode_snapshot(forged))
    await transport.put_snapshot("kv", CURSOR_NAME, kvbus.Cursor().to_bytes())
    items, _ = await collect(memory_url, transport=transport, snapshot=True)
    assert [(i.source, i.seq) for i in items if isinstance(i, Message)] == [("engine-a", 10)]
