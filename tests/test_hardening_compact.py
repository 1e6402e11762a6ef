"""``kvbus compact`` writes its snapshots on time, items or not, and once more when it
stops (kvbus.ops.compact); its caps are set and reported on the command line (kvbus.cli)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as redis
from kvbus.transports import open_transport

import kvbus
from kvbus import BlockStored, KVEventBatch
from kvbus.cli import TERMINATED, main
from kvbus.ops.compact import Compactor
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import decode_kv_batch, encode
from kvbus.wire.snapshot import decode_snapshot

from .servers import RedisServer

NEVER = 3600.0
"""An interval no test reaches: only a stop writes."""
_streams = itertools.count()


def stored(hashes: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, None, list(range(4 * len(hashes))), 4, None, medium, None)


def batch(*hashes: int) -> bytes:
    return encode(KVEventBatch(time.time(), [stored(list(hashes))]))


async def snapshot_blocks(url: str, stream: str, source: str) -> set[int] | None:
    """The blocks ``source``'s stored snapshot rebuilds, None if it has none."""
    transport = open_transport(url)
    try:
        data = (await transport.get_snapshots(stream)).get(source)
    finally:
        await transport.aclose()
    if data is None:
        return None
    index = PrefixIndex()
    index.apply_events(source, decode_kv_batch(decode_snapshot(data).payload)[0].events)
    return {h for h in index.blocks(source) if isinstance(h, int)}


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    """Wait (bounded) until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        assert time.monotonic() < deadline, f"{check.__name__} did not hold in {timeout:g} s"
        await asyncio.sleep(0.05)


@pytest.fixture(params=["memory", "redis"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://compact{next(_streams)}-{time.monotonic_ns()}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


async def test_a_stream_that_goes_quiet_has_its_last_changes_written_on_time(url: str) -> None:
    """Snapshots used to be written only when an item arrived after the interval: the
    last batches before a quiet spell stayed unwritten until the next item, for ever on
    a stream that stays quiet. Now a timer writes them, and only what changed."""
    stream = f"quiet{next(_streams)}"
    compactor = Compactor(url, stream, interval=0.3)
    running = asyncio.create_task(compactor.run())
    publisher = kvbus.Publisher(url, stream=stream, source="engine", max_batch=1)
    try:
        publisher.publish(batch(1, 2))
        publisher.publish(batch(3))
        assert await publisher.aflush()

        async def written() -> bool:
            return await snapshot_blocks(url, stream, "engine") == {1, 2, 3}

        await until(written)  # with no message after them
        count = compactor.written
        # Quiet: the timer goes on firing and writes nothing that did not change.
        await asyncio.sleep(3 * compactor.interval)
        assert compactor.written == count
        publisher.publish(batch(4))
        assert await publisher.aflush()

        async def rewritten() -> bool:
            return await snapshot_blocks(url, stream, "engine") == {1, 2, 3, 4}

        await until(rewritten)
        assert compactor.write_errors == 0
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await publisher.aclose()


async def test_a_cancelled_compactor_writes_its_last_changes(url: str) -> None:
    """Cancelled (``kvbus compact`` on SIGTERM), it used to stop with everything since
    its last write unwritten; now it writes it once more before it ends."""
    stream = f"stopped{next(_streams)}"
    compactor = Compactor(url, stream, interval=NEVER)
    running = asyncio.create_task(compactor.run())
    publisher = kvbus.Publisher(url, stream=stream, source="engine", max_batch=1)
    publisher.publish(batch(5, 6))
    assert await publisher.aflush()

    async def folded() -> bool:
        fold = compactor.folds.get("engine")
        return fold is not None and len(fold.held) == 2

    await until(folded)
    assert await snapshot_blocks(url, stream, "engine") is None  # never due
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running, 10)
    assert await snapshot_blocks(url, stream, "engine") == {5, 6}
    assert compactor.written == 1
    await publisher.aclose()


async def test_a_failed_write_is_counted_and_made_again_at_the_next_interval(
    redis_server: RedisServer,
) -> None:
    """A write the server refuses (here: the snapshots key holds a string, WRONGTYPE)
    neither ends the compactor nor loses the change: the next interval writes it."""
    stream = f"refused{next(_streams)}"
    client = redis.Redis.from_url(redis_server.url)
    await client.set(f"kvbus:{stream}:snapshots", b"not a hash")
    compactor = Compactor(redis_server.url, stream, interval=0.2)
    running = asyncio.create_task(compactor.run())
    publisher = kvbus.Publisher(redis_server.url, stream=stream, source="engine", max_batch=1)
    try:
        publisher.publish(batch(7))
        assert await publisher.aflush()

        async def failed_twice() -> bool:
            return compactor.write_errors >= 2

        await until(failed_twice)
        await client.delete(f"kvbus:{stream}:snapshots")

        async def written() -> bool:
            return await snapshot_blocks(redis_server.url, stream, "engine") == {7}

        await until(written)
        assert not running.done()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await publisher.aclose()
        await client.aclose()


async def test_a_cancel_while_the_server_is_stopped_ends_the_compactor(tmp_path: Path) -> None:
    """Its last write goes to a server that never answers (SIGSTOP): it is given up
    after `LAST_WRITE_WITHIN` seconds, and the compactor ends."""
    server = RedisServer(tmp_path)
    server.start()
    assert server.process is not None
    compactor = Compactor(server.url, "stalled", interval=NEVER)
    running = asyncio.create_task(compactor.run())
    publisher = kvbus.Publisher(server.url, stream="stalled", source="engine", max_batch=1)
    try:
        publisher.publish(batch(8))
        assert await publisher.aflush()

        async def folded() -> bool:
            return "engine" in compactor.folds

        await until(folded)
        os.kill(server.process.pid, signal.SIGSTOP)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 10)
        assert compactor.written == 0
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        publisher.close()
        server.stop()


# --- the command line ---------------------------------------------------------------------


def test_sigterm_makes_compact_write_its_last_changes_and_say_so(tmp_path: Path) -> None:
    """``kvbus compact`` stopped by SIGTERM before its interval came: what it folded is
    stored, it prints its summary and exits 143 (`kvbus.cli.TERMINATED`)."""
    server = RedisServer(tmp_path)  # its own: no other test's reader blocked on it
    server.start()
    with kvbus.Publisher(server.url, stream="kv", source="engine") as publisher:
        publisher.publish(batch(9, 10))
        assert publisher.flush()
    compact = subprocess.Popen(
        [sys.executable, "-m", "kvbus.cli", "compact", "--url", server.url,
         "--interval", str(NEVER)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    async def caught_up() -> bool:
        # Its reader is blocked waiting for entries past the history: it has read it,
        # and the compactor folds a page as soon as the reader asks for the next.
        assert compact.poll() is None, compact.communicate()
        client = redis.Redis.from_url(server.url)
        try:
            clients = await client.client_list()
        finally:
            await client.aclose()
        return any(c["cmd"] == "xread" and "b" in c["flags"] for c in clients)

    try:
        asyncio.run(until(caught_up))
        compact.send_signal(signal.SIGTERM)
        out, _ = compact.communicate(timeout=30)
        assert compact.returncode == TERMINATED
        assert out.startswith("kvbus compact: snapshots written: 1 (1 source folded)")
        assert asyncio.run(snapshot_blocks(server.url, "kv", "engine")) == {9, 10}
    finally:
        if compact.poll() is None:
            compact.kill()
        server.stop()


def test_compact_takes_its_caps_and_says_what_it_did(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-copies`` and ``--max-blocks`` reach the compactor; the line it prints on
    success says what it wrote and what the caps left out."""
    stream = f"capped{next(_streams)}"
    copies = KVEventBatch(0.0, [stored([1]), *[stored([1]) for _ in range(4)]])  # 5 copies
    many = KVEventBatch(0.0, [stored(list(range(100, 120)))])  # 20 blocks
    with (
        kvbus.Publisher(redis_server.url, stream=stream, source="copier") as copier,
        kvbus.Publisher(redis_server.url, stream=stream, source="hoarder") as hoarder,
        kvbus.Publisher(redis_server.url, stream=stream, source="plain") as plain,
    ):
        copier.publish(encode(copies))
        hoarder.publish(encode(many))
        plain.publish(batch(200))
        assert copier.flush() and hoarder.flush() and plain.flush()
    argv = ["compact", "--url", redis_server.url, "--stream", stream, "--once"]
    assert main([*argv, "--max-copies", "2", "--max-blocks", "10"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "kvbus compact: snapshots written: 2 (3 sources folded); capped: 3 block copies "
        "over --max-copies, 1 source over --max-blocks (no snapshot)"
    ]

    async def snapshots() -> tuple[set[int] | None, set[int] | None]:
        url = redis_server.url
        return await snapshot_blocks(url, stream, "copier"), await snapshot_blocks(
            url, stream, "hoarder"
        )

    assert asyncio.run(snapshots()) == ({1}, None)


@pytest.mark.parametrize("flag", ["--max-copies", "--max-blocks", "--interval"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_compact_refuses_caps_that_are_not_positive(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["compact", "--once", flag, value])
    assert exit.value.code == 2
    assert f"argument {flag}: must be positive" in capsys.readouterr().err
