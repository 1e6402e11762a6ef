"""redis://: a forged entry id and a server that stops answering (real redis-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio as redis
from kvbus.transports import Record, open_transport

import kvbus

from .conftest import envelope, kv_payload, seqs
from .servers import RedisServer

EPOCH = time.time_ns() - 10**9


async def test_an_entry_forged_with_the_last_possible_id_does_not_stop_publishers(
    redis_server: RedisServer,
) -> None:
    """One ``XADD`` with id 2**64-1-2**64-1 used to make every later ``XADD *`` fail for
    good (the publisher ended at sent=11, dropped=1000)."""
    publisher = kvbus.Publisher(redis_server.url, stream="forged", source="engine")
    for i in range(10):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    client = redis.Redis.from_url(redis_server.url)
    await client.xadd(
        "kvbus:forged", {"d": b"evil"}, id="18446744073709551615-18446744073709551615"
    )
    for i in range(10, 1010):
        publisher.publish(kv_payload(i))
    assert await publisher.aflush(20)
    assert publisher.stats.dropped == 0 and publisher.stats.sent == 1011
    sub = kvbus.subscribe("forged", redis_server.url, follow=False)
    items = [i async for i in sub]
    assert seqs(items) == list(range(1, 1012))
    await client.aclose()
    await publisher.aclose()


async def test_a_stopped_server_is_a_counted_timeout_not_a_hang(tmp_path: Path) -> None:
    """With the server stopped (SIGSTOP) the sender used to block for ever, with
    ``send_errors`` at 0; now each call times out, is counted and retried, and nothing
    is lost once the server runs again."""
    server = RedisServer(tmp_path)
    server.start()
    assert server.process is not None
    url = f"{server.url}?socket_timeout=0.5"
    publisher = kvbus.Publisher(url, source="engine")
    try:
        publisher.publish(kv_payload(0))
        assert await publisher.aflush()
        os.kill(server.process.pid, signal.SIGSTOP)
        for i in range(1, 100):
            publisher.publish(kv_payload(i))
        for _ in range(100):
            if publisher.stats.send_errors >= 2:
                break
            await asyncio.sleep(0.1)
        assert publisher.stats.send_errors >= 2
        os.kill(server.process.pid, signal.SIGCONT)
        assert await publisher.aflush(10)
        items = [i async for i in kvbus.subscribe(url=url, follow=False)]
        assert seqs(items) == list(range(1, 102))  # SourceStarted and 100 batches
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        await publisher.aclose()
        server.stop()


@pytest.mark.parametrize("protocol", [2, 3])
async def test_entries_read_alike_over_resp2_and_resp3_whatever_their_fields(
    redis_server: RedisServer, protocol: int
) -> None:
    """The transport parses replies as the server sends them (no redis-py callbacks):
    entries of one envelope and packs, history and the live tail, over either RESP
    version; an entry someone else wrote with other fields is one malformed message."""
    stream = f"resp{protocol}"
    url = f"{redis_server.url}?protocol={protocol}"
    client = redis.Redis.from_url(redis_server.url)
    publisher = kvbus.Publisher(url, stream=stream, source="engine")
    publisher.publish(kv_payload(1))  # alone in its entry, or packed with SourceStarted
    assert await publisher.aflush()
    await client.xadd(f"kvbus:{stream}", {"other": b"x", "more": b"y"})
    for i in range(2, 5):
        publisher.publish(kv_payload(i))
    assert await publisher.aflush()
    sub = kvbus.subscribe(stream, url)
    items = []
    async for item in sub:
        items.append(item)
        if len(items) == 5:
            publisher.publish(kv_payload(5))  # read from the live tail (XREAD)
        if len(items) == 6:
            break
    assert seqs(items) == list(range(1, 7))
    assert sub.stats.malformed == 1
    await sub.aclose()
    await publisher.aclose()
    await client.aclose()


@pytest.mark.parametrize("follow", [False, True])
async def test_a_consumer_leaving_mid_read_is_not_kept_waiting(
    redis_server: RedisServer, follow: bool
) -> None:
    """redis-py can swallow a cancellation that lands mid-command: a subscription closed
    while its reader waited for the next page of history used to go on reading, then
    wait for ever for its consumer to make room (the consumer's ``async with`` hung)."""
    stream = f"leave{follow}"
    transport = open_transport(redis_server.url)
    records = [
        Record("engine", f"engine:{EPOCH}:{seq}", envelope("engine", EPOCH, seq, kv_payload(seq)))
        for seq in range(1, 10_001)
    ]
    for first in range(0, len(records), 512):  # as a publisher under load: 512 an entry
        await transport.append(stream, records[first : first + 512])
    await transport.aclose()
    for _ in range(3):  # where the cancellation lands varies
        sub = kvbus.subscribe(stream, redis_server.url, follow=follow)
        async for _item in sub:
            if sub.stats.delivered > 10:  # the reader is fetching the next page now
                break
        closing = asyncio.create_task(sub.aclose())
        await asyncio.wait([closing], timeout=10)  # the old reader: never
        assert closing.done() and sub._reader is not None and sub._reader.done()
