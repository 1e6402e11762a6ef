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

import nats
import pytest

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
        info = await nc.jetstream().stream_info(f"KVBUS_{stream}")
        assert info.cluster is not None and info.cluster.leader, info
        assert info.config.num_replicas == 3
        return cluster.node(info.cluster.leader)
    finally:
        await nc.close()


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

    def first_published_after(self, wall_time: float) -> float:
        """When (``time.monotonic()``) the first message published at or after
        ``wall_time`` arrived."""
        return next(
            t
            for t, item in zip(self.arrived, self.items, strict=True)
            if isinstance(item, Message) and item.ts >= wall_time
        )


async def ride_through_a_kill(cluster: NatsCluster, stream: str, sub_url: str | None) -> None:
    """Publish ``TOTAL`` messages at ``RATE`` through the cluster URL with replicas=3,
    follow them (through ``sub_url``, else the cluster URL), SIGKILL the stream's leader
    a third of the way, restart it on its store 1 s later. Asserts every seq arrived
    exactly once, in order, with no Resync and nothing dropped."""
    url = cluster.url(replicas=3)
    publisher = kvbus.Publisher(url, stream=stream, source="engine")
    assert await publisher.aflush(30), "the replicated stream was never created"
    leader = await stream_leader(cluster, stream)
    follower = Follower(kvbus.subscribe(stream, (sub_url or url).format(leader=leader)), TOTAL + 2)
    try:
        engine = PacedPublishing(publisher, TOTAL, rate=RATE).start()
        await engine.wait_published(TOTAL // 3)
        killed, killed_wall = time.monotonic(), time.time()
        leader.kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(leader.start)
        await engine.join()
        await publisher.aclose()
        await asyncio.wait_for(follower.task, 60)
        new_leader = await stream_leader(cluster, stream)
        print(
            f"\n{stream}: killed {leader.name}, new leader {new_leader.name}; "
            f"the first message published since delivered after "
            f"{follower.first_published_after(killed_wall) - killed:.2f} s; "
            f"{publisher.stats.send_errors} send errors, "
            f"{follower.sub.stats.transport_errors} read errors, "
            f"{follower.sub.stats.duplicates} stored copies dropped"
        )
        assert all(engine.accepted) and publisher.stats.dropped == 0
        assert seqs(follower.items) == list(range(1, TOTAL + 3))  # SourceStarted...Stopped
        assert not [i for i in follower.items if isinstance(i, Resync)]
    finally:
        follower.task.cancel()
        await follower.sub.aclose()
        await publisher.aclose()


async def test_stream_leader_killed_and_restarted(cluster: NatsCluster) -> None:
    """``nats://h1,h2,h3?replicas=3``: the leader of the R3 stream is killed mid-stream;
    publisher and subscriber (wherever they are connected) ride through: 0 lost, 0
    duplicated."""
    await ride_through_a_kill(cluster, "leaderkill", None)


async def test_subscribers_server_killed(cluster: NatsCluster) -> None:
    """The subscriber is connected to the stream leader (its URL names that node alone;
    it learns the others from the cluster) and that server is killed: the subscriber
    reconnects elsewhere and its consumer is recreated on the new leader, from where it
    was."""
    await ride_through_a_kill(cluster, "subkill", "nats://127.0.0.1:{leader.port}")


@pytest.fixture
async def redis_group(tmp_path: Path) -> AsyncIterator[RedisWithSentinel]:
    group = RedisWithSentinel(tmp_path)
    await group.start()
    yield group
    await group.stop()


@pytest.mark.parametrize("wait", [0, 1])
async def test_redis_primary_killed_sentinel_fails_over(
    redis_group: RedisWithSentinel, wait: int
) -> None:
    """``redis+sentinel://``: the primary is SIGKILLed mid-stream after taking appends
    its replicas never got (their replication link is cut for 0.3 s: Redis replicates
    asynchronously), the Sentinel promotes a replica, the old primary is restarted on
    its store (the Sentinel makes it a replica later). Publisher and follower ride
    through. Without ``wait`` the appends only the old primary had are lost, and a
    reader of the history is told so (``Resync(gap)`` with exactly the missing seqs);
    with ``wait=1`` an append is acknowledged only once a replica has it, and nothing is
    lost."""
    group = redis_group
    url = group.url(wait=1) if wait else group.url()
    publisher = kvbus.Publisher(url, stream="failover", source="engine")
    follower = Follower(kvbus.subscribe("failover", url), TOTAL + 2)
    try:
        engine = PacedPublishing(publisher, TOTAL, rate=RATE).start()
        await engine.wait_published(TOTAL // 3)
        group.link.cut()  # the replicas get nothing more
        await asyncio.sleep(0.3)
        group.primary.kill()
        killed, killed_wall = time.monotonic(), time.time()
        await asyncio.to_thread(
            group.sentinel.wait, lambda: group.primary_port() != group.primary.port, 30
        )
        promoted = time.monotonic() - killed
        await asyncio.to_thread(group.primary.start)
        await engine.join()
        await publisher.aclose()
        await asyncio.wait_for(follower.task, 60)
        late, _ = await collect(url, stream="failover")
        print(
            f"\nredis wait={wait}: replica promoted {promoted:.2f} s after the kill, the first "
            f"message published since delivered after "
            f"{follower.first_published_after(killed_wall) - killed:.2f} s; "
            f"{publisher.stats.send_errors} send errors, "
            f"{follower.sub.stats.transport_errors} read errors, "
            f"{follower.sub.stats.duplicates} stored copies dropped; "
            f"a late reader was told of {len(lost_seqs(late))} lost"
        )
        assert all(engine.accepted) and publisher.stats.dropped == 0
        every = set(range(1, TOTAL + 3))
        for items in (follower.items, late):
            delivered = seqs(items)
            assert delivered == sorted(set(delivered))  # in order, each once
            assert set(delivered) | lost_seqs(items) == every  # the rest announced
            assert not set(delivered) & lost_seqs(items)
        if wait:
            assert seqs(late) == seqs(follower.items) == sorted(every)
            assert not [i for i in [*late, *follower.items] if isinstance(i, Resync)]
        else:
            assert lost_seqs(late), "the appends only the killed primary had were not lost"
    finally:
        follower.task.cancel()
        await follower.sub.aclose()
        await publisher.aclose()
