"""Routing on a real trace: kvbus's policies beside the peers, on the same real engines.

Replays a slice of Mooncake's conversation trace (multi-turn conversations and one-off
requests; see bench/mooncake.py) through each router in front of the same vLLM CPU
servers (block size 32, each KV cache a fraction of the slice's working set), a few
clients at a time, several repetitions, the routers taking turns within a repetition:

* kvbus: ``kv`` and ``round_robin`` (``kvbus router`` on NATS, the engines' plugin and
  stat logger);
* when installed (examples/peers.py; ``scripts/install.sh peers``): sglang-router
  ``cache_aware``, vllm-router ``cache_aware`` and ``kv_aware`` (the engines also run
  vLLM's own ZMQ publisher for it, and ``--enable-scale-out`` for its render calls).

Per run: hit rate = cached / prompt tokens from the engines' own usage, TTFT p50/p95
(first streamed chunk), requests/s, and for kvbus the share of requests whose cached
tokens the router predicted exactly. The offline bound is the best of two placements of
the same slice simulated with vLLM's caching rules (bench/mooncake.py), one request at a
time, with no event lag: one prefix cache as large as all the engines together (a
placement that never stores a block twice), and kvbus's policy with exact knowledge of
every cache (which can beat the pooled cache when caches are tight: LRU is not optimal).

    python bench/bench_routing.py [--repetitions 5] [--servers 4] [--concurrency 4]
        [--requests 200] [--start 0] [--min-turns 4] [--one-off-share 0.2]
        [--cache-fraction 0.2] [--replicas 1] [--peers DIR] [--json FILE]
        [--policies kv,round_robin,sglang-cache_aware,vllm-router-cache_aware,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

from peers import PEERS_VENV, installed_runs, policies_to_compare  # noqa: E402
from router_demo import Cluster, Request, Row  # noqa: E402

from bench.mooncake import (  # noqa: E402
    DEFAULT_TRACE,
    Workload,
    load_trace,
    pooled_hit_rate,
    select,
    simulate,
)
from kvbus.routing.router import Router  # noqa: E402


def requests_for(workload: Workload, trace: list[Any]) -> list[Request]:
    """Streamed completions with usage, one per trace request, in trace order."""
    conversations: dict[tuple[int, ...], int] = {}
    out = []
    for request in trace:
        tenant = conversations.setdefault(request.conversation, len(conversations))
        body = {
            "prompt": workload.text(request),
            "max_tokens": workload.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.append(Request(tenant, "/v1/completions", body))
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(runs: dict[str, list[Row]], bound: float) -> str:
    head = (
        f"{'router':26} {'hit rate per repetition':>38} {'median':>7} {'/bound':>7} "
        f"{'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>6} {'exact':>6}"
    )
    lines = [head, "-" * len(head)]
    for name, rows in runs.items():
        rates = [r.hit_rate for r in rows]
        exact = [r.predicted_exactly for r in rows if r.predicts]
        lines.append(
            f"{name:26} {' '.join(f'{x:.3f}' for x in rates):>38} {median(rates):>7.3f} "
            f"{median(rates) / bound:>7.1%} "
            f"{median([r.ttft_ms(0.5) for r in rows]):>7.0f}ms "
            f"{median([r.ttft_ms(0.95) for r in rows]):>7.0f}ms "
            f"{median([r.requests_per_s for r in rows]):>6.1f} "
            f"{f'{min(exact):.1%}' if exact else '-':>6}"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--start", type=int, default=0, help="first trace line to consider")
    parser.add_argument("--min-turns", type=int, default=4)
    parser.add_argument("--one-off-share", type=float, default=0.2)
    parser.add_argument("--max-blocks", type=int, default=48, help="prompt blocks kept")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument(
        "--cache-fraction", type=float, default=0.2, help="of the working set, per server"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--replicas", type=int, default=1, help="routers per policy, requests alternating"
    )
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--policies", help="default: kvbus's and every installed peer's")
    parser.add_argument("--peers", type=Path, help="venv of the peers (default .venv-peers)")
    parser.add_argument("--hidden-size", type=int, default=512, help="of the dummy Llama")
    parser.add_argument("--layers", type=int, default=4, help="of the dummy Llama")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()

    trace = select(
        load_trace(args.trace), args.requests, args.start, args.min_turns, args.one_off_share
    )
    workload = Workload(max_blocks=args.max_blocks, output_tokens=args.output_tokens)
    working_set = workload.working_set(trace)
    blocks = max(int(working_set * args.cache_fraction), args.max_blocks + 2)
    prompts = workload.prompts(trace)
    pooled = pooled_hit_rate(prompts, args.servers * blocks)
    unlimited = pooled_hit_rate(prompts, 10**9)
    router = Router(block_size=workload.block_size)
    simulated = simulate(router, prompts, args.servers, blocks)
    bound = max(pooled, simulated)
    peers = installed_runs(args.peers)
    policies = policies_to_compare(args.policies, args.peers)
    print(
        f"trace: {len(trace)} requests ({len({r.conversation for r in trace})} conversations, "
        f"one-off requests included) "
        f"from {args.trace.name}, working set {working_set} blocks of {workload.block_size}; "
        f"{args.servers} servers x {blocks} blocks; concurrency {args.concurrency}\n"
        f"offline: one unlimited cache {unlimited:.3f}; one cache of {args.servers * blocks} "
        f"blocks {pooled:.3f}, kvbus kv simulated {simulated:.3f}: bound {bound:.3f}\n"
        f"policies: {', '.join(policies)}" + ("" if peers else " (no peers installed)"),
        file=sys.stderr,
    )
    requests = requests_for(workload, trace)
    runs: dict[str, list[Row]] = {p: [] for p in policies}
    max_len = (args.max_blocks + 1) * workload.block_size + args.output_tokens
    with tempfile.TemporaryDirectory(prefix="kvbus-routing-") as tmp:
        cluster = Cluster(
            Path(tmp),
            servers=args.servers,
            blocks=blocks,
            model=(args.hidden_size, args.layers),
            max_model_len=max_len,
            peers=(args.peers or PEERS_VENV) if peers else None,
        )
        started = time.monotonic()
        cluster.start()
        print(f"engines up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        try:
            for repetition in range(args.repetitions):
                # Each repetition starts with another router, so none always goes first.
                order = (
                    policies[repetition % len(policies) :] + policies[: repetition % len(policies)]
                )
                for policy in order:
                    row = await cluster.run_policy(
                        policy, requests, args.concurrency, args.replicas
                    )
                    runs[policy].append(row)
                    print(
                        f"  repetition {repetition + 1} {policy}: hit rate {row.hit_rate:.3f}, "
                        f"TTFT p50 {row.ttft_ms(0.5):.0f} ms, {row.seconds:.0f} s",
                        file=sys.stderr,
                    )
        finally:
            cluster.stop()
    print(
        f"\n{len(trace)} requests of the Mooncake trace, {args.servers} vLLM CPU servers "
        f"x {blocks} KV blocks, concurrency {args.concurrency}, {args.replicas} router "
        f"replica(s) per policy, {args.repetitions} repetitions.\n"
        f"hit rate: cached / prompt tokens from the engines' usage; /bound: "
        f"median over the offline bound ({bound:.3f}); exact: kvbus's worst repetition of "
        f"requests whose cached tokens it predicted exactly\n"
    )
    print(table(runs, bound))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "bound": bound,
                    "pooled": pooled,
                    "unlimited": unlimited,
                    "simulated_kv": simulated,
                    "blocks": blocks,
                    "runs": {
                        p: [
                            {
                                "hit_rate": r.hit_rate,
                                "engine_hit_rate": r.engine_hit_rate,
                                "ttft_p50_ms": r.ttft_ms(0.5),
                                "ttft_p95_ms": r.ttft_ms(0.95),
                                "requests_per_s": r.requests_per_s,
                                "ok": len(r.ok),
                                "predicted_exactly": r.predicted_exactly if r.predicts else None,
                            }
                            for r in rows
                        ]
                        for p, rows in runs.items()
                    },
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    asyncio.run(main())
