"""PrefixIndex benchmarks beside a straightforward baseline in the same run.

The baseline keeps, per worker, the set of router keys it holds and answers a query by
walking the prompt's keys for every worker (what a first router would write). Both
get the same events and compute the same chained keys.

1. apply rate: block events/s, fed as vLLM batches (16-block BlockStored events,
   chained), on one core;
2. match latency (``match`` of a 4k-token prompt, key hashing included) with 1,000
   workers and ~2M cached blocks indexed; p50/p99;
3. route decision latency: the same plus the policy (cost of every live worker from the
   blocks it would prefill and its load, requests in flight counted, the pick recorded
   as in flight); the baseline computes the cost worker by worker;
4. memory per indexed block (peak RSS growth while indexing).

Run: python bench/bench_index.py [--workers 1000] [--per-worker 16]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_index_peers import add_workload_arguments
from kvbus import BlockStored, Kind, LoadMetrics, Message
from kvbus.routing.index import block_keys
from kvbus.routing.router import CostWeights, Router

BLOCK = 32
PROMPT_BLOCKS = 128  # 4k tokens


class Baseline:
    def __init__(self) -> None:
        self.keys: dict[str, set[int]] = {}
        self.engine: dict[str, dict[int | bytes, int]] = {}

    def apply_events(self, worker: str, events: list[Any]) -> None:
        keys = self.keys.setdefault(worker, set())
        engine = self.engine.setdefault(worker, {})
        for event in events:
            parent = engine[event.parent_block_hash] if event.parent_block_hash else 0
            for h, k in zip(
                event.block_hashes,
                block_keys(event.token_ids, BLOCK, None, None, parent),
                strict=False,
            ):
                engine[h] = k
                keys.add(k)

    def route(self, tokens: list[int], load: dict[str, float], weights: CostWeights) -> str:
        held = self.match(tokens)
        blocks = len(tokens) // BLOCK
        return min(
            load, key=lambda w: load[w] + weights.prefill * (blocks - held.get(w, 0) // BLOCK)
        )

    def match(self, tokens: list[int]) -> dict[str, int]:
        keys = block_keys(tokens, BLOCK)
        out = {}
        for worker, held in self.keys.items():
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            if n:
                out[worker] = n * BLOCK
        return out


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def events_for(prompt: list[int], prompt_id: int) -> list[BlockStored]:
    """One prompt stored as engine steps of 16 blocks, chained by engine hashes."""
    events = []
    parent: int | None = None
    for first in range(0, PROMPT_BLOCKS, 16):
        hashes: list[int | bytes] = [prompt_id * 1000 + b for b in range(first, first + 16)]
        tokens = prompt[first * BLOCK : (first + 16) * BLOCK]
        events.append(BlockStored(hashes, parent, tokens, BLOCK, None, "GPU", None))
        parent = int(hashes[-1])  # type: ignore[arg-type]
    return events


def main() -> None:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    args = parser.parse_args()
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(8 * BLOCK)]  # a shared system prompt
    pool = [
        system + [rng.randrange(256) for _ in range((PROMPT_BLOCKS - 8) * BLOCK)]
        for _ in range(args.prompts)
    ]
    stream = [
        (f"worker-{w}/dp0", events_for(pool[p], p))
        for w in range(args.workers)
        for p in rng.sample(range(args.prompts), args.per_worker)
    ]
    blocks = args.workers * args.per_worker * PROMPT_BLOCKS
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}; {args.workers} workers, {blocks:,} cached "
        f"blocks, {args.prompts} distinct 4k prompts"
    )
    workers = sorted({worker for worker, _ in stream})
    loads = {w: rng.choice([0.0, 2.0, 4.0, 8.0]) for w in workers}
    rows = []
    for name, index in (
        ("baseline: per-worker key sets", Baseline()),
        ("kvbus PrefixIndex + Router", Router(block_size=BLOCK, seed=1)),
    ):
        router = index if isinstance(index, Router) else None
        indexed = router.index if router else index
        gc.collect()
        gc.freeze()  # the harness's events stay out of the collector's scans
        before = rss_mib()
        start = time.perf_counter()
        for worker, events in stream:
            indexed.apply_events(worker, events)
        apply_rate = blocks / (time.perf_counter() - start)
        grown = rss_mib() - before
        for worker, running in loads.items():
            if router:
                body = LoadMetrics(ts=0.0, running=int(running // 2), waiting=0, kv_cache_usage=0.5)
                router.apply_metrics(Message(worker, 1, 1, Kind.METRICS, 0.0, body, b"", 0))
        matches, routes = [], []
        for _ in range(args.queries):
            prompt = pool[rng.randrange(args.prompts)]
            t = time.perf_counter_ns()
            indexed.match(prompt)
            matches.append((time.perf_counter_ns() - t) / 1000)
            t = time.perf_counter_ns()
            if router:
                decision = router.route(prompt)
                routes.append((time.perf_counter_ns() - t) / 1000)
                assert decision is not None
                router.finished(decision)
            else:
                index.route(prompt, loads, CostWeights())
                routes.append((time.perf_counter_ns() - t) / 1000)
        matches.sort()
        routes.sort()
        rows.append(
            (
                name,
                apply_rate,
                statistics.median(matches),
                matches[int(len(matches) * 0.99)],
                statistics.median(routes),
                routes[int(len(routes) * 0.99)],
                grown * 2**20 / blocks,
            )
        )
        del index, indexed, router
    columns = ("apply blocks/s", "match p50", "match p99", "route p50", "route p99", "B/block")
    print(f"\n{'index (latencies in us)':32} " + " ".join(f"{c:>14}" for c in columns))
    for name, rate, *latencies, per_block in rows:
        print(
            f"{name:32} {rate:14,.0f} "
            + " ".join(f"{x:14.0f}" for x in latencies)
            + f" {per_block:14.0f}"
        )


if __name__ == "__main__":
    main()
