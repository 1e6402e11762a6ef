"""Rebuilding the fleet's prefix state: snapshots + replay of the tail, beside a full
replay of the history, in the same run (print a table of medians and the ratio).

100 sources each cache 10,000 blocks (1M in all) through a churning history: vLLM-like
batches of 16 chained blocks, the oldest evicted as the cache fills, ``--churn`` (4)
times as many blocks stored as stay cached: the history holds 4M stored and 3M removed
blocks (an engine's cache turns over many more times than that in a day). ``kvbus compact`` folds
it once (timed apart); then 10% more traffic arrives. A consumer then rebuilds a
`PrefixIndex` either from the whole history (``subscribe(follow=False)``), or from the
snapshots and the tail after them (``subscribe(snapshot=True, follow=False)``), and the
two indexes must hold the same blocks.

Second table: what ``zmq://...?snapshots=1`` (the publishing process folds what it
publishes, zmq having no server to keep snapshots) costs the publisher: 16-block batches
published and flushed per second, beside the same publisher without it.

Run: python bench/bench_snapshots.py [--sources 100] [--blocks 10000] [--churn 4]
[--runs 3] [--url memory://...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbus
from kvbus import BlockRemoved, BlockStored, KVEventBatch
from kvbus.ops.compact import Compactor
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import encode

BLOCK = 16
PER_BATCH = 16


def history(source: int, blocks: int, churn: int, rng: random.Random) -> list[bytes]:
    """Batches that leave ``blocks`` cached after storing ``churn`` times as many."""
    batches = []
    next_hash = source << 32
    cached: list[int] = []
    stored = 0
    while stored < churn * blocks:
        hashes = list(range(next_hash, next_hash + PER_BATCH))
        next_hash += PER_BATCH
        tokens = [rng.randrange(3, 30000) for _ in range(PER_BATCH * BLOCK)]
        events: list[object] = [BlockStored(hashes, None, tokens, BLOCK, None, "GPU", None)]
        cached.extend(hashes)
        stored += PER_BATCH
        if stored > blocks:  # evict the oldest chain, as the LRU does
            evicted, cached = cached[:PER_BATCH], cached[PER_BATCH:]
            events.append(BlockRemoved(evicted, "GPU"))
        batches.append(encode(KVEventBatch(float(stored), events)))  # type: ignore[arg-type]
    return batches


def publish(publishers: list[kvbus.Publisher], per_source: list[list[bytes]]) -> None:
    for i in range(max(len(b) for b in per_source)):
        for publisher, batches in zip(publishers, per_source, strict=True):
            if i < len(batches):
                publisher.publish(batches[i])
    for publisher in publishers:
        assert publisher.flush(600)


async def rebuild(url: str, stream: str, snapshot: bool) -> tuple[float, PrefixIndex, int]:
    index = PrefixIndex()
    began = time.perf_counter()
    sub = kvbus.subscribe(stream, url, follow=False, snapshot=snapshot)
    async for item in sub:
        index.apply(item)
    seconds = time.perf_counter() - began
    await sub.aclose()
    return seconds, index, sub.stats.delivered


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.ERROR)
    rng = random.Random(0)
    stream = f"snap{int(time.time())}"
    url = args.url
    full = [history(s, args.blocks, args.churn, rng) for s in range(args.sources)]
    split = [len(b) * 10 // 11 for b in full]  # compaction after 10/11 of the traffic
    publishers = [
        kvbus.Publisher(url, stream=stream, source=f"engine-{s}", max_queue=10**7)
        for s in range(args.sources)
    ]
    began = time.perf_counter()
    publish(publishers, [b[:k] for b, k in zip(full, split, strict=True)])
    published = time.perf_counter() - began
    began = time.perf_counter()
    await Compactor(url, stream).run(follow=False)
    compacted = time.perf_counter() - began
    publish(publishers, [b[k:] for b, k in zip(full, split, strict=True)])
    replays, snapshots = [], []
    blocks = 0
    for _ in range(args.runs):  # alternated, so that both see the same machine
        seconds, whole, messages = await rebuild(url, stream, snapshot=False)
        replays.append(seconds)
        seconds, fast, fast_messages = await rebuild(url, stream, snapshot=True)
        snapshots.append(seconds)
        workers = whole.workers()
        assert sorted(workers) == sorted(fast.workers())
        assert all(whole.blocks(w) == fast.blocks(w) for w in workers), "states differ"
        blocks = sum(len(whole.blocks(w)) for w in workers)
    print(
        f"{args.sources} sources, {blocks:,} blocks cached, {messages:,} messages in the "
        f"history ({published:.1f} s to publish 10/11 of it); compaction {compacted:.1f} s; "
        f"{args.runs} runs, medians (range)\n"
    )
    print("| rebuild | seconds | messages read | ratio |")
    print("| --- | ---: | ---: | ---: |")
    full_s, snap_s = statistics.median(replays), statistics.median(snapshots)
    print(
        f"| full replay | {full_s:.2f} ({min(replays):.2f}-{max(replays):.2f}) | "
        f"{messages:,} | 1.00 |"
    )
    print(
        f"| snapshots + tail | {snap_s:.2f} ({min(snapshots):.2f}-{max(snapshots):.2f}) | "
        f"{fast_messages:,} | {snap_s / full_s:.2f} |"
    )


def zmq_publisher_cost(runs: int) -> None:
    from examples.cluster import free_port

    rng = random.Random(1)
    payloads = history(0, 25_000, 2, rng)  # 3,125 batches; repeated below
    payloads = payloads * 16
    rates: dict[str, list[float]] = {"0": [], "1": []}
    for _ in range(runs):
        for snapshots in ("0", "1"):
            url = f"zmq://127.0.0.1:{free_port(pair=True)}?snapshots={snapshots}"
            publisher = kvbus.Publisher(url, source="engine", max_queue=10**7)
            began = time.perf_counter()
            for payload in payloads:
                publisher.publish(payload)
            assert publisher.flush(600)
            rates[snapshots].append(len(payloads) / (time.perf_counter() - began))
            publisher.close()
    off, on = statistics.median(rates["0"]), statistics.median(rates["1"])
    print(f"\nzmq publisher, {len(payloads):,} batches of 16 blocks, {runs} runs, medians\n")
    print("| publisher | batches/s | µs per batch | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| zmq:// | {off:,.0f} | {1e6 / off:.1f} | 1.00 |")
    print(f"| zmq://...?snapshots=1 | {on:,.0f} | {1e6 / on:.1f} | {on / off:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=10_000, help="cached per source")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--churn", type=int, default=4, help="blocks stored over the history per block cached"
    )
    parser.add_argument("--url", default="memory://bench?maxlen=10000000")
    arguments = parser.parse_args()
    asyncio.run(main(arguments))
    zmq_publisher_cost(arguments.runs)
