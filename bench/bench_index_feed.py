"""The router's way in: ``kvbus.subscribe()`` feeding the prefix index, batches/s and
CPU per batch, the index fed each batch's decoded body (as before 2026-11-23) beside
it fed the batch packed (token ids left as their msgpack array), in one run.

The events of bench/bench_index_peers.py (W workers each caching P of N 4k-token
prompts, 16-block ``BlockStored`` events of 32-token blocks, token ids from a 128k
vocabulary), each a vLLM ``KVEventBatch`` published by its worker's source, replayed
from a ``memory://`` stream (in process: no server's CPU in the figures).

Rows, taking turns within each repeat (the same noise for each):

* bus only: ``subscribe(follow=False)``, nothing read but the items (the subscriber
  checks each batch decodes): the floor;
* index from body: ``PrefixIndex.apply_events(item.source, item.body.events)``, each
  batch decoded into structs, an int per token (a router's way in before);
* index packed: ``PrefixIndex.apply(item)``, which reads ``item.packed_events``;
* router: ``Router.apply_kv(item)``, as ``kvbus router`` follows the kv stream;
* top: ``kvbus top``'s ``Fleet.apply_kv(item)`` (blocks counted per medium), from each
  body decoded (as before 2026-11-23) and from the batch packed (``Message.packed``).

Run: python bench/bench_index_feed.py [--workers 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbus.transports import open_transport

import kvbus
from bench.bench_index_peers import (
    BLOCK,
    add_workload_arguments,
    engine_hash,
    engine_hashes,
    workload,
)
from kvbus.bus.subscription import Message
from kvbus.ops.top import Fleet
from kvbus.routing.index import PrefixIndex
from kvbus.routing.router import Router
from kvbus.wire.events import BlockStored, KVEventBatch


def publish(url: str, args: argparse.Namespace) -> int:
    """The workload's stores, one batch per event, in a ``kv`` stream; returns blocks."""
    pool, stores, _, _ = workload(args)
    publishers: dict[int, kvbus.Publisher] = {}
    encode = msgspec.msgpack.Encoder().encode
    stored = 0
    try:
        for worker, prompt, first, end in stores:
            publisher = publishers.get(worker)
            if publisher is None:
                publisher = publishers[worker] = kvbus.Publisher(url, source=f"worker-{worker}")
            parent = engine_hash(prompt, first - 1) if first else None
            tokens = pool[prompt][first * BLOCK : end * BLOCK]
            event = BlockStored(
                list(engine_hashes(prompt, first, end)), parent, tokens, BLOCK, None, "GPU", None
            )
            publisher.publish(encode(KVEventBatch(time.time(), [event])))
            stored += end - first
    finally:
        for publisher in publishers.values():
            publisher.close()
    return stored


def feeds() -> dict[str, Callable[[], Callable[[Any], None]]]:
    """name -> a fresh consumer of the stream's items."""

    def bus_only() -> Callable[[Any], None]:
        return lambda item: None

    def from_body() -> Callable[[Any], None]:
        index = PrefixIndex(BLOCK)

        def apply(item: Any) -> None:
            if isinstance(item, Message) and isinstance(item.body, KVEventBatch):
                index.apply_events(item.source, item.body.events)

        return apply

    def packed() -> Callable[[Any], None]:
        return PrefixIndex(BLOCK).apply

    def router() -> Callable[[Any], None]:
        return Router(block_size=BLOCK).apply_kv

    def top_from_body() -> Callable[[Any], None]:
        fleet = Fleet()

        def apply(item: Any) -> None:
            if isinstance(item, Message):
                item.body  # noqa: B018 - decoded first, as kvbus top did before
            fleet.apply_kv(item)

        return apply

    def top() -> Callable[[Any], None]:
        return Fleet().apply_kv

    return {
        "bus only": bus_only,
        "index from body (before)": from_body,
        "index packed": packed,
        "router.apply_kv": router,
        "top from body (before)": top_from_body,
        "top packed": top,
    }


async def replay(url: str, apply: Callable[[Any], None]) -> tuple[int, float, float]:
    """(batches, wall s, CPU s) of the whole stream through ``apply``."""
    gc.collect()
    batches = 0
    wall, cpu = time.perf_counter(), time.process_time()
    async with kvbus.subscribe("kv", url, follow=False) as items:
        async for item in items:
            apply(item)
            batches += isinstance(item, Message)
    return batches, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    parser.set_defaults(workers=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    url = f"memory://feed{os.getpid()}"
    blocks = publish(url, args)
    expected = asyncio.run(replay(url, lambda item: None))[0]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; {args.workers} workers, {expected:,} batches of "
        f"{blocks // expected} blocks ({BLOCK} tokens each, ids below {args.vocab:,}) "
        f"replayed from memory://; medians of {args.repeats} (range)"
    )
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in feeds()}
    for _ in range(args.repeats):
        for name, make in feeds().items():
            batches, wall, cpu = asyncio.run(replay(url, make()))
            assert batches == expected, (name, batches)
            rates[name].append((batches / wall, cpu / batches * 1e6))
    asyncio.run(open_transport(url).aclose())
    print(f"\n{'feed':28}{'batches/s':>28}{'blocks/s':>14}{'CPU µs/batch':>22}")
    medians = {}
    for name, runs in rates.items():
        rate = statistics.median(r for r, _ in runs)
        cost = statistics.median(c for _, c in runs)
        low, high = min(r for r, _ in runs), max(r for r, _ in runs)
        medians[name] = (rate, cost)
        cell = f"{rate:,.0f} ({low:,.0f}-{high:,.0f})"
        print(f"{name:28}{cell:>28}{rate * blocks / expected:>14,.0f}{cost:>22.1f}")
    floor = medians["bus only"][1]
    before, after = medians["index from body (before)"], medians["index packed"]
    print(
        f"\nindex packed / from body: {after[0] / before[0]:.2f}x batches/s; CPU the index "
        f"adds to the bus per batch: {before[1] - floor:.1f} -> {after[1] - floor:.1f} µs "
        f"({(before[1] - floor) / (after[1] - floor):.2f}x less)"
    )
    before, after = medians["top from body (before)"], medians["top packed"]
    print(
        f"top packed / from body: {after[0] / before[0]:.2f}x batches/s; CPU per batch "
        f"{before[1]:.1f} -> {after[1]:.1f} µs"
    )


if __name__ == "__main__":
    main()
