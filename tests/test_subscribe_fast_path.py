"""The subscriber's hot path: pages of entries, the inlined in-order path and its hand-off
to the general one, KV bodies decoded on first read, and the cursor in mid-page."""

from __future__ import annotations

import time

import msgspec
from kvbus.transports import Record
from kvbus.transports.packing import make_packs

import kvbus
from kvbus.bus.intake import SLICE
from kvbus.bus.subscription import Message, Resync, ResyncReason
from kvbus.wire.events import KVEventBatch, decode_kv_batch

from .conftest import append_raw, collect, envelope, kv_payload, seqs, take_then_close
from .servers import RedisServer

EPOCH = time.time_ns() - 10**9


async def test_a_gap_in_the_middle_of_a_page_is_held_and_repaired_in_order(
    memory_url: str,
) -> None:
    # One page: 1, 2 on the fast path; 4 opens a gap (held), 3 fills it, 5 is fast again.
    await append_raw(memory_url, [envelope("a", EPOCH, s) for s in (1, 2, 4, 3, 5, 6)])
    items, sub = await collect(memory_url)
    assert seqs(items) == [1, 2, 3, 4, 5, 6]
    assert sub.stats.gaps_repaired == 1 and sub.stats.resyncs == 0
    assert sub.stats.delivered == 6


async def test_a_gap_never_filled_is_a_resync_then_the_fast_path_resumes(
    memory_url: str,
) -> None:
    await append_raw(memory_url, [envelope("a", EPOCH, s) for s in (1, 2, 4, 5, 6)])
    items, sub = await collect(memory_url, gap_timeout=0.05)
    assert [i for i in items if isinstance(i, Resync)] == [
        Resync("a", EPOCH, ResyncReason.GAP, (3, 3))
    ]
    assert seqs(items) == [1, 2, 4, 5, 6]
    assert sub.stats.gaps_lost == 1


async def test_duplicates_and_a_new_epoch_leave_the_fast_path(memory_url: str) -> None:
    later = EPOCH + 1000
    data = [envelope("a", EPOCH, 1), envelope("a", EPOCH, 2), envelope("a", EPOCH, 2)]
    data += [envelope("a", later, 1), envelope("a", EPOCH, 3), envelope("a", later, 2)]
    await append_raw(memory_url, data)
    items, sub = await collect(memory_url)
    assert [(i.epoch, i.seq) for i in items if isinstance(i, Message)] == [
        (EPOCH, 1),
        (EPOCH, 2),
        (later, 1),
        (later, 2),
    ]
    assert sub.stats.duplicates == 1 and sub.stats.stale == 1
    assert any(isinstance(i, Resync) and i.reason is ResyncReason.NEW_EPOCH for i in items)


async def test_bad_entries_inside_a_page_are_counted_and_their_neighbours_delivered(
    memory_url: str,
) -> None:
    data = [envelope("a", EPOCH, 1), b"\x95garbage", envelope("a", EPOCH, 2)]
    data += [envelope("a", EPOCH, 3, b"\xc1"), envelope("a", EPOCH, 4)]
    await append_raw(memory_url, data)
    items, sub = await collect(memory_url)
    assert seqs(items) == [1, 2, 4]
    assert Resync("a", EPOCH, ResyncReason.MALFORMED, (3, 3)) in items
    assert sub.stats.malformed == 2 and sub.stats.delivered == 3


async def test_a_bad_envelope_inside_a_redis_pack_is_skipped_alone(
    redis_server: RedisServer,
) -> None:
    import redis.asyncio as redis

    stream = f"fastpack{time.monotonic_ns()}"
    data = [envelope("a", EPOCH, 1), b"\xc1not an envelope", envelope("a", EPOCH, 2)]
    data += [envelope("a", EPOCH, 3), envelope("a", EPOCH, 4, b"\x93\xc1")]
    (pack,) = make_packs([Record("a", f"a:{i}", d) for i, d in enumerate(data)])
    client = redis.Redis.from_url(redis_server.url)
    await client.xadd(f"kvbus:{stream}", {"d": pack.data})
    await client.aclose()
    sub = kvbus.subscribe(stream, redis_server.url, follow=False)
    items = [item async for item in sub]
    assert seqs(items) == [1, 2, 3]
    assert items[-1] == Resync("a", EPOCH, ResyncReason.MALFORMED, (4, 4))
    assert sub.stats.malformed == 2
    assert [i.position for i in items if isinstance(i, Message)][1].endswith("/2")


async def test_a_kv_body_is_decoded_on_first_read_and_kept(memory_url: str) -> None:
    unknown = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockTeleported"}, {"type": "AllBlocksCleared"}]]
    )
    await append_raw(memory_url, [envelope("a", EPOCH, 1), envelope("a", EPOCH, 2, unknown)])
    items, sub = await collect(memory_url)
    first, second = items
    assert isinstance(first, Message) and isinstance(second, Message)
    assert sub.stats.skipped_events == 0  # nothing decoded yet
    assert first.body == decode_kv_batch(first.payload)[0]
    assert first.body.events == decode_kv_batch(kv_payload(1))[0].events
    assert second.body is second.body  # decoded once
    assert isinstance(second.body, KVEventBatch) and len(second.body.events) == 1
    assert sub.stats.skipped_events == 1


async def test_a_cursor_taken_in_the_middle_of_a_page_resumes_exactly(memory_url: str) -> None:
    # 1,000 messages of two sources: one page of the memory transport, ingested in slices.
    await append_raw(
        memory_url, [envelope(source, EPOCH, s) for s in range(1, 501) for source in "ab"]
    )
    first, cursor = await take_then_close(kvbus.subscribe(url=memory_url, follow=False), 301)
    rest, _ = await collect(memory_url, cursor=cursor.to_bytes())
    for source in "ab":
        assert seqs(first, source) + seqs(rest, source) == list(range(1, 501))
    assert not any(isinstance(i, Resync) for i in first + rest)


async def test_a_consumer_that_reads_every_body_gets_them_decoded_at_delivery(
    memory_url: str,
) -> None:
    unknown = msgspec.msgpack.encode([1.0, [{"type": "BlockTeleported"}]])
    data = [envelope("a", EPOCH, s) for s in range(1, 600)]
    data += [envelope("a", EPOCH, 600, unknown), envelope("a", EPOCH, 601, b"\xc1")]
    data += [envelope("a", EPOCH, 602)]
    await append_raw(memory_url, data)
    sub = kvbus.subscribe(url=memory_url, follow=False)
    items: list[Message | Resync] = []
    async for item in sub:
        items.append(item)
        if isinstance(item, Message) and item.seq == 600:
            # Decoded (and its unknown event counted) before anyone read this body.
            assert sub.stats.skipped_events == 1
        elif isinstance(item, Message):
            assert isinstance(item.body, KVEventBatch) and len(item.body.events) == 1
    assert seqs(items) == [*range(1, 601), 602]
    assert Resync("a", EPOCH, ResyncReason.MALFORMED, (601, 601)) in items
    assert sub.stats.malformed == 1 and sub.stats.skipped_events == 1


async def test_an_event_with_a_string_that_is_not_utf8_is_skipped_when_read(
    memory_url: str,
) -> None:
    bad = msgspec.Raw(b"\xa1\x80")  # a one-byte string that is not UTF-8
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [1], "medium": bad},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    source_bad = b"\x97\x01\x01\xa1\x80" + envelope("a", EPOCH, 1)[5:]  # source not UTF-8
    await append_raw(memory_url, [envelope("a", EPOCH, 1, payload), source_bad])
    items, sub = await collect(memory_url)
    (message,) = items
    assert isinstance(message, Message)
    assert message.body == KVEventBatch(1.0, [kvbus.AllBlocksCleared()])
    assert sub.stats.skipped_events == 1 and sub.stats.malformed == 1


async def test_a_subscription_checks_every_kv_batch_it_delivers(memory_url: str) -> None:
    """Batches msgspec refuses (or nests too deep) are MALFORMED resyncs, wherever in the
    page they land; ones it accepts (an unknown event with an ext value) are delivered.
    (Moved from tests/test_kv_check_kernel.py, where it ran with either kernel: the
    subscriber's C check is gone, msgspec checks every batch.)"""
    ext = msgspec.msgpack.encode(
        [1.5, [{"type": "AllBlocksCleared", "x": msgspec.msgpack.Ext(1, b"")}]]
    )
    payloads: list[bytes | None] = [None, ext, b"\x92\xcb" + bytes(8) + b"\x91\xc1", None]
    payloads += [b"\x92\xcb" + bytes(8) + b"\x91" * 3000 + b"\xc0", None]
    # 600 messages: the bad ones land in the first and the last slice of the page.
    data = [envelope("a", EPOCH, seq, p) for seq, p in enumerate(payloads, 1)]
    data += [envelope("a", EPOCH, seq) for seq in range(len(data) + 1, 600)]
    data.append(envelope("a", EPOCH, 600, b"\x93\xcb" + bytes(8) + b"\x90\xc4"))
    await append_raw(memory_url, data)
    items, sub = await collect(memory_url)
    assert seqs(items) == [1, 2, 4, *range(6, 600)]
    lost = [i.lost for i in items if isinstance(i, Resync)]
    assert lost == [(3, 3), (5, 5), (600, 600)]
    assert all(i.reason is ResyncReason.MALFORMED for i in items if isinstance(i, Resync))
    assert sub.stats.malformed == 3 and sub.stats.delivered == 597
    second = items[1]
    assert isinstance(second, Message) and len(second.body.events) == 1  # type: ignore[union-attr]


async def test_a_consumer_that_reads_bodies_gets_them_decoded_as_they_are_checked(
    memory_url: str,
) -> None:
    """Once the consumer has read the body of every batch delivered undecoded since the
    subscriber last looked, the next ones come decoded (one decode, no separate check),
    even when it let an earlier body go unread (a warm-up read, a skipped message)."""
    slice_ = SLICE
    await append_raw(memory_url, [envelope("a", EPOCH, s) for s in range(1, 4 * slice_ + 1)])
    sub = kvbus.subscribe(url=memory_url, follow=False)
    decoded_on_arrival = []
    async for item in sub:
        assert isinstance(item, Message)
        decoded_on_arrival.append(item.decoded)
        if item.seq > 1:  # the first body is never read
            assert isinstance(item.body, KVEventBatch)
    await sub.aclose()
    # Slice 1 and 2 undecoded (slice 1's first body was not read when slice 2 began),
    # then decoded as checked.
    assert decoded_on_arrival == [False] * 2 * slice_ + [True] * 2 * slice_
    assert sub.stats.delivered == 4 * slice_ and sub.stats.malformed == 0
