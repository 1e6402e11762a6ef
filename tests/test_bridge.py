"""Bridge logic against a scripted stand-in for vLLM's ZMQ publisher (a unit test of the
gap, restart and reply-layout handling; the real engine is in test_vllm_events.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from kvbus.connectors.vllm_bridge import EngineBridge

import kvbus
from kvbus import Message, Resync, ResyncReason

from .conftest import kv_payload, lost_seqs
from .servers import free_port

END = b"\xff" * 8


def _bind(socket: zmq.asyncio.Socket, port: int) -> None:
    """Bind, waiting out the previous engine's sockets (ZeroMQ closes them lazily)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class FakeEngine:
    """PUB + ROUTER speaking vLLM's wire format; ``old_replies`` uses the pre-0.26
    layout ``[b"", seq, payload]``; ``buffer`` keeps the newest batches."""

    def __init__(self, port: int, old_replies: bool, buffer: int = 1000) -> None:
        context = zmq.asyncio.Context.instance()
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        _bind(self.pub, port)
        _bind(self.router, port + 1)
        self.old_replies = old_replies
        self.buffer_size = buffer
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.server = asyncio.create_task(self._serve())

    async def publish(self, payload: bytes, send: bool = True) -> None:
        self.buffer = [*self.buffer, (self.seq, payload)][-self.buffer_size :]
        if send:  # send=False: lost on the live path, still in the replay buffer
            await self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    frames = [seq.to_bytes(8, "big"), payload]
                    head = [client, b""] if self.old_replies else [client, b"", b""]
                    await self.router.send_multipart(head + frames)
            await self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self.server.cancel()
        self.pub.close(0)
        self.router.close(0)


async def wait_forwarded(bridge: EngineBridge, seq: int) -> None:
    for _ in range(500):
        if bridge.last is not None and bridge.last >= seq:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"bridge at {bridge.last}, waiting for {seq}")


@pytest.mark.parametrize("old_replies", [False, True])
async def test_gaps_filled_from_replay_and_losses_announced(
    memory_url: str, old_replies: bool
) -> None:
    port = free_port(pair=True)
    engine = FakeEngine(port, old_replies, buffer=5)
    payloads = [kv_payload(i) for i in range(30)]
    bridge = EngineBridge(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", source="e", url=memory_url
    )
    task = asyncio.create_task(bridge.run())
    try:
        await asyncio.sleep(0.5)  # connected
        for p in payloads[:10]:
            await engine.publish(p)
        await wait_forwarded(bridge, 9)
        for p in payloads[10:13]:  # lost live, still buffered: repaired from replay
            await engine.publish(p, send=False)
        await engine.publish(payloads[13])
        await wait_forwarded(bridge, 13)
        for p in payloads[14:24]:  # lost live; the 5-batch buffer keeps only 20..24
            await engine.publish(p, send=False)
        await engine.publish(payloads[24])
        await wait_forwarded(bridge, 24)
        assert bridge.publisher is not None
        assert await bridge.publisher.aflush()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()
    items = [i async for i in kvbus.subscribe(url=memory_url, follow=False)]
    kv = [i.payload for i in items if isinstance(i, Message) and i.kind is kvbus.Kind.KV]
    # Engine batches 0..13 and 20..24 arrive untouched; 14..19 are announced as lost.
    assert kv == payloads[:14] + payloads[20:25]
    assert [i.reason for i in items if isinstance(i, Resync)] == [ResyncReason.DROPPED]
    assert len(lost_seqs(items)) == 1  # one bus seq stands for the whole loss
    assert bridge.publisher is not None and bridge.publisher.stats.dropped == 6


async def test_a_huge_seq_jump_is_one_announced_loss(memory_url: str) -> None:
    """A jump of 2**40 in the engine's seq (a forged frame) used to loop once per seq."""
    port = free_port(pair=True)
    engine = FakeEngine(port, old_replies=False)
    bridge = EngineBridge(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", source="e", url=memory_url
    )
    payloads = [kv_payload(0), kv_payload(1)]
    task = asyncio.create_task(bridge.run())
    try:
        await asyncio.sleep(0.5)
        await engine.publish(payloads[0])
        await wait_forwarded(bridge, 0)
        engine.seq = 2**40
        await engine.publish(payloads[1])
        await wait_forwarded(bridge, 2**40)
        assert bridge.publisher is not None and await bridge.publisher.aflush()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()
    items = [i async for i in kvbus.subscribe(url=memory_url, follow=False)]
    assert [i.reason for i in items if isinstance(i, Resync)] == [ResyncReason.DROPPED]
    kv = [i.payload for i in items if isinstance(i, Message) and i.kind is kvbus.Kind.KV]
    assert kv == payloads


async def test_engine_restart_is_a_new_epoch(memory_url: str) -> None:
    port = free_port(pair=True)
    engine = FakeEngine(port, old_replies=False)
    bridge = EngineBridge(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", source="e", url=memory_url
    )
    task = asyncio.create_task(bridge.run())
    try:
        await asyncio.sleep(0.5)
        for i in range(5):
            await engine.publish(kv_payload(i))
        await wait_forwarded(bridge, 4)
        first_epoch = bridge.publisher.epoch if bridge.publisher else 0
        engine.close()
        engine = FakeEngine(port, old_replies=False)  # seq starts at 0 again
        await asyncio.sleep(0.5)
        for i in range(3):
            await engine.publish(kv_payload(100 + i))
        for _ in range(500):
            if bridge.publisher is not None and bridge.publisher.epoch != first_epoch:
                break
            await asyncio.sleep(0.01)
        await wait_forwarded(bridge, 2)
        assert bridge.publisher is not None
        assert await bridge.publisher.aflush()
        second_epoch = bridge.publisher.epoch
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()
    items = [i async for i in kvbus.subscribe(url=memory_url, follow=False)]
    resyncs = [i for i in items if isinstance(i, Resync)]
    assert [(r.reason, r.epoch) for r in resyncs] == [(ResyncReason.NEW_EPOCH, second_epoch)]
    after = items[items.index(resyncs[0]) + 1 :]
    kv = [i.payload for i in after if isinstance(i, Message) and i.kind is kvbus.Kind.KV]
    assert len(kv) == 3
