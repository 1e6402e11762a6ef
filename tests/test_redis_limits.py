"""redis://: a forged entry id and a server that stops answering (real redis-server)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import redis.asyncio as redis

import kvbus

from .conftest import kv_payload, seqs
from .servers import RedisServer


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
