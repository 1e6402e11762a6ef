"""Snapshots (kvbus.wire.snapshot, kvbus.ops.compact): the fold, and a consumer whose cursor
points into trimmed history getting exact state back. Every transport's store, and a
late consumer, are in test_conformance.py; a real engine in test_vllm_events.py."""

from __future__ import annotations

import kvbus
from kvbus import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Resync,
    ResyncReason,
)
from kvbus.ops.compact import Compactor
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import encode
from kvbus.wire.snapshot import SourceFold

from .test_conformance import cache_workload


def stored(hashes: list[int], parent: int | None) -> BlockStored:
    return BlockStored(hashes, parent, list(range(4 * len(hashes))), 4, None, "GPU", None)


def test_a_cached_child_of_an_evicted_parent_still_chains() -> None:
    """vLLM can evict a parent and keep its child: the snapshot stores and removes the
    parent before the child, so a fresh index chains the child as the live one did."""
    fold = SourceFold()
    live = PrefixIndex()
    events = [stored([1, 2, 3], None), BlockRemoved([2], "GPU")]
    fold.apply(events)
    live.apply_events("a", events)
    rebuilt = PrefixIndex()
    rebuilt.apply_events("a", fold.events())
    assert rebuilt.blocks("a") == live.blocks("a") == {1, 3}
    assert rebuilt.unchained == live.unchained == 0


def test_tokenless_offloaded_copies_survive_a_snapshot() -> None:
    """The offloading connector names the blocks it copies to CPU by hash only; after
    the GPU evicts them, only the CPU copies remain: the snapshot stores each copied
    block first (removing it again at the end when it left the GPU), then its copies."""
    tokens = list(range(12))
    gpu = BlockStored([1, 2, 3], None, tokens, 4, None, "GPU", None)
    offloaded = BlockStored([1, 2], None, [], 0, None, "CPU", None)
    again = BlockStored([2], None, [], 0, None, "CPU", None)
    events = [gpu, offloaded, again, BlockRemoved([1, 2], "GPU"), stored([4], 3)]
    fold, live = SourceFold(), PrefixIndex()
    fold.apply(events)
    live.apply_events("a", events)
    rebuilt = PrefixIndex()
    rebuilt.apply_events("a", fold.events())
    for medium in ("GPU", "CPU"):
        assert rebuilt.copies("a", medium) == live.copies("a", medium)
    assert live.copies("a", "CPU") == 3 and live.copies("a", "GPU") == 2
    assert rebuilt.match_weighted(tokens) == live.match_weighted(tokens) == {"a": 2.0}
    assert rebuilt.unchained == live.unchained == 0


def test_forged_parent_cycles_end() -> None:
    fold = SourceFold()
    fold.apply([stored([1], 2), stored([2], 1)])  # each names the other as its parent
    assert sorted(h for e in fold.events() for h in e.block_hashes) == [1, 2]


async def test_a_cursor_into_trimmed_history_gets_the_newer_snapshot(memory_url: str) -> None:
    url = f"{memory_url}?maxlen=30"
    publisher = kvbus.Publisher(url, source="engine-a", max_batch=1)
    truth = PrefixIndex()
    batches = cache_workload(300, seed=5)
    for batch in batches[:10]:
        publisher.publish(encode(batch))
        truth.apply_events("engine-a", batch.events)
    assert publisher.flush()
    early = kvbus.subscribe(url=url, follow=False)
    consumer = PrefixIndex()
    async for item in early:
        consumer.apply(item)
    cursor = early.cursor
    compactor = Compactor(url)  # from the start: one that joins later cannot know the state
    await compactor.run(follow=False)
    for n, batch in enumerate(batches[10:]):
        publisher.publish(encode(batch))
        truth.apply_events("engine-a", batch.events)
        assert publisher.flush()
        if n % 20 == 19:
            await compactor.run(follow=False)
    items = [i async for i in kvbus.subscribe(url=url, cursor=cursor, follow=False, snapshot=True)]
    resyncs = [i for i in items if isinstance(i, Resync)]
    assert resyncs == [Resync("engine-a", publisher.epoch, ResyncReason.GAP)]  # none lost
    for item in items:
        consumer.apply(item)
    assert consumer.blocks("engine-a") == truth.blocks("engine-a")
    assert consumer.copies("engine-a") == truth.copies("engine-a")
    publisher.close()


async def test_a_source_with_lost_events_gets_snapshots_again_after_a_clear(
    memory_url: str,
) -> None:
    """After a loss (the publisher dropped batches) nobody knows the engine's cache, so
    no snapshot is stored for it; an AllBlocksCleared (vLLM's reset_prefix_cache) makes
    it known again."""
    publisher = kvbus.Publisher(memory_url, source="engine-a", max_batch=1)
    publisher.publish(encode(KVEventBatch(0.0, [stored([1], None)])))
    publisher.announce_loss(3)
    publisher.publish(encode(KVEventBatch(1.0, [stored([2], None)])))
    assert publisher.flush()
    compactor = Compactor(memory_url)
    await compactor.run(follow=False)
    assert compactor.written == 0
    publisher.publish(encode(KVEventBatch(2.0, [AllBlocksCleared(), stored([3], None)])))
    assert publisher.flush()
    await compactor.run(follow=False)
    assert compactor.written == 1
    items = [i async for i in kvbus.subscribe(url=memory_url, follow=False, snapshot=True)]
    index = PrefixIndex()
    for item in items:
        index.apply(item)
    assert index.blocks("engine-a") == {3}
    publisher.close()
