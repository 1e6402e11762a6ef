"""One conformance suite, run unchanged against every transport (memory://, zmq://,
nats:// and redis://, the last two against real servers started by fixtures)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from typing import Any

import msgspec
from kvbus.transports import Record, open_transport

import kvbus
from kvbus import Message, Resync, ResyncReason
from kvbus.ops.compact import Compactor
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SourceStarted,
    encode,
)

from .conftest import Bus, Item, envelope, kv_payload, last_seq_is, read_until, seqs


def kv_messages(items: list[Item], source: str | None = None) -> list[Message]:
    return [
        i
        for i in items
        if isinstance(i, Message)
        and i.kind == kvbus.Kind.KV
        and (source is None or i.source == source)
    ]


async def history(bus: Bus, **options: object) -> tuple[list[Item], kvbus.Subscription]:
    sub = bus.subscribe(follow=False, **options)  # type: ignore[arg-type]
    items = [item async for item in sub]
    await sub.aclose()
    return items, sub


async def test_order_without_duplicates(bus: Bus) -> None:
    publisher = bus.publisher("engine-a", max_batch=7)  # several packs per stream
    payloads = [kv_payload(i, 16) for i in range(500)]
    for payload in payloads:
        publisher.publish(payload)
    assert publisher.flush()
    items, sub = await history(bus)
    assert seqs(items) == list(range(1, 502))  # SourceStarted + 500
    assert [m.payload for m in kv_messages(items)] == payloads
    assert not [i for i in items if isinstance(i, Resync)]
    assert sub.stats.duplicates == sub.stats.malformed == 0
    publisher.close()


async def test_connector_records_travel_beside_kv_batches(bus: Bus) -> None:
    """A KV connector's step records (kind CONNECTOR, with a raw stats payload whose
    map keys are tuples, as vLLM's offloading stats have) come back as typed structs."""
    from kvbus.wire.events import ConnectorBatch, ConnectorStats, TransferEvent, decode_raw

    publisher = bus.publisher("engine-a")
    payload = msgspec.msgpack.encode({"data": {("CPU_to_GPU",): 4096}})
    sent = ConnectorBatch(
        time.time(),
        1,
        [TransferEvent(request_id="r1", direction="load", phase="finished", tokens=64)],
        ConnectorStats(connector="m:C", workers=payload),
    )
    publisher.publish(kv_payload(1, 2))
    publisher.publish(sent, kvbus.Kind.CONNECTOR)
    assert publisher.flush()
    items, sub = await history(bus)
    (got,) = [i for i in items if isinstance(i, Message) and i.kind == kvbus.Kind.CONNECTOR]
    assert got.body == sent and got.seq == 3
    assert isinstance(got.body, ConnectorBatch) and got.body.stats is not None
    assert decode_raw(got.body.stats.workers) == {"data": {("CPU_to_GPU",): 4096}}
    assert sub.stats.unknown_kind == sub.stats.malformed == 0
    publisher.close()


async def test_replay_from_any_cursor(bus: Bus) -> None:
    publisher = bus.publisher("engine-a", max_batch=16)
    for i in range(100):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    # Cursors taken after every k-th item, including inside packs, resume exactly.
    for k in (1, 2, 15, 16, 17, 50, 100, 101):
        sub = bus.subscribe(follow=False)
        first = []
        async for item in sub:
            first.append(item)
            if len(first) == k:
                break
        cursor = sub.cursor.to_bytes()
        await sub.aclose()
        rest, _ = await history(bus, cursor=cursor)
        assert seqs(first) + seqs(rest) == list(range(1, 102)), k
    publisher.close()


async def test_multiple_sources_interleaved(bus: Bus) -> None:
    publishers = [bus.publisher(f"engine-{n}", max_batch=5) for n in range(3)]
    for i in range(200):
        publishers[i % 3].publish(kv_payload(i))
    for publisher in publishers:
        assert publisher.flush()
    items, _ = await history(bus)
    for n, publisher in enumerate(publishers):
        expected = len(range(n, 200, 3)) + 1
        assert seqs(items, publisher.source) == list(range(1, expected + 1))
    for publisher in publishers:
        publisher.close()


async def test_multiple_subscribers_each_get_everything(bus: Bus) -> None:
    subs = [bus.subscribe() for _ in range(3)]
    readers = [asyncio.create_task(read_until(s, last_seq_is("engine-a", 301))) for s in subs]
    await asyncio.sleep(0.3)
    publisher = bus.publisher("engine-a")
    for i in range(300):
        publisher.publish(kv_payload(i))
        if i % 50 == 0:
            await asyncio.sleep(0.01)
    for reader, sub in zip(readers, subs, strict=True):
        assert seqs(await reader) == list(range(1, 302))
        await sub.aclose()
    publisher.close()


async def test_large_messages(bus: Bus) -> None:
    big = KVEventBatch(
        time.time(),
        [BlockStored([1], None, list(range(1000, 1000 + 300_000)), 16, None, "GPU", None)],
    )
    payload = encode(big)
    assert len(payload) > 1024 * 1024
    publisher = bus.publisher("engine-a", max_message_bytes=4 * 1024 * 1024)
    small = kv_payload(7)
    for _ in range(3):
        publisher.publish(payload)
        publisher.publish(small)
    assert publisher.flush(30)
    items, _ = await history(bus)
    assert [m.payload for m in kv_messages(items)] == [payload, small] * 3
    assert kv_messages(items)[0].body == big
    publisher.close()


async def test_a_consumer_that_leaves_early_closes_at_once(bus: Bus) -> None:
    """A consumer that stops reading (break, or an exception in its loop) while the
    subscription has read ahead as far as it may: leaving the ``async with`` stops the
    reader, on a history read and on the live tail alike."""
    publisher = bus.publisher("engine-a", max_queue=10_000)
    for i in range(4000):  # more than a subscription reads ahead
        publisher.publish(kv_payload(i, 16))
    assert publisher.flush(30)
    # Leaving at once (the reader is most likely mid-read) or after a pause (it waits
    # for the consumer, its read-ahead full).
    for follow, pause in itertools.product((False, True), (0, 0.2)):
        async with asyncio.timeout(10):  # a reader that outlives its cancel: a hang
            with contextlib.suppress(LookupError):
                async with bus.subscribe(follow=follow) as sub:
                    async for _ in sub:
                        if sub.stats.delivered > 10:
                            await asyncio.sleep(pause)
                            raise LookupError("the consumer's own error")
        assert sub._reader is not None and sub._reader.done()
    publisher.close()


async def test_empty_stream_ends(bus: Bus) -> None:
    items, sub = await history(bus)
    assert items == []
    assert sub.stats.delivered == 0


async def test_subscriber_started_before_the_publisher(bus: Bus) -> None:
    sub = bus.subscribe()
    reader = asyncio.create_task(read_until(sub, last_seq_is("engine-a", 101)))
    await asyncio.sleep(0.5)
    publisher = bus.publisher("engine-a")
    for i in range(100):
        publisher.publish(kv_payload(i))
    items = await reader
    assert seqs(items) == list(range(1, 102))
    assert isinstance(items[0], Message) and isinstance(items[0].body, SourceStarted)
    await sub.aclose()
    publisher.close()


async def test_subscriber_started_after_the_publisher(bus: Bus) -> None:
    publisher = bus.publisher("engine-a")
    for i in range(100):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    sub = bus.subscribe()
    reader = asyncio.create_task(read_until(sub, last_seq_is("engine-a", 201)))
    await asyncio.sleep(0.3)
    for i in range(100):  # history first, then the live tail, with nothing in between
        publisher.publish(kv_payload(i))
    items = await reader
    assert seqs(items) == list(range(1, 202))
    await sub.aclose()
    publisher.close()


async def test_latest_skips_history(bus: Bus) -> None:
    publisher = bus.publisher("engine-a")
    for i in range(10):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    sub = bus.subscribe(cursor="latest", gap_timeout=0.2)
    reader = asyncio.create_task(read_until(sub, last_seq_is("engine-a", 16)))
    await asyncio.sleep(0.5)
    for i in range(5):
        publisher.publish(kv_payload(i))
    items = await reader
    # Joining mid-epoch is announced; only the new messages are delivered.
    assert items[0] == Resync("engine-a", publisher.epoch, ResyncReason.JOINED, (1, 11))
    assert seqs(items) == list(range(12, 17))
    await sub.aclose()
    publisher.close()


async def test_subscriber_restarted_with_saved_cursor(bus: Bus) -> None:
    """Killed mid-stream (its task cancelled, no clean close) and restarted from the
    cursor it saved: nothing lost, nothing applied twice."""
    publisher = bus.publisher("engine-a", max_batch=8)
    applied: list[int] = []
    saved = b""

    async def consume(cursor: bytes | None, stop_after: int | None) -> None:
        nonlocal saved
        sub = bus.subscribe(cursor=cursor or None)
        async for item in sub:
            assert isinstance(item, Message), item
            applied.append(item.seq)
            saved = sub.cursor.to_bytes()  # persisted together with the applied state
            if stop_after is not None and len(applied) >= stop_after:
                await asyncio.sleep(3600)  # killed here

    first = asyncio.create_task(consume(None, 120))
    for i in range(400):
        publisher.publish(kv_payload(i))
        if i % 20 == 0:
            await asyncio.sleep(0.005)
        if len(applied) >= 120 and not first.done():
            first.cancel()
    assert publisher.flush()
    if not first.done():
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    second = asyncio.create_task(consume(saved, None))
    deadline = time.monotonic() + 30
    while (not applied or applied[-1] < 401) and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a task
        await asyncio.sleep(0.05)
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert applied == list(range(1, 402))
    publisher.close()


async def test_publisher_restart_starts_a_new_epoch(bus: Bus) -> None:
    sub = bus.subscribe()
    first = bus.publisher("engine-a")
    for i in range(20):
        first.publish(kv_payload(i))
    items = await read_until(sub, last_seq_is("engine-a", 21))
    first.close()
    second = bus.publisher("engine-a")
    assert second.epoch > first.epoch
    for i in range(20):
        second.publish(kv_payload(100 + i))
    rest = await read_until(
        sub,
        lambda got: any(
            isinstance(i, Message) and i.epoch == second.epoch and i.seq == 21 for i in got
        ),
    )
    resync = next(i for i in rest if isinstance(i, Resync))
    assert resync.reason == ResyncReason.NEW_EPOCH
    assert resync.epoch == second.epoch and resync.previous_epoch == first.epoch
    after = rest[rest.index(resync) + 1 :]
    # The control message of the new epoch comes before any of its data.
    assert isinstance(after[0], Message) and isinstance(after[0].body, SourceStarted)
    assert [m.seq for m in after if isinstance(m, Message)] == list(range(1, 22))
    assert seqs(items) == list(range(1, 22))
    await sub.aclose()
    second.close()


async def test_trimmed_history_is_reported_as_a_gap(bus: Bus) -> None:
    """Retention dropped messages a cursor still needs: an explicit Resync names exactly
    the seqs that are gone; nothing is skipped silently."""
    url = bus.url(**{bus.retention: 20})
    publisher = bus.publisher("engine-a", url=url)
    publisher.publish(kv_payload(0))
    assert publisher.flush()
    sub = bus.subscribe(url, follow=False)
    first = [item async for item in sub]
    cursor = sub.cursor
    await sub.aclose()
    assert seqs(first) == [1, 2]
    for i in range(300):  # separate appends, so each is its own stored entry
        publisher.publish(kv_payload(i))
        assert publisher.flush()
    items, _ = await history(bus, url=url, cursor=cursor, gap_timeout=0.2)
    resync = items[0]
    assert isinstance(resync, Resync) and resync.reason == ResyncReason.GAP
    assert resync.lost is not None
    delivered = seqs(items)
    assert resync.lost == (3, delivered[0] - 1)
    assert delivered == list(range(delivered[0], 303))
    publisher.close()


async def test_malformed_entries_are_skipped(bus: Bus) -> None:
    """Garbage stored next to good messages is counted and skipped."""
    publisher = bus.publisher("engine-a")
    publisher.publish(b"\xc1 not msgpack")  # a KV payload that does not decode
    publisher.publish(kv_payload(1))
    assert publisher.flush()
    items, sub = await history(bus)
    assert seqs(items) == [1, 3]
    assert sub.stats.malformed == 1
    publisher.close()


async def test_reading_only_the_recent_past(bus: Bus) -> None:
    """``position_at`` + ``gap_timeout=0``: what a router reads at start to learn each
    engine's latest load, instead of the whole retained history."""
    publisher = bus.publisher("engine-a", max_batch=8)
    for i in range(50):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    await asyncio.sleep(0.05)
    since = time.time()
    await asyncio.sleep(0.05)
    for i in range(50, 100):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    transport = open_transport(bus.base)
    try:
        position = await transport.position_at(bus.stream, since)
    finally:
        await transport.aclose()
    items, _ = await history(bus, cursor=kvbus.Cursor(position), gap_timeout=0)
    if position is None:  # this backend cannot tell: the whole history
        assert seqs(items) == list(range(1, 102))
    else:
        # Joined mid-epoch: declared at once (no history search), then the recent ones.
        assert isinstance(items[0], Resync) and items[0].reason is ResyncReason.JOINED
        assert items[0].lost == (1, 51)
        assert seqs(items) == list(range(52, 102))
    assert bus.scheme == "zmq" or position is not None
    publisher.close()


def nested(depth: int) -> bytes:
    """msgpack for ``[[[...[nil]...]]]``, ``depth`` levels: 1 byte per level."""
    return b"\x91" * depth + b"\xc0"


async def test_hostile_messages_are_skipped_and_lose_nothing(bus: Bus) -> None:
    """Nesting 3,000 levels deep (in a payload, and in an extra envelope field), and
    envelopes forged under the real source's name with epoch 2**64-1 or seq 2**64-1:
    each is counted and skipped, at O(1) cost, and every real message still arrives."""
    publisher = bus.publisher("engine-a", max_batch=4)
    publisher.publish(kv_payload(0))
    publisher.publish(b"\x92\xcb" + bytes(8) + nested(3000))  # seq 3: a batch too deep
    assert publisher.flush()
    head = msgspec.msgpack.encode([1, 1, "engine-a", publisher.epoch, 4, time.time(), b"", 0])
    forged = [
        envelope("engine-a", 2**64 - 1, 1),
        envelope("engine-a", publisher.epoch, 2**64 - 1),
        b"\x99" + head[1:] + nested(3000),  # a valid envelope, plus a 9th field
    ]
    transport = open_transport(bus.base)
    try:
        records = [Record("engine-a", f"forged-{i}", data) for i, data in enumerate(forged)]
        await transport.append(bus.stream, records)
    finally:
        await transport.aclose()
    for i in range(1, 5):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    items, sub = await history(bus)
    assert seqs(items) == [1, 2, 4, 5, 6, 7]
    resyncs = [i for i in items if isinstance(i, Resync)]
    assert resyncs == [Resync("engine-a", publisher.epoch, ResyncReason.MALFORMED, (3, 3))]
    assert (sub.stats.malformed, sub.stats.implausible) == (2, 2)
    publisher.close()


def cache_workload(steps: int, seed: int) -> list[KVEventBatch]:
    """Batches as an engine's prefix cache makes them: chains grown from cached blocks,
    second copies of a cached block (its parent cached), evictions that leave a cached
    child of an evicted parent, and one clear."""
    rng = random.Random(seed)
    held: dict[int, tuple[int | None, list[int], int]] = {}  # hash -> parent, tokens, copies
    next_hash = iter(range(1, 1 << 30))
    batches = []
    for step in range(steps):
        events: list[Any] = []
        roll = rng.random()
        copyable = [h for h, (p, _, _) in held.items() if p is None or p in held]
        if roll < 0.55 or not held:
            parent = rng.choice([None, *held]) if held else None
            hashes = [next(next_hash) for _ in range(rng.randint(1, 3))]
            tokens = [rng.randrange(3, 1000) for _ in range(4 * len(hashes))]
            events.append(BlockStored(hashes, parent, tokens, 4, None, "GPU", None))
            for i, h in enumerate(hashes):
                held[h] = (parent if i == 0 else hashes[i - 1], tokens[4 * i : 4 * i + 4], 1)
        elif roll < 0.7 and copyable:  # a second copy of a cached block
            h = rng.choice(copyable)
            parent, tokens, copies = held[h]
            events.append(BlockStored([h], parent, tokens, 4, None, "GPU", None))
            held[h] = (parent, tokens, copies + 1)
        elif roll < 0.995:
            h = rng.choice(list(held))
            events.append(BlockRemoved([h], "GPU"))
            parent, tokens, copies = held.pop(h)
            if copies > 1:
                held[h] = (parent, tokens, copies - 1)
        elif step > steps // 2:
            events.append(AllBlocksCleared())
            held.clear()
        batches.append(KVEventBatch(float(step), events))
    return batches


async def test_a_consumer_after_trimmed_history_rebuilds_exact_state(bus: Bus) -> None:
    """A compactor follows the stream (zmq: the publishing process folds what it
    publishes); retention keeps only the last 30 entries; a consumer that starts
    afterwards gets, from the snapshots and the retained tail, exactly the state of one
    that saw everything."""
    url = bus.url(**{bus.retention: 30, **({"snapshots": 1} if bus.scheme == "zmq" else {})})
    publisher = bus.publisher("engine-a", url=url, max_batch=1)
    truth = PrefixIndex()
    compactor = Compactor(url, bus.stream)
    for n, batch in enumerate(cache_workload(400, seed=3)):
        publisher.publish(encode(batch))
        truth.apply_events("engine-a", batch.events)
        assert publisher.flush()  # one stored entry per batch: retention trims by batch
        if n % 20 == 19 and bus.scheme != "zmq":  # a zmq publisher serves its own
            await compactor.run(follow=False)  # resumes from its own snapshots
    full = [item async for item in bus.subscribe(url, follow=False)]
    assert isinstance(full[0], Resync)  # the history is trimmed: JOINED without them
    consumer = PrefixIndex()
    items, sub = await history(bus, url=url, snapshot=True)
    for item in items:
        consumer.apply(item)
    assert not [i for i in items if isinstance(i, Resync)]
    assert sub.stats.snapshots == 1
    assert consumer.blocks("engine-a") == truth.blocks("engine-a")
    assert consumer.copies("engine-a") == truth.copies("engine-a") > 20
    publisher.close()
