"""Clustered backends, against real servers: a 3-node NATS JetStream cluster whose
stream leader is killed (SIGKILL) mid-stream and restarted on the same store, and a
Redis primary with a replica and a Sentinel whose primary is killed.

Run with ``-s`` to see the failover figures (seconds from the kill to the next message
delivered); no timing is asserted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest
import redis

import kvbus
from kvbus import Message, Resync

from .conftest import Item, collect, lost_seqs, seqs
from .servers import NatsCluster, NatsNode, RedisWithSentinel
from .test_faults import PacedPublishing

TOTAL = 3000
RATE = 600  # messages/s: 5 s of publishing, the kill a third of the way in


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    nodes = NatsCluster(tmp_path)
    await asyncio.to_thread(nodes.start)
    yield nodes
    await asyncio.to_thread(nodes.stop)


async def stream_leader(cluster: NatsCluster, stream: str) -> NatsNode:
    """The node that leads ``KVBUS_<stream>`` now, as JetStream reports it."""
    nc = await nats.connect([node.url for node in cluster])
    try:
        # A stream just created may take its cluster a moment to answer for (5 s per
        # try; on 2 loaded cores one try has run out).
        for tries_left in reversed(range(6)):
            try:
                info = await nc.jetstream().stream_info(f"KVBUS_{stream}")
                break
            except nats.errors.TimeoutError:
                if not tries_left:
                    raise
        assert info.cluster is not None and info.cluster.leader, info
        assert info.config.num_replicas == 3
        return cluster.node(info.cluster.leader)
    finally:
        await nc.close()


async def seconds_until_led(cluster: NatsCluster, stream: str) -> float:
    """Seconds until JetStream answers for ``KVBUS_<stream>`` (a leader is elected),
    asked every 0.25 s by a plain nats-py client: the server's own failover time."""
    began = time.monotonic()

    async def expected(error: Exception) -> None:
        """Connection errors while a server is down: what is measured here."""

    nc = await nats.connect(
        [node.url for node in cluster], reconnect_time_wait=0.1, error_cb=expected
    )
    js = nc.jetstream(timeout=0.25)
    try:
        while True:
            try:
                info = await js.stream_info(f"KVBUS_{stream}")
                if info.cluster is not None and info.cluster.leader:
                    return time.monotonic() - began
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.01)
    finally:
        await nc.close()


class Failover(msgspec.Struct):
    """One kill, as a test run saw it (seconds from the kill)."""

    server: float
    """until the backend served again (JetStream elected a leader; Sentinel named the
    new primary)"""
    delivered: float
    """until the first message published after the kill reached the subscriber"""
    send_errors: int
    read_errors: int
    copies: int
    lost: int = 0
    """seqs a reader of the whole history was told were lost"""

    def __str__(self) -> str:
        return (
            f"served again after {self.server:.2f} s, the first message published since "
            f"delivered after {self.delivered:.2f} s; {self.send_errors} send errors, "
            f"{self.read_errors} read errors, {self.copies} stored copies dropped, "
            f"{self.lost} announced lost"
        )


class Follower:
    """A following subscription recording each item with the time it arrived."""

    def __init__(self, sub: kvbus.Subscription, last: int) -> None:
        self.sub = sub
        self.items: list[Item] = []
        self.arrived: list[float] = []
        self.task = asyncio.create_task(self._run(last))

    async def _run(self, last: int) -> None:
        async for item in self.sub:
            self.items.append(item)
            self.arrived.append(time.monotonic())
            if isinstance(item, Message) and item.seq >= last:
                return

    async def finish(self, publisher: kvbus.Publisher, within: float = 60) -> None:
        """Wait for the last seq; if it never comes, fail saying how far it got."""
        try:
            await asyncio.wait_for(asyncio.shield(self.task), within)
        except TimeoutError:
            got = [item.seq for item in self.items if isinstance(item, Message)]
            raise AssertionError(
                f"the follower stopped at seq {got[-1] if got else None} of {len(got)} "
                f"messages and {len(self.items) - len(got)} resyncs; publisher {publisher.stats}; "
                f"subscription {self.sub.stats}; cursor {self.sub.cursor}"
            ) from None

    def first_published_after(self, wall_time: float) -> float:
        """When (``time.monotonic()``) the first message published at or after
        ``wall_time`` arrived."""
        return next(
            t
            for t, item in zip(self.arrived, self.items, strict=True)
            if isinstance(item, Message) and item.ts >= wall_time
        )


async def ride_through_a_kill(
    cluster: NatsCluster, stream: str, sub_url: str | None = None
) -> Failover:
    """Publish ``TOTAL`` messages at ``RATE`` through the cluster URL with replicas=3,
    follow them (through ``sub_url``, else the cluster URL), SIGKILL the stream's leader
    a third of the way, restart it on its store 1 s later. Asserts every seq arrived
    exactly once, in order, with no Resync and nothing dropped."""
    url = cluster.url(replicas=3)
    publisher = kvbus.Publisher(url, stream=stream, source="engine")
    try:
        assert await publisher.aflush(30), "the replicated stream was never created"
        leader = await stream_leader(cluster, stream)
    except BaseException:
        await publisher.aclose()  # else its client logs reconnects into the next test
        raise
    follower = Follower(kvbus.subscribe(stream, (sub_url or url).format(leader=leader)), TOTAL + 2)
    try:
        engine = PacedPublishing(publisher, TOTAL, rate=RATE).start()
        await engine.wait_published(TOTAL // 3)
        killed, killed_wall = time.monotonic(), time.time()
        leader.kill()
        led = asyncio.create_task(seconds_until_led(cluster, stream))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(leader.start)
        await engine.join()
        await publisher.aclose()
        await follower.finish(publisher)
        figures = Failover(
            await led,
            follower.first_published_after(killed_wall) - killed,
            publisher.stats.send_errors,
            follower.sub.stats.transport_errors,
            follower.sub.stats.duplicates,
        )
        assert all(engine.accepted) and publisher.stats.dropped == 0
        assert seqs(follower.items) == list(range(1, TOTAL + 3))  # SourceStarted...Stopped
        assert not [i for i in follower.items if isinstance(i, Resync)]
        return figures
    finally:
        follower.task.cancel()
        await follower.sub.aclose()
        await publisher.aclose()


async def test_stream_leader_killed_and_restarted(cluster: NatsCluster) -> None:
    """``nats://h1,h2,h3?replicas=3``: the leader of the R3 stream is killed mid-stream;
    publisher and subscriber (wherever they are connected) ride through: 0 lost, 0
    duplicated."""
    print(f"\nleader killed: {await ride_through_a_kill(cluster, 'leaderkill')}")


async def test_subscribers_server_killed(cluster: NatsCluster) -> None:
    """The subscriber is connected to the stream leader (its URL names that node alone;
    it learns the others from the cluster) and that server is killed: the subscriber
    reconnects elsewhere and its consumer is recreated on the new leader, from where it
    was."""
    figures = await ride_through_a_kill(cluster, "subkill", "nats://127.0.0.1:{leader.port}")
    print(f"\nthe subscriber's server killed: {figures}")


@pytest.fixture
async def redis_group(tmp_path: Path) -> AsyncIterator[RedisWithSentinel]:
    group = RedisWithSentinel(tmp_path)
    await group.start()
    yield group
    await group.stop()


async def redis_failover(group: RedisWithSentinel, wait: int) -> Failover:
    """Publish ``TOTAL`` messages at ``RATE`` through ``group``'s Sentinel URL (with
    ``wait``), follow them, cut the replicas off (0.3 s, or until the primary alone
    took 20 appends) and SIGKILL the primary, wait for the Sentinel to promote a
    replica, restart the old primary on its store. Asserts
    nothing was dropped and every seq was delivered once, in order, or announced lost,
    to the follower and to a reader of the whole history afterwards; with ``wait``, that
    none was lost."""
    url = group.url(wait=wait) if wait else group.url()
    publisher = kvbus.Publisher(url, stream="failover", source="engine")
    follower = Follower(kvbus.subscribe("failover", url), TOTAL + 2)
    try:
        engine = PacedPublishing(publisher, TOTAL, rate=RATE).start()
        await engine.wait_published(TOTAL // 3)
        group.cut()  # the replicas get nothing more
        # Until the primary alone has taken appends (0.3 s at RATE, unless the machine
        # is so busy that the publisher sent nothing in that time: then wait on).
        cut_at = publisher.stats.sent
        await asyncio.sleep(0.3)
        for _ in range(0 if wait else 500):  # with wait, nothing is acknowledged now
            if publisher.stats.sent >= cut_at + 20:
                break
            await asyncio.sleep(0.01)
        group.primary.kill()
        killed, killed_wall = time.monotonic(), time.time()
        await asyncio.to_thread(
            group.sentinel.wait, lambda: group.primary_port() != group.primary.port, 30, 0.01
        )
        promoted = time.monotonic() - killed
        await asyncio.to_thread(group.primary.start)
        await engine.join()
        # With wait=1 the appends go on only once the Sentinel has pointed a replica at
        # the new primary and it has synced, which can outlast close()'s 10 s on a busy
        # machine; close() would then drop what is still queued.
        assert await publisher.aflush(60), "appends still unsent 60 s after the failover"
        await publisher.aclose()
        try:
            await follower.finish(publisher)
        except AssertionError as error:
            log = (group.sentinel.data_dir / "redis-sentinel.log").read_text()
            raise AssertionError(f"{error}; servers: {redis_states(group)}; {log}") from None
        late, _ = await collect(url, stream="failover")
        figures = Failover(
            promoted,
            follower.first_published_after(killed_wall) - killed,
            publisher.stats.send_errors,
            follower.sub.stats.transport_errors,
            follower.sub.stats.duplicates,
            len(lost_seqs(late)),
        )
        assert all(engine.accepted) and publisher.stats.dropped == 0
        every = set(range(1, TOTAL + 3))
        for reader, items in (("follower", follower.items), ("history", late)):
            delivered = seqs(items)
            assert delivered == sorted(set(delivered)), reader  # in order, each once
            unannounced = every - set(delivered) - lost_seqs(items)
            assert not unannounced, (  # the rest announced
                f"{reader}: {len(unannounced)} seqs neither delivered nor announced lost, "
                f"{min(unannounced)}..{max(unannounced)}; resyncs "
                f"{[i for i in items if isinstance(i, Resync)]}; servers {redis_states(group)}"
                f"; sentinel: {(group.sentinel.data_dir / 'redis-sentinel.log').read_text()}"
            )
            assert not set(delivered) & lost_seqs(items), reader
        if wait:
            assert seqs(late) == seqs(follower.items) == sorted(every)
            assert not [i for i in [*late, *follower.items] if isinstance(i, Resync)]
        return figures
    finally:
        follower.task.cancel()
        await follower.sub.aclose()
        await publisher.aclose()


def redis_states(group: RedisWithSentinel) -> list[str]:
    """Each server's role and the failover stream's last entry (for a failure's message)."""
    try:
        states = [f"the Sentinel names {group.primary_port()}"]
    except redis.RedisError as error:
        states = [f"the Sentinel: {error!r}"]
    for server in (group.primary, *group.replicas):
        try:
            with redis.Redis(port=server.port, socket_timeout=2) as client:
                role = client.execute_command("ROLE")[0]
                last = client.xrevrange("kvbus:failover", count=1)
                states.append(f"{server.port} {role!r} {client.xlen('kvbus:failover')} {last[:1]}")
        except redis.RedisError as error:
            states.append(f"{server.port} {error!r}")
    return states


async def test_redis_primary_killed_without_wait(redis_group: RedisWithSentinel) -> None:
    """``redis+sentinel://``: the primary is SIGKILLed mid-stream after taking appends
    its replicas never got (Redis replicates asynchronously); the Sentinel promotes a
    replica, the old primary is restarted on its store. Publisher and follower ride
    through; the appends only the old primary had are lost, and a reader of the history
    is told so (``Resync(gap)`` with exactly the missing seqs), never silently."""
    figures = await redis_failover(redis_group, wait=0)
    print(f"\nredis primary killed: {figures}")
    assert figures.lost, "the appends only the killed primary had were not lost"


async def test_redis_primary_killed_with_wait(redis_group: RedisWithSentinel) -> None:
    """The same with ``wait=1``: an append is acknowledged only once a replica has it,
    so the failover loses nothing."""
    figures = await redis_failover(redis_group, wait=1)
    print(f"\nredis primary killed, wait=1: {figures}")
    assert figures.lost == 0
