"""`kvbus.bus.follow.Follower`, the history-then-live-tail reader the router's bus followers,
``kvbus top`` and the compactor share: where it is caught up, that the live tail goes on
from there with nothing twice, bad items, a failing backend, ``accept`` and ``pause``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import pytest
from kvbus.transports import BackendUnusable, Entry, Position
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus.bus import follow
from kvbus.bus.follow import Follower
from kvbus.bus.subscription import Item, Message
from kvbus.wire.events import KVEventBatch

from .conftest import kv_payload


def publish(url: str, source: str, first: int, count: int) -> None:
    with kvbus.Publisher(url, stream="kv", source=source) as publisher:
        for n in range(first, first + count):
            publisher.publish(kv_payload(n))


def blocks(items: list[Item]) -> list[tuple[str, int | bytes]]:
    """The block each applied batch stored (`publish` stores one a batch), by source."""
    return [
        (i.source, i.body.events[0].block_hashes[0])
        for i in items
        if isinstance(i, Message) and isinstance(i.body, KVEventBatch)
    ]


async def test_replay_ends_caught_up_and_follow_goes_on_from_there(memory_url: str) -> None:
    publish(memory_url, "a", 0, 5)
    items: list[Item] = []
    ten = asyncio.Event()

    def apply(item: Item) -> None:
        items.append(item)
        if len(blocks(items)) == 10:
            ten.set()

    async with Follower("kv", memory_url, apply) as reader:
        cursor = await reader.replay()
        assert blocks(items) == [("a", h) for h in range(5)]  # all the history, no more
        assert reader.start == cursor == reader.cursor and reader.snapshot is False
        publish(memory_url, "c", 10, 3)
        publish(memory_url, "b", 20, 2)
        live = asyncio.create_task(reader.follow())
        await asyncio.wait_for(ten.wait(), 10)
        live.cancel()
        with pytest.raises(asyncio.CancelledError):
            await live
    assert blocks(items)[:5] == [("a", h) for h in range(5)]  # nothing twice
    assert sorted(blocks(items)[5:]) == [("b", 20), ("b", 21), ("c", 10), ("c", 11), ("c", 12)]


async def test_accept_and_bad_items(memory_url: str) -> None:
    publish(memory_url, "a", 0, 3)
    publish(memory_url, "b", 0, 3)
    applied: list[Item] = []
    bad: list[tuple[Item, Exception]] = []

    def apply(item: Item) -> None:
        if blocks([item]) == [("a", 1)]:
            raise ValueError("bad")
        applied.append(item)

    reader = Follower(
        "kv",
        memory_url,
        apply,
        accept=lambda s: s == "a",
        on_bad_item=lambda i, e: bad.append((i, e)),
    )
    async with reader:
        await reader.replay()
    assert blocks(applied) == [("a", 0), ("a", 2)]
    assert [(blocks([i]), str(e)) for i, e in bad] == [([("a", 1)], "bad")]
    async with Follower("kv", memory_url, apply) as reader:  # no on_bad_item: the read fails
        with pytest.raises(ValueError, match="bad"):
            await reader.replay()


class _UnusableOnce(MemoryTransport):
    """A memory bus whose first read says the backend cannot serve it."""

    reads = 0

    async def read_pages(  # type: ignore[override]
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        type(self).reads += 1
        if type(self).reads == 1:
            raise BackendUnusable("enable JetStream")
        async for page in super().read_pages(stream, after, follow=follow):
            yield page


async def test_a_failing_backend_is_raised_or_with_retry_log_read_again(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(memory_url, "a", 0, 3)
    items: list[Item] = []
    async with Follower("kv", memory_url, items.append, transport=_UnusableOnce(memory_url)) as r:
        with pytest.raises(BackendUnusable):
            await r.replay()
    monkeypatch.setattr(follow, "BACKEND_RECHECK", 0.0)
    _UnusableOnce.reads = 0
    transport = _UnusableOnce(memory_url)
    retry_log = logging.getLogger("test_follow")
    async with Follower(
        "kv", memory_url, items.append, transport=transport, retry_log=retry_log
    ) as r:
        await r.replay()
    assert _UnusableOnce.reads == 2 and blocks(items) == [("a", 0), ("a", 1), ("a", 2)]


async def test_pause_holds_the_next_item_until_released(memory_url: str) -> None:
    publish(memory_url, "a", 0, 3)
    pause = asyncio.Lock()
    items: list[Item] = []
    async with Follower("kv", memory_url, items.append, pause=pause) as reader:
        await pause.acquire()
        replay = asyncio.create_task(reader.replay())
        await asyncio.sleep(0.2)
        assert items == []  # a writer holds the lock: the cursor and the state agree
        pause.release()
        await replay
    assert blocks(items) == [("a", 0), ("a", 1), ("a", 2)]
