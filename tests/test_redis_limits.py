"""redis://: a forged entry id and a server that stops answering (real redis-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as redis
from kvbus.transports import Record, open_transport
from kvbus.transports.redis import RedisTransport

import kvbus

from .conftest import envelope, kv_payload, seqs
from .servers import RedisSentinel, RedisServer

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


# --- Sentinels: a primary is the one a quorum of them names ---------------------------

SERVER_PASSWORD = "s3cret-primary-pass"


class PasswordRedis(RedisServer):
    def command(self) -> list[str]:
        return [*super().command(), "--requirepass", SERVER_PASSWORD]


class PasswordSentinel(RedisSentinel):
    """A real Sentinel watching a primary that wants a password."""

    def command(self) -> list[str]:
        command = super().command()
        with (self.data_dir / "sentinel.conf").open("a") as config:
            config.write(f"sentinel auth-pass kvbus {SERVER_PASSWORD}\n")
        return command


def _resp(value: object, resp3: bool) -> bytes:
    """``value`` in RESP: str as a simple string, int, list, dict (a map in RESP3, a flat
    array in RESP2)."""
    if isinstance(value, str):
        return f"+{value}\r\n".encode()
    if isinstance(value, int):
        return f":{value}\r\n".encode()
    if isinstance(value, list):
        return f"*{len(value)}\r\n".encode() + b"".join(_resp(v, resp3) for v in value)
    assert isinstance(value, dict)
    if resp3:
        pairs = b"".join(_resp(k, resp3) + _resp(v, resp3) for k, v in value.items())
        return f"%{len(value)}\r\n".encode() + pairs
    return _resp([x for kv in value.items() for x in kv], resp3)


class FakeSentinel:
    """A TCP server speaking just enough RESP to pass for a Sentinel that names
    ``primary_port`` (a server of the attacker's) as the healthy primary of ``kvbus``."""

    def __init__(self, primary_port: int) -> None:
        self.state = {
            "name": "kvbus",
            "ip": "127.0.0.1",
            "port": str(primary_port),
            "runid": "0" * 40,
            "flags": "master",
            "num-slaves": "0",
            "num-other-sentinels": "2",
            "quorum": "1",
        }
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        resp3 = False
        try:
            while line := await reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2].decode().upper())
                if args[0] == "HELLO":
                    resp3 = args[1:2] == ["3"]
                    reply: object = {"server": "redis", "proto": 3 if resp3 else 2}
                elif args[:2] == ["SENTINEL", "MASTER"]:
                    reply = self.state
                elif args[:2] == ["SENTINEL", "MASTERS"]:
                    reply = [self.state]
                elif args[0] == "PING":
                    reply = "PONG"
                else:
                    reply = "OK"
                writer.write(_resp(reply, resp3))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class Eavesdropper:
    """The attacker's 'primary': records everything sent to it."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while data := await reader.read(65536):
            self.received += data
            writer.write(b"+OK\r\n")
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def lying_sentinel_setup(
    tmp_path: Path,
) -> AsyncIterator[tuple[RedisServer, list[RedisSentinel], FakeSentinel, Eavesdropper]]:
    """A password-protected primary watched by two real Sentinels, and an attacker's
    Sentinel that names the attacker's server instead."""
    primary = PasswordRedis(tmp_path)
    sentinel_dirs = [tmp_path / "s1", tmp_path / "s2"]
    for directory in sentinel_dirs:
        directory.mkdir()
    sentinels: list[RedisSentinel] = [PasswordSentinel(d, primary) for d in sentinel_dirs]
    eavesdropper = Eavesdropper()
    fake = FakeSentinel(await eavesdropper.start())
    await fake.start()
    for server in (primary, *sentinels):
        await asyncio.to_thread(server.start)
    yield primary, sentinels, fake, eavesdropper
    await fake.close()
    await eavesdropper.close()
    for server in (*sentinels, primary):
        await asyncio.to_thread(server.stop)


async def test_a_lying_sentinel_listed_first_gets_neither_password_nor_appends(
    lying_sentinel_setup: tuple[RedisServer, list[RedisSentinel], FakeSentinel, Eavesdropper],
) -> None:
    """redis-py's Sentinel used the first Sentinel that answered: a fake one listed first
    got the server password and every append (counted as sent) sent to its server. Now
    two of the three Sentinels must name the primary."""
    primary, sentinels, fake, eavesdropper = lying_sentinel_setup
    assert fake.server is not None
    fake_port = fake.server.sockets[0].getsockname()[1]
    hosts = ",".join(f"127.0.0.1:{port}" for port in (fake_port, *(s.port for s in sentinels)))
    url = f"redis+sentinel://:{SERVER_PASSWORD}@{hosts}/kvbus"
    publisher = kvbus.Publisher(url, stream="quorum", source="engine")
    for i in range(100):
        publisher.publish(kv_payload(i))
    flushed = await publisher.aflush(10)
    await publisher.aclose()
    assert SERVER_PASSWORD.encode() not in eavesdropper.received
    assert eavesdropper.connections == 0
    assert flushed and publisher.stats.sent == 102  # SourceStarted .. SourceStopped
    check = redis.Redis(port=primary.port, password=SERVER_PASSWORD)
    stored = await check.xrange("kvbus:quorum")
    await check.aclose()
    assert len(stored) >= 1  # packs: the appends reached the real primary
    items = [i async for i in kvbus.subscribe("quorum", url, follow=False)]
    assert seqs(items) == list(range(1, 103))


async def test_sentinels_that_disagree_name_no_primary(
    lying_sentinel_setup: tuple[RedisServer, list[RedisSentinel], FakeSentinel, Eavesdropper],
) -> None:
    """With the fake and one real Sentinel (a majority is both), no address is used and
    the disagreement is counted; ``sentinel_quorum=1`` is the operator's own choice."""
    _primary, sentinels, fake, eavesdropper = lying_sentinel_setup
    assert fake.server is not None
    fake_port = fake.server.sockets[0].getsockname()[1]
    hosts = f"127.0.0.1:{fake_port},127.0.0.1:{sentinels[0].port}"
    transport = open_transport(f"redis+sentinel://:{SERVER_PASSWORD}@{hosts}/kvbus")
    assert isinstance(transport, RedisTransport)
    with pytest.raises(redis.ConnectionError, match="named by 2 of 2 Sentinels"):
        await transport.append("split", [Record("e", "e:1:1", b"x")])
    assert transport.sentinel_disagreements >= 1
    await transport.aclose()
    assert eavesdropper.connections == 0
    with pytest.raises(ValueError, match="sentinel_quorum=3"):
        open_transport(f"redis+sentinel://{hosts}/kvbus?sentinel_quorum=3")


async def test_no_primary_is_taken_while_the_sentinel_fails_it_over() -> None:
    """Until a failover ends, ``SENTINEL MASTER`` names the old primary; one restarted
    meanwhile answered as a primary and took appends that its demotion then wiped
    (acknowledged, lost: seen in 1 of ~40 failovers). Now a primary under failover is
    no primary: the append waits (retried) and the old one is never written to."""
    old_primary = Eavesdropper()
    sentinel = FakeSentinel(await old_primary.start())
    sentinel.state["flags"] = "master,failover_in_progress"
    port = await sentinel.start()
    transport = open_transport(f"redis+sentinel://127.0.0.1:{port}/kvbus?sentinel_quorum=1")
    assert isinstance(transport, RedisTransport)
    try:
        with pytest.raises(redis.ConnectionError, match="no healthy primary"):
            await transport.append("failover", [Record("e", "e:1:1", b"x")])
        assert old_primary.connections == 0
        sentinel.state["flags"] = "master"  # the failover ended (here: named the same)
        await transport.append("failover", [Record("e", "e:1:1", b"x")])
        assert old_primary.connections == 1
    finally:
        await transport.aclose()
        await sentinel.close()
        await old_primary.close()
