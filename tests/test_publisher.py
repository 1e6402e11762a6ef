"""Publisher: publish() never blocks the engine thread; losses are counted and announced."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from kvbus.transports import Record, RecordTooLarge
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus import BlockStored, KVEventBatch, LossNotice, Message, Resync, ResyncReason
from kvbus.wire.envelope import Envelope, decode_envelope
from kvbus.wire.events import encode

from .conftest import collect, kv_payload, lost_seqs
from .servers import RedisServer, free_port


class StalledTransport(MemoryTransport):
    """memory:// whose appends hang (stalled) or fail (down) until released."""

    def __init__(self, url: str, mode: str) -> None:
        super().__init__(url)
        self.mode = mode
        self.released = threading.Event()
        self.attempts = 0

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        self.attempts += 1
        if not self.released.is_set():
            if self.mode == "down":
                raise ConnectionError("backend down")
            await asyncio.to_thread(self.released.wait)
        await super().append(stream, records)


@pytest.mark.parametrize("mode", ["stalled", "down"])
def test_publish_never_blocks_and_losses_are_exact(memory_url: str, mode: str) -> None:
    transport = StalledTransport(memory_url, mode)
    publisher = kvbus.Publisher(
        memory_url, source="engine", max_queue=10, max_batch=4, transport=transport
    )
    # The backend stays stalled until every publish() call has returned: if publish()
    # blocked on the backend this loop could never finish.
    results = [publisher.publish(kv_payload(i)) for i in range(200)]
    assert not transport.released.is_set()
    assert results.count(False) == publisher.stats.dropped > 0
    # At most the queue bound plus one batch in the sender's hands (and SourceStarted).
    assert results.count(True) <= 10 + 4
    deadline = time.monotonic() + 10
    while transport.attempts < (2 if mode == "down" else 1) and time.monotonic() < deadline:
        time.sleep(0.01)  # let the backend outage be seen by the sender for real
    transport.released.set()
    assert publisher.flush()
    for i in range(200, 205):  # the next messages after the loss carry the gap marker
        assert publisher.publish(kv_payload(i))
    publisher.close()
    if mode == "down":
        assert publisher.stats.send_errors > 0
    items, sub = asyncio.run(collect(memory_url, gap_timeout=60))
    delivered = {i.seq for i in items if isinstance(i, Message)}
    lost = lost_seqs(items)
    total = 1 + 200 + 5 + 1  # SourceStarted, the stalled burst, the recovery, SourceStopped
    assert delivered | lost == set(range(1, total + 1)) and not delivered & lost
    # Once the backend recovered, the newest drop (nothing queued behind it) was
    # announced at once by a LossNotice carrying that seq, announced lost with the rest.
    assert not [i for i in items if isinstance(i, Message) and isinstance(i.body, LossNotice)]
    assert len(lost) == publisher.stats.dropped
    assert all(i.reason is ResyncReason.DROPPED for i in items if isinstance(i, Resync))
    assert sub.stats.gaps_lost >= 1


def test_publish_from_many_threads_keeps_unique_seqs(memory_url: str) -> None:
    publisher = kvbus.Publisher(memory_url, source="engine", max_queue=100_000)

    def burst() -> None:
        for i in range(2_000):
            publisher.publish(kv_payload(i))

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    publisher.close()
    items, _ = asyncio.run(collect(memory_url))
    assert [i.seq for i in items if isinstance(i, Message)] == list(range(1, 8003))


def test_on_memory_publish_stores_each_message_itself_in_seq_order(memory_url: str) -> None:
    """On memory:// publish() appends on the caller's thread (`Transport.inline_append`):
    each message is in the stream when publish() returns, without waiting for a flush,
    and threads publishing at once leave the stream in seq order. A memory:// subclass
    that overrides ``append`` is appended to through it, by the sender thread."""

    def stored() -> list[Envelope]:
        async def read() -> list[bytes]:
            return [e.data async for e in MemoryTransport(memory_url).read("kv")]

        return [decode_envelope(data) for data in asyncio.run(read())]

    publisher = kvbus.Publisher(memory_url, source="engine", max_queue=100_000)
    for i in range(100):
        assert publisher.publish(kv_payload(i))
        assert len(stored()) == i + 2  # SourceStarted, then this one
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over inside publish() as often as it can

    def burst() -> None:
        for i in range(2_000):
            publisher.publish(kv_payload(i))

    try:
        threads = [threading.Thread(target=burst) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert publisher.queue_messages == 0  # nothing was left for the sender thread
    publisher.close()
    envelopes = stored()
    assert [e.seq for e in envelopes] == list(range(1, 8103))  # the stream's own order
    assert all(e.lost_from == 0 for e in envelopes)
    assert publisher.stats.sent == 8102 and publisher.stats.dropped == 0

    stalled_url = f"{memory_url}-stalled"
    overridden = StalledTransport(stalled_url, "stalled")
    assert overridden.inline_append is None
    with kvbus.Publisher(stalled_url, source="e", transport=overridden) as stalled:
        assert stalled.publish(kv_payload(0))
        assert not overridden.released.is_set()  # publish() did not wait for the append
        overridden.released.set()
        assert stalled.flush(5)


def test_on_memory_a_reader_whose_loop_closed_costs_publish_nothing(memory_url: str) -> None:
    """A memory:// reader left waiting when its event loop closed (a subscriber dropped
    without aclose) has no loop to wake: publish(), which appends on its caller's thread
    there, still returns and stores the message."""
    transport = MemoryTransport(memory_url)

    async def wait_forever() -> None:
        async for _ in transport.read("kv", follow=True):
            pass

    loop = asyncio.new_event_loop()
    task = loop.create_task(wait_forever())
    loop.run_until_complete(asyncio.sleep(0.05))  # the read now waits for an append
    loop.close()  # without cancelling it, as a dropped subscriber's loop ends
    with kvbus.Publisher(memory_url, source="engine") as publisher:
        assert publisher.publish(kv_payload(0))
        assert publisher.stats.dropped == 0
    assert not task.done()
    items, _ = asyncio.run(collect(memory_url))
    assert [type(i.body).__name__ for i in items if isinstance(i, Message)] == [
        "SourceStarted", "KVEventBatch", "SourceStopped"
    ]  # fmt: skip


def test_close_flushes_and_publish_after_close_is_dropped(memory_url: str) -> None:
    publisher = kvbus.Publisher(memory_url, source="engine")
    for i in range(1000):
        publisher.publish(kv_payload(i))
    publisher.close()
    assert publisher.stats.sent == 1002 and publisher.stats.dropped == 0
    assert publisher.publish(kv_payload(0)) is False
    assert publisher.stats.dropped == 1
    publisher.close()  # idempotent


def test_an_idle_sender_is_woken_and_a_closed_publisher_leaves_nothing_open(
    memory_url: str,
) -> None:
    """Messages published with the sender idle in between (each one a wake-up) are all
    sent; a closed Publisher leaves no thread or file descriptor behind."""

    def pipes() -> set[str]:
        """This process's open pipe ends (``pipe:[inode]``, read end and write end apart
        by their fd)."""
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own fd, gone by now
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("pipe:"):
                    found.add(f"{fd} {link}")
        return found

    gc.collect()
    pipes_before, threads_before = pipes(), set(threading.enumerate())
    for round in range(20):
        publisher = kvbus.Publisher(memory_url, source=f"engine{round}")
        for i in range(5):
            publisher.publish(kv_payload(i))
            time.sleep(0.002)
        assert publisher.flush(5), publisher.stats
        publisher.close()
        assert publisher.stats.sent == 7 and publisher.stats.dropped == 0
        del publisher
    gc.collect()
    assert not [t.name for t in set(threading.enumerate()) - threads_before]
    assert not pipes() - pipes_before


class RefusingTransport(MemoryTransport):
    """memory:// that refuses records over 2 KiB (as NATS does past its max_payload),
    and fails once, with a connection error, the first append after a refusal."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.fail_next = False

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("blip")
        for record in records:
            if len(record.data) > 2048:
                self.fail_next = True
                raise RecordTooLarge(record.msg_id, len(record.data), 2048)
        await super().append(stream, records)


async def test_a_refused_record_is_dropped_once_across_retries(memory_url: str) -> None:
    """The transport refuses one record of an append, then the connection blips: the
    retry sends the rest, and the refused one is dropped and announced once."""
    transport = RefusingTransport(memory_url)
    publisher = kvbus.Publisher(memory_url, source="e", transport=transport)
    # The three in one append: queued while the idle sender is not woken, then woken.
    while not publisher._queue.idle:  # noqa: ASYNC110 - polls the sender thread
        await asyncio.sleep(0.001)
    publisher._queue.idle = False
    for payload in (kv_payload(1), b"\x00" * 4096, kv_payload(3)):
        publisher.publish(payload)
    publisher._queue.wake()
    assert await publisher.aflush(5)
    await publisher.aclose()
    assert (publisher.stats.dropped, publisher.stats.send_errors) == (1, 1)
    assert publisher.stats.sent == 5  # SourceStarted, 1, a LossNotice for 2, 3, SourceStopped
    items, sub = await collect(memory_url, gap_timeout=3600)  # no waiting on a gap
    # At once, as dropped: the notice took the refused record's seq.
    assert Resync("e", publisher.epoch, ResyncReason.DROPPED, (3, 3)) in items
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 2, 4, 5]
    assert sub.stats.resyncs == 1


async def test_a_refused_record_after_a_loss_keeps_its_gap_marker(memory_url: str) -> None:
    """The refused record carried the marker of an earlier loss: its notice keeps it,
    and consumers get one Resync for both."""
    transport = RefusingTransport(memory_url)
    publisher = kvbus.Publisher(memory_url, source="e", transport=transport)
    while not publisher._queue.idle:  # noqa: ASYNC110 - polls the sender thread
        await asyncio.sleep(0.001)
    publisher._queue.idle = False  # what follows is queued before the sender wakes
    publisher.announce_loss()  # seq 2
    publisher.publish(b"\x00" * 4096)  # seq 3: carries the marker for 2, and is refused
    publisher.publish(kv_payload(4))
    publisher._queue.wake()
    assert await publisher.aflush(5)
    await publisher.aclose()
    items, _ = await collect(memory_url, gap_timeout=3600)
    resyncs = [i for i in items if isinstance(i, Resync)]
    assert resyncs == [Resync("e", publisher.epoch, ResyncReason.DROPPED, (2, 3))]
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 4, 5]


def test_close_gives_up_on_a_dead_backend(memory_url: str) -> None:
    transport = StalledTransport(memory_url, "down")
    publisher = kvbus.Publisher(memory_url, source="engine", transport=transport)
    publisher.publish(kv_payload(1))
    publisher.close(timeout=0.3)
    assert publisher.stats.sent == 0 and publisher.stats.dropped == 3


async def test_oversized_message_is_dropped_and_announced(memory_url: str) -> None:
    async with kvbus.Publisher(memory_url, source="e", max_message_bytes=2048) as p:
        p.publish(kv_payload(1))
        p.publish(b"\x00" * 4096)
        p.publish(kv_payload(3))
    assert p.stats.dropped == 1
    items, _ = await collect(memory_url)
    assert Resync("e", p.epoch, ResyncReason.DROPPED, (3, 3)) in items


async def test_usable_from_asyncio(memory_url: str) -> None:
    async with kvbus.Publisher(memory_url, source="e") as p:
        assert p.publish(kv_payload(1))
        assert await p.aflush()
    items, _ = await collect(memory_url)
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 2, 3]


async def test_unencodable_payload_is_dropped_and_the_sender_survives(memory_url: str) -> None:
    async with kvbus.Publisher(memory_url, source="e") as p:
        p.publish(object())  # type: ignore[arg-type]
        p.publish(kv_payload(3))
    assert p.stats.dropped == 1
    items, _ = await collect(memory_url)
    assert Resync("e", p.epoch, ResyncReason.DROPPED, (2, 2)) in items
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 3, 4]


def test_trailing_drops_are_announced_without_a_further_publish(memory_url: str) -> None:
    """The engine goes quiet while the backend is down: consumers still learn which
    seqs were dropped as soon as it recovers, not at the engine's next message."""
    transport = StalledTransport(memory_url, "down")
    publisher = kvbus.Publisher(memory_url, source="engine", max_queue=5, transport=transport)
    accepted = [publisher.publish(kv_payload(i)) for i in range(50)]
    transport.released.set()
    assert publisher.flush()

    async def read() -> list[Message | Resync]:
        sub = kvbus.subscribe(url=memory_url, gap_timeout=3600)  # no waiting on gaps
        items: list[Message | Resync] = []
        async for item in sub:
            items.append(item)
            if isinstance(item, Resync):
                break
        await sub.aclose()
        return items

    items = asyncio.run(asyncio.wait_for(read(), 10))
    dropped_seqs = {i + 2 for i, ok in enumerate(accepted) if not ok}  # seq 1: SourceStarted
    # One Resync for them all, the LossNotice's own seq (the last dropped) included.
    assert items[-1] == Resync(
        "engine", publisher.epoch, ResyncReason.DROPPED, (min(dropped_seqs), max(dropped_seqs))
    )
    assert lost_seqs(items) == dropped_seqs
    publisher.close()


async def test_a_lone_trailing_drop_is_a_resync(memory_url: str) -> None:
    """The queue is full for one publish, and the engine then goes quiet: the LossNotice
    that takes the dropped seq carries no gap marker (nothing before it is missing),
    yet consumers still get a Resync for the batch lost."""
    transport = StalledTransport(memory_url, "stalled")
    publisher = kvbus.Publisher(memory_url, source="e", max_queue=2, transport=transport)
    while transport.attempts == 0:  # noqa: ASYNC110 - SourceStarted, stalled in append
        await asyncio.sleep(0.001)
    assert [publisher.publish(kv_payload(i)) for i in range(3)] == [True, True, False]
    transport.released.set()
    assert await publisher.aflush(5)
    items, _ = await collect(memory_url)
    assert [i.seq for i in items if isinstance(i, Message)] == [1, 2, 3]
    assert items[-1] == Resync("e", publisher.epoch, ResyncReason.DROPPED, (4, 4))
    await publisher.aclose()


@pytest.mark.parametrize("scheme", ["redis", "nats", "redis+sentinel"])
async def test_passwords_stay_out_of_logs_and_repr(
    scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    option = "timeout" if scheme == "nats" else "socket_connect_timeout"
    url = f"{scheme}://kvbus-user:s3cret-pw@127.0.0.1:{free_port()}?{option}=0.5"
    if scheme == "redis+sentinel":  # the service, and the Sentinels' own password
        url = url.replace("?", "/kvbus?sentinel_password=s3cret-sp&")
    with caplog.at_level(logging.INFO, logger="kvbus"):
        publisher = kvbus.Publisher(url, source="engine")
        for _ in range(100):
            if publisher.stats.send_errors >= 1:
                break
            await asyncio.sleep(0.05)
        assert publisher.stats.send_errors >= 1  # the server is not there: errors logged
        assert "s3cret" not in repr(publisher)
        await publisher.aclose(0.5)
    assert "kvbus-user:***@" in caplog.text
    assert "s3cret" not in caplog.text


def test_the_queue_is_bounded_in_bytes(memory_url: str) -> None:
    """A stalled backend holds at most max_queue_bytes of payload, however few messages
    that is (the 10k-message queue alone held 10k x whatever size)."""
    transport = StalledTransport(memory_url, "stalled")
    publisher = kvbus.Publisher(
        memory_url, source="engine", max_queue_bytes=10 * 2**20, max_batch=1, transport=transport
    )
    block = BlockStored([1], None, [5] * (2**20 - 64), 16, None, "GPU", None)
    megabyte = encode(KVEventBatch(0.0, [block]))  # a 1 MiB batch
    results = [publisher.publish(megabyte) for _ in range(100)]
    # About ten in the queue (SourceStarted counts too), and one in the sender's hands.
    assert 9 <= results.count(True) <= 12
    transport.released.set()
    publisher.close()
    items, _ = asyncio.run(collect(memory_url))
    assert sum(isinstance(i, Message) and i.payload == megabyte for i in items) == results.count(
        True
    )


def _close_while_threads_publish(url: str, source: str, payload: bytes) -> None:
    """Three threads publish until refused while this one closes the Publisher."""
    publisher = kvbus.Publisher(url, source=source, max_queue=10**6)
    accepted, refused = [0] * 3, [0] * 3
    started = threading.Barrier(4)

    def spam(i: int) -> None:
        started.wait()
        while publisher.publish(payload):
            accepted[i] += 1
        refused[i] += 1

    threads = [threading.Thread(target=spam, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.001)
    publisher.close()
    for t in threads:
        t.join()
    stats = publisher.stats
    assert stats.published == sum(accepted) + 2  # SourceStarted, SourceStopped
    assert stats.sent == stats.published, (source, stats)
    assert stats.dropped == sum(refused)


def test_publish_racing_close_from_other_threads_leaves_nothing_unsent(memory_url: str) -> None:
    """Threads publishing while another closes the Publisher: every publish() that
    returned True is sent (and the stream holds it), every other one is counted dropped
    (none announced: the epoch ended), and nothing follows SourceStopped."""
    payload = kv_payload(0)
    # A bus per round: a round publishes thousands of messages, as many as the threads
    # manage before close(), and one stream would trim the oldest rounds' (maxlen).
    urls = [f"{memory_url}-{round}" for round in range(30)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over between publish()'s check and append
    try:
        for url in urls:
            _close_while_threads_publish(url, "engine", payload)
    finally:
        sys.setswitchinterval(switch)
    for url in urls:
        items, _ = asyncio.run(collect(url, gap_timeout=0))
        assert not [i for i in items if isinstance(i, Resync)]
        assert [i.seq for i in items] == list(range(1, len(items) + 1))
        assert isinstance(items[-1], Message)
        assert isinstance(items[-1].body, kvbus.SourceStopped)


def _in_forked_child(check: Callable[[], None]) -> None:
    """Run ``check`` in a forked child; fail here with what failed there."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and never return into pytest
        os.close(read_fd)
        problem = b""
        try:
            check()
        except BaseException as error:  # reported to the parent
            problem = repr(error).encode() or b"failed"
        os.write(write_fd, problem)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        problem = reader.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and not problem, problem.decode()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_drops_through_the_parents_publisher_and_publishes_through_its_own(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Publisher open across a fork is closed in the child: the child's publish() is
    dropped and counted (its sender thread did not survive, and its seqs are the
    parent's), even with the Publisher's lock held by a parent thread at the fork, and
    close() does not wait for a thread that is not there. A Publisher the child opens
    works. The parent's goes on as if nothing happened."""
    stream = f"fork{time.monotonic_ns()}"
    parent = kvbus.Publisher(redis_server.url, stream=stream, source="parent")
    assert parent.publish(kv_payload(1)) and parent.flush()

    def child() -> None:
        started = time.monotonic()
        assert parent.publish(kv_payload(2)) is False
        assert parent.stats.dropped == 1
        parent.close()
        assert time.monotonic() - started < 2
        with kvbus.Publisher(redis_server.url, stream=stream, source="child") as own:
            assert own.publish(kv_payload(3))
        assert own.stats.sent == 3  # SourceStarted, the batch, SourceStopped

    parent._queue.lock.acquire()  # as if a parent thread were inside publish() at the fork
    try:
        with caplog.at_level(logging.WARNING, "kvbus.bus.publisher"):
            _in_forked_child(child)
    finally:
        parent._queue.lock.release()
    assert parent.publish(kv_payload(4))
    parent.close()
    assert parent.stats.sent == 4 and parent.stats.dropped == 0
    items, _ = asyncio.run(collect(redis_server.url, stream=stream, gap_timeout=0))
    assert not [i for i in items if isinstance(i, Resync)]
    by_source: dict[str, list[int]] = {}
    for item in items:
        if isinstance(item, Message) and item.kind is kvbus.Kind.KV:
            by_source.setdefault(item.source, []).append(item.seq)
    assert by_source == {"parent": [2, 3], "child": [2]}
