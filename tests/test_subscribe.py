"""subscribe() over memory://: order, duplicates, gaps, resyncs, cursors, bad input."""

from __future__ import annotations

import asyncio
import importlib
import logging

import msgspec
import pytest

import kvbus
from kvbus import Kind, Message, Resync, ResyncReason
from kvbus.logs import LimitedLog
from kvbus.wire.events import KVEventBatch, LoadMetrics, encode

from .conftest import append_raw, collect, envelope, kv_payload, seqs

E1, E2 = 1_000, 2_000


async def test_publisher_to_subscriber_in_order_with_interleaved_sources(memory_url: str) -> None:
    publishers = [kvbus.Publisher(memory_url, source=f"engine-{i}") for i in range(3)]
    for step in range(50):
        for p in publishers:
            p.publish(kv_payload(step))
    for p in publishers:
        p.close()
    items, sub = await collect(memory_url)
    for p in publishers:
        got = [i for i in items if isinstance(i, Message) and i.source == p.source]
        assert [m.seq for m in got] == list(range(1, 53))
        assert got[0].kind is Kind.CONTROL and isinstance(got[0].body, kvbus.SourceStarted)
        assert got[-1].kind is Kind.CONTROL and isinstance(got[-1].body, kvbus.SourceStopped)
        kv = [m.body for m in got if m.kind is Kind.KV]
        assert [b.events[0].block_hashes[0] for b in kv if isinstance(b, KVEventBatch)] == list(
            range(50)
        )
    assert not [i for i in items if isinstance(i, Resync)]
    assert sub.stats.delivered == 3 * 52


async def test_payload_bytes_travel_untouched(memory_url: str) -> None:
    payload = kv_payload(7, blocks=16)
    with kvbus.Publisher(memory_url, source="e") as p:
        p.publish(payload)
    items, _ = await collect(memory_url)
    assert [m.payload for m in items if isinstance(m, Message) and m.kind is Kind.KV] == [payload]


async def test_metrics_payloads(memory_url: str) -> None:
    record = LoadMetrics(
        ts=1.0,
        running=3,
        waiting=1,
        kv_cache_usage=0.5,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
    )
    with kvbus.Publisher(memory_url, source="e") as p:
        p.publish(record, Kind.METRICS)
    items, _ = await collect(memory_url)
    assert [m.body for m in items if isinstance(m, Message) and m.kind is Kind.METRICS] == [record]


async def test_duplicates_are_dropped(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, s) for s in (1, 2, 2, 3, 1, 3, 4)])
    items, sub = await collect(memory_url)
    assert seqs(items) == [1, 2, 3, 4]
    assert sub.stats.duplicates == 3


async def test_out_of_order_gap_repaired_from_history(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, s) for s in (1, 2, 5, 3, 6, 4, 7)])
    items, sub = await collect(memory_url, gap_timeout=30)
    assert seqs(items) == [1, 2, 3, 4, 5, 6, 7]
    assert not [i for i in items if isinstance(i, Resync)]
    assert sub.stats.gaps_repaired >= 1 and sub.stats.gaps_lost == 0


async def test_zero_gap_timeout_declares_a_gap_at_once(memory_url: str) -> None:
    """For state records (metrics): a gap is lost at once, history is not searched, and
    the late copy is a duplicate."""
    await append_raw(memory_url, [envelope("a", E1, s) for s in (1, 3, 2, 4)])
    items, sub = await collect(memory_url, gap_timeout=0)
    assert [(i.seq if isinstance(i, Message) else i.lost) for i in items] == [1, (2, 2), 3, 4]
    assert sub.stats.gaps_repaired == 0 and sub.stats.duplicates == 1


async def test_gap_filled_by_a_late_live_arrival(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, s) for s in (1, 3)])
    sub = kvbus.subscribe(url=memory_url, gap_timeout=30)
    first = await anext(sub)
    assert isinstance(first, Message) and first.seq == 1
    waiting = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # seq 3 is held back while 2 is missing
    await append_raw(memory_url, [envelope("a", E1, 2)])
    assert (await waiting).seq == 2  # type: ignore[union-attr]
    assert (await anext(sub)).seq == 3  # type: ignore[union-attr]
    await sub.aclose()


async def test_unrecoverable_gap_becomes_resync(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, s) for s in (1, 2, 6, 7)])
    items, sub = await collect(memory_url, gap_timeout=0.05)
    assert [type(i).__name__ for i in items] == [
        "Message",
        "Message",
        "Resync",
        "Message",
        "Message",
    ]
    resync = items[2]
    assert resync == Resync("a", E1, ResyncReason.GAP, (3, 5))
    assert seqs(items) == [1, 2, 6, 7] and sub.stats.gaps_lost == 1


async def test_unrecoverable_gap_while_following(memory_url: str) -> None:
    """A following subscription declares the gap after gap_timeout, not at the end."""
    await append_raw(memory_url, [envelope("a", E1, s) for s in (1, 4)])
    async with kvbus.subscribe(url=memory_url, gap_timeout=0.1) as sub:
        got = [await anext(sub) for _ in range(3)]
    assert isinstance(got[1], Resync) and got[1].lost == (2, 3)
    assert isinstance(got[2], Message) and got[2].seq == 4


async def test_trimmed_history_is_reported_not_skipped(memory_url: str) -> None:
    url = memory_url + "?maxlen=5"
    await append_raw(url, [envelope("a", E1, s) for s in range(1, 11)])
    items, _ = await collect(url)
    assert items[0] == Resync("a", E1, ResyncReason.JOINED, (1, 5))
    assert seqs(items) == [6, 7, 8, 9, 10]


async def test_new_epoch_resync_comes_before_new_data_and_stale_is_dropped(memory_url: str) -> None:
    await append_raw(
        memory_url,
        [
            envelope("a", E1, 1),
            envelope("a", E1, 2),
            envelope("b", E1, 1),
            envelope("a", E2, 1),
            envelope("a", E1, 3),  # stale
            envelope("a", E2, 2),
        ],
    )
    items, sub = await collect(memory_url)
    a = [i for i in items if i.source == "a"]
    assert [(type(i).__name__, i.epoch) for i in a] == [
        ("Message", E1),
        ("Message", E1),
        ("Resync", E2),
        ("Message", E2),
        ("Message", E2),
    ]
    assert a[2] == Resync("a", E2, ResyncReason.NEW_EPOCH, None, previous_epoch=E1)
    assert sub.stats.stale == 1
    assert seqs(items, "b") == [1]


async def test_publisher_restart_is_a_new_epoch(memory_url: str) -> None:
    with kvbus.Publisher(memory_url, source="engine") as first:
        first.publish(kv_payload(1))
    with kvbus.Publisher(memory_url, source="engine") as second:
        second.publish(kv_payload(2))
    items, _ = await collect(memory_url)
    resyncs = [i for i in items if isinstance(i, Resync)]
    assert resyncs == [Resync("engine", second.epoch, ResyncReason.NEW_EPOCH, None, first.epoch)]
    index = items.index(resyncs[0])
    assert all(i.epoch == first.epoch for i in items[:index])
    assert all(i.epoch == second.epoch for i in items[index + 1 :])


async def test_publisher_announced_loss_needs_no_waiting(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, 1), envelope("a", E1, 5, lost_from=2)])
    items, _ = await collect(memory_url, gap_timeout=60)  # would hang if it waited
    assert items[1] == Resync("a", E1, ResyncReason.DROPPED, (2, 4))
    assert seqs(items) == [1, 5]


async def test_cursor_resume_loses_nothing_and_repeats_nothing(memory_url: str) -> None:
    with (
        kvbus.Publisher(memory_url, source="a") as pa,
        kvbus.Publisher(memory_url, source="b") as pb,
    ):
        for i in range(40):
            pa.publish(kv_payload(i))
            pb.publish(kv_payload(i))
        pa.flush()
        pb.flush()
        seen: list[tuple[str, int]] = []
        sub = kvbus.subscribe(url=memory_url)
        for _ in range(30):
            item = await anext(sub)
            assert isinstance(item, Message)
            seen.append((item.source, item.seq))
        saved = sub.cursor.to_bytes()  # the consumer persists this, then dies
        await sub.aclose()
        for i in range(40, 60):
            pa.publish(kv_payload(i))
            pb.publish(kv_payload(i))
    items, resumed = await collect(memory_url, cursor=saved)
    seen += [(i.source, i.seq) for i in items if isinstance(i, Message)]
    assert not [i for i in items if isinstance(i, Resync)]
    for source in ("a", "b"):
        assert [s for src, s in seen if src == source] == list(range(1, 63))
    assert resumed.stats.duplicates == 0


async def test_cursor_taken_while_a_gap_is_held_rereads_it(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, 1), envelope("a", E1, 3), envelope("b", E1, 1)])
    sub = kvbus.subscribe(url=memory_url, gap_timeout=60)
    got = [await anext(sub), await anext(sub)]
    assert [(i.source, i.seq) for i in got] == [("a", 1), ("b", 1)]  # a:3 held
    cursor = sub.cursor
    await sub.aclose()
    await append_raw(memory_url, [envelope("a", E1, 2)])
    items, _ = await collect(memory_url, cursor=cursor)
    assert [(i.source, i.seq) for i in items] == [("a", 2), ("a", 3)]


async def test_sources_filter(memory_url: str) -> None:
    await append_raw(memory_url, [envelope(s, E1, 1) for s in ("a", "b", "c")])
    items, _ = await collect(memory_url, sources=["b"])
    assert [i.source for i in items] == ["b"]


async def test_latest_starts_after_history(memory_url: str) -> None:
    await append_raw(memory_url, [envelope("a", E1, 1)])
    async with kvbus.subscribe(url=memory_url, cursor="latest") as sub:
        pending = asyncio.ensure_future(anext(sub))
        await asyncio.sleep(0.05)
        await append_raw(memory_url, [envelope("a", E1, 2)])
        first = await pending
    assert first == Resync("a", E1, ResyncReason.JOINED, (1, 1))


async def test_empty_stream_ends_without_items(memory_url: str) -> None:
    items, sub = await collect(memory_url)
    assert items == [] and sub.stats.delivered == 0


@pytest.mark.parametrize(
    "case",
    [
        "malformed_envelope",
        "malformed_payload",
        "future_version",
        "oversized",
        "unknown_kind",
        "unknown_event",
    ],
)
async def test_bad_input_is_counted_logged_and_skipped(
    memory_url: str, case: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh once-a-second limiter: another test may just have logged the same kind.
    module = importlib.import_module("kvbus.bus.subscription")
    monkeypatch.setattr(module, "_limited", LimitedLog(module.log))
    bad = {
        "malformed_envelope": b"\x92\xa3not an envelope",
        "malformed_payload": envelope("a", E1, 2, b"\xc1\xc1"),
        "future_version": envelope("a", E1, 2, version=99),
        "oversized": envelope("a", E1, 2, b"\x00" * 5000),
        "unknown_kind": envelope("a", E1, 2, kind=9),  # type: ignore[arg-type]
        "unknown_event": envelope(
            "a",
            E1,
            2,
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockTeleported"}, {"type": "AllBlocksCleared"}]]
            ),
        ),
    }[case]
    await append_raw(
        memory_url, [envelope("a", E1, 1), bad, envelope("a", E1, 3), envelope("b", E1, 1)]
    )
    with caplog.at_level(logging.WARNING, logger="kvbus"):
        items, sub = await collect(memory_url, max_message_bytes=4096, gap_timeout=0.05)
        # A batch is decoded (and its unknown events counted) when its body is read.
        bodies = [i.body for i in items if isinstance(i, Message)]
    stat = {
        "malformed_envelope": "malformed",
        "malformed_payload": "malformed",
        "future_version": "future_version",
        "oversized": "oversized",
        "unknown_kind": "unknown_kind",
        "unknown_event": "skipped_events",
    }[case]
    assert getattr(sub.stats, stat) == 1
    assert "skipped" in caplog.text
    # Everything else arrives; a bad envelope leaves a seq hole, reported as such.
    delivered = seqs(items, "a")
    if case == "unknown_event":
        assert delivered == [1, 2, 3]
        batch = bodies[1]
        assert isinstance(batch, KVEventBatch) and batch.events == [kvbus.AllBlocksCleared()]
    else:
        assert delivered == [1, 3]
    if case in ("future_version", "oversized"):
        assert Resync("a", E1, ResyncReason.GAP, (2, 2)) in items
    if case == "malformed_payload":  # seq 2's effect is lost: the consumer must reset "a"
        assert Resync("a", E1, ResyncReason.MALFORMED, (2, 2)) in items
    assert seqs(items, "b") == [1]


async def test_kv_payload_encoded_by_publisher_from_struct(memory_url: str) -> None:
    batch = KVEventBatch(5.0, [kvbus.AllBlocksCleared()], 0)
    with kvbus.Publisher(memory_url, source="e") as p:
        p.publish(batch)
    items, _ = await collect(memory_url)
    assert [m.payload for m in items if isinstance(m, Message) and m.kind is Kind.KV] == [
        encode(batch)
    ]
