"""What one source can make a compactor hold and write (kvbus.wire.snapshot, kvbus.ops.compact):
bounded by the live state it claims, never by all it ever sent."""

from __future__ import annotations

from kvbus.transports import open_transport

import kvbus
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvbus.ops.compact import Compactor
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import decode_kv_batch, encode
from kvbus.wire.snapshot import DEFAULT_MAX_COPIES, SourceFold, decode_snapshot


def stored(hashes: list[int], parent: int | None, medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, list(range(4 * len(hashes))), 4, None, medium, None)


def tokenless(hashes: list[int], medium: str = "CPU") -> BlockStored:
    return BlockStored(hashes, None, [], 0, None, medium, None)


async def snapshot_of(url: str, source: str) -> bytes | None:
    return (await open_transport(url).get_snapshots("kv")).get(source)


async def test_one_message_of_copies_makes_a_bounded_snapshot(memory_url: str) -> None:
    """One 1.9 MiB message naming a block over and over became a 206 MiB snapshot
    (an event per copy) and 1.5 GiB of compactor memory: copies of a block are now
    counted up to `DEFAULT_MAX_COPIES`, the rest counted as capped, and the snapshot
    writes them as a few events."""
    copies = 200_000
    hostile = KVEventBatch(0.0, [stored([7], None), tokenless([7] * copies)])
    publisher = kvbus.Publisher(memory_url, source="engine", max_batch=1)
    publisher.publish(encode(hostile))
    assert publisher.flush()
    compactor = Compactor(memory_url)
    await compactor.run(follow=False)
    data = await snapshot_of(memory_url, "engine")
    assert data is not None and len(data) < 4096
    assert compactor.capped_copies == copies - DEFAULT_MAX_COPIES
    batch, _ = decode_kv_batch(decode_snapshot(data).payload)
    assert len(batch.events) == 2  # the block, then its copies in one event
    index = PrefixIndex()
    index.apply_events("engine", batch.events)
    assert index.copies("engine", "CPU") == DEFAULT_MAX_COPIES
    publisher.close()


def test_copies_are_written_as_chains_not_one_event_each() -> None:
    """Each copy used to be an event of its own: a chain of three blocks cached three
    times made nine events. Now: a chain per layer of copies, tokenless copies merged,
    and a consumer rebuilds the same counts."""
    events = [stored([1, 2, 3], None)] * 3 + [tokenless([1, 2])] * 5 + [stored([4], 3)]
    fold, live = SourceFold(), PrefixIndex()
    fold.apply(events)
    live.apply_events("a", events)
    written = fold.events()
    assert len(written) == 4  # [1, 2, 3, 4], [1, 2, 3] twice, the 10 CPU copies
    rebuilt = PrefixIndex()
    rebuilt.apply_events("a", written)
    for medium in ("GPU", "CPU"):
        assert rebuilt.copies("a", medium) == live.copies("a", medium)
    assert live.copies("a", "GPU") == 10 and live.copies("a", "CPU") == 10


async def test_a_source_claiming_more_than_max_blocks_gets_no_snapshot_until_it_clears(
    memory_url: str,
) -> None:
    """Distinct blocks past ``max_blocks``: the fold drops what it held (no engine holds
    that much), counts it, and writes no snapshot; an AllBlocksCleared makes the state
    known again."""
    publisher = kvbus.Publisher(memory_url, source="engine", max_batch=1)
    publisher.publish(encode(KVEventBatch(0.0, [tokenless(list(range(5000)), "STORAGE")])))
    assert publisher.flush()
    compactor = Compactor(memory_url, max_blocks=1000)
    await compactor.run(follow=False)
    assert compactor.overflowed_sources == 1 and compactor.written == 0
    assert not compactor.folds["engine"].held
    assert await snapshot_of(memory_url, "engine") is None
    publisher.publish(encode(KVEventBatch(1.0, [AllBlocksCleared(), stored([1, 2], None)])))
    assert publisher.flush()
    await compactor.run(follow=False)
    assert compactor.written == 1
    data = await snapshot_of(memory_url, "engine")
    assert data is not None
    index = PrefixIndex()
    index.apply_events("engine", decode_kv_batch(decode_snapshot(data).payload)[0].events)
    assert index.blocks("engine") == {1, 2}
    publisher.close()


async def test_a_snapshot_holds_the_live_state_not_the_history(memory_url: str) -> None:
    """2,000 batches, each storing 16 blocks and evicting the previous 16: the snapshot
    holds the 16 live blocks (and the compactor what it must remember of the evicted),
    whatever was sent before."""
    publisher = kvbus.Publisher(memory_url, source="engine", max_batch=64)
    for n in range(2000):
        events: list[BlockStored | BlockRemoved] = [stored(list(range(n * 16, n * 16 + 16)), None)]
        if n:
            events.append(BlockRemoved(list(range(n * 16 - 16, n * 16)), "GPU"))
        publisher.publish(encode(KVEventBatch(float(n), events)))
    assert publisher.flush()
    compactor = Compactor(memory_url)
    await compactor.run(follow=False)
    data = await snapshot_of(memory_url, "engine")
    assert data is not None
    batch, _ = decode_kv_batch(decode_snapshot(data).payload)
    assert [e.block_hashes for e in batch.events] == [list(range(31_984, 32_000))]
    fold = compactor.folds["engine"]
    assert len(fold.held) == fold.copies == 16 and len(fold.evicted) <= 1024
    publisher.close()
