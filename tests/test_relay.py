"""`RelayPublisher` (kvbus.bus.relay): the engine's process hands each message to a relay
process that owns the transport's client. Killed mid-stream over and over, on every
networked transport against its real server: each kill costs only messages the
consumers are told they lost (exactly those), everything else arrives once, in order,
with the bytes that were published, and the relay is started again each time."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
from kvbus.transports.packing import DEFAULT_RECORDS

import kvbus
from kvbus.bus.relay import PART_BYTES, RelayPublisher, _alive
from kvbus.wire.events import KVEventBatch, SourceStopped, encode

from .conftest import Bus, collect, lost_seqs, read_until
from .servers import NatsServer

KILLS = 6
PER_ROUND = 40


def batch(i: int) -> KVEventBatch:
    hashes: list[int | bytes] = [i * 16 + b for b in range(16)]
    stored = kvbus.BlockStored(hashes, None, list(range(256)), 16, None, "GPU", None)
    return KVEventBatch(float(i), [stored], 0)


def stopped(source: str) -> object:
    return lambda items: any(
        isinstance(i, kvbus.Message) and i.source == source and isinstance(i.body, SourceStopped)
        for i in items
    )


@pytest.mark.parametrize("bus", ["zmq", "nats", "redis"], indirect=True)
async def test_relay_kills_lose_only_what_they_announce(bus: Bus) -> None:
    source = f"engine-{bus.scheme}-{time.monotonic_ns()}"
    sub = bus.subscribe(gap_timeout=2.0)
    # Reading while it publishes: a zmq:// relay's history goes with it.
    reading = asyncio.create_task(read_until(sub, stopped(source), timeout=120))
    await asyncio.sleep(0.5)
    rng = random.Random(7)
    published: dict[int, float] = {}  # seq -> the batch's ts, for what was accepted
    relay = await asyncio.to_thread(RelayPublisher, bus.base, stream=bus.stream, source=source)
    try:
        seq = 1  # SourceStarted
        for kills in range(KILLS + 1):
            kill_at = rng.randrange(5, PER_ROUND - 5)
            i = 0
            # A round: the relay killed at a random message, then messages until its
            # successor runs (the engine starts one at most once a second) and a few
            # more went through it.
            while i < PER_ROUND or relay.restarts < kills or relay.relay_pid is None:
                seq += 1
                if relay.publish(batch(seq)):
                    published[seq] = float(seq)
                if i == kill_at and kills < KILLS:
                    pid = relay.relay_pid
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                i += 1
                await asyncio.sleep(0.004)
            await asyncio.to_thread(relay.flush, 20)
        assert relay.restarts == KILLS
        dropped = relay.stats.dropped
    finally:
        await asyncio.to_thread(relay.close)
    items = await reading
    await sub.aclose()
    mine = [i for i in items if i.source == source]
    got = [i for i in mine if isinstance(i, kvbus.Message)]
    seqs = [m.seq for m in got]
    assert seqs == sorted(set(seqs))  # in order, each once
    lost = lost_seqs(mine)
    kv = {m.seq: m for m in got if isinstance(m.body, KVEventBatch)}
    # Every message accepted and not announced lost arrived, with its own content;
    # every accepted message announced lost is one the relay's death took.
    assert {s for s in published if s not in lost} == set(kv)
    assert all(kv[s].body.ts == published[s] for s in kv)
    # Exactly the lost ones are announced: each seq of the epoch arrived or was lost.
    last = seqs[-1]
    assert set(range(1, last + 1)) == set(seqs) | lost and not set(seqs) & lost
    # The engine counts its own drops and what a dead relay had not reported sent; a
    # relay killed inside an append may have sent some of those (the consumers, told
    # exactly, know better). On zmq:// what a relay sent but its socket had not yet
    # delivered, and its replay ring, die with it too: consumers are told, the engine
    # cannot count it.
    assert len(lost) > 0 and dropped <= len(lost) + KILLS * DEFAULT_RECORDS
    if bus.scheme != "zmq":
        assert len(lost) <= dropped


def big_batch(blocks: int) -> KVEventBatch:
    hashes: list[int | bytes] = list(range(1, blocks + 1))
    tokens = [t % 120_000 * 7 for t in range(blocks * 16)]
    return KVEventBatch(1.0, [kvbus.BlockStored(hashes, None, tokens, 16, None, "GPU", None)], 0)


async def test_large_messages_go_in_parts_and_oversized_ones_are_announced(
    nats_server: NatsServer,
) -> None:
    """A batch over a frame's size (a long prompt's blocks) arrives whole; one over
    ``max_message_bytes`` is dropped and announced, and nothing else is lost."""
    source = f"engine-big-{time.monotonic_ns()}"
    large = big_batch(4000)  # about 320 KB: six parts
    assert len(encode(large)) > 4 * PART_BYTES
    relay = await asyncio.to_thread(
        RelayPublisher, nats_server.url, stream="big", source=source, max_message_bytes=400_000
    )
    try:
        assert relay.publish(large)
        assert not relay.publish(big_batch(12000))  # about 960 KB: over the limit
        assert relay.publish(batch(3))
        assert await asyncio.to_thread(relay.flush, 20)
    finally:
        await asyncio.to_thread(relay.close)
    items, _ = await collect(nats_server.url, stream="big")
    mine = [i for i in items if i.source == source]
    got = {i.seq: i for i in mine if isinstance(i, kvbus.Message)}
    assert sorted(got) == [1, 2, 4, 5] and lost_seqs(mine) == {3}
    assert encode(got[2].body) == encode(large)
    assert relay.stats.dropped == 1


def gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` ended within ``timeout`` seconds (a zombie has)."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def test_an_engine_killed_has_its_epoch_ended_by_the_relay(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """However the engine's process ends (SIGKILL here), its relay sees its end of the
    socket close, sends what it holds, ends the epoch with ``SourceStopped`` and exits."""
    source = f"engine-killed-{time.monotonic_ns()}"
    script = tmp_path / "engine.py"
    script.write_text(
        "import os, signal, sys\n"
        "from kvbus.bus.relay import PART_BYTES, RelayPublisher, _alive\n"
        f"relay = RelayPublisher({nats_server.url!r}, stream='killed', source={source!r})\n"
        "for i in range(20):\n"
        "    relay.publish(b'\\x93\\xcb' + bytes(8) + b'\\x90\\x00')\n"
        "print(relay.relay_pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    engine = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).parents[1]
    )
    out, _ = await engine.communicate()
    assert engine.returncode == -signal.SIGKILL
    assert await asyncio.to_thread(gone, int(out.split()[0]), 30)  # the relay ended
    items, _ = await collect(nats_server.url, stream="killed")
    mine = [i for i in items if isinstance(i, kvbus.Message) and i.source == source]
    assert [m.seq for m in mine] == list(range(1, 23))
    assert isinstance(mine[-1].body, SourceStopped) and not lost_seqs(items)
