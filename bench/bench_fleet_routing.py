"""Routing where it matters: hard scenarios on `kvbus sim` fleets, kvbus beside the peers.

Each scenario runs one ``kvbus sim`` process of simulated vLLM engines (vLLM's own
scheduler and prefix cache, step times from a GPU ``--profile``, ``--speedup`` below 1 so
simulated time runs slower than the wall clock and the two cores here are not what
limits TTFT) on a real nats-server, and puts each router in front of the same engines
in turn, caches emptied before each (`router_demo.Cluster`): kvbus ``kv`` and
``round_robin`` (``examples/nats_router.py``, i.e. ``kvbus router``, on the bus) and,
where installed (``bash scripts/install.sh peers``), sglang-router ``cache_aware`` and
vllm-router ``cache_aware`` and ``kv_aware`` (vLLM's ZMQ events). Requests arrive open
loop at scheduled times (the same schedule for every router of a repetition), streamed
with usage.

Scenarios (``--scenarios``, in priority order):

a. shared prefix (llm-d's shape: groups of prompts sharing a long prefix, each prompt a
   question of its own), the fleet's KV sized so the working set fills ``--pressure`` of
   it, on a ladder of rates from light load into saturation;
e. sibling bursts: 8 requests with the same new long prompt at once (best-of-N, agent
   fan-out), bursts spread over a background of shared-prefix traffic;
c. an engine restart (``POST /sim/restart``) and a prefix-cache reset of another engine
   (``POST /reset_prefix_cache?reset_running_requests=true``: the requests it runs are
   preempted and recompute, as on vLLM) mid-run, under shared-prefix traffic;
f. one engine twice as slow as the others (``kvbus sim --slow``), shared-prefix traffic
   at a rate where its speed matters (``--slow-rate``);
d. three router replicas: kvbus's share requests in flight on the bus
   (``--routes-stream``), the peers' are independent instances; requests alternate
   between them (the burst workload of e);
b. the Mooncake conversation trace (bench/mooncake.py): a share of the hour's
   conversations at their own arrival times, compressed to a mean rate, one stage per
   rate (``--trace-rates``: 150 req/s, and 300 past saturation).

kvbus's routers run with ``--shed-after`` at the SLO (``--kvbus-shed-after``: another
limit; ``--no-kvbus-shed``: none) and ``--deadline`` at the clients' ``--timeout``
(``--no-kvbus-deadline``: none): past saturation they answer 503 at once to a request
its worker would start too late, or finish too late for its client. A request shed
counts as failed. The peers have no
limit on predicted wait. A request that times out keeps its time to a first token in
the ``--json`` (status 0): past saturation most came in time, and the decode did not.

Per run (router x repetition, per stage of a ladder), in simulated time (wall time x
speedup: what the GPUs of the profile would see): offered requests/s; goodput, the
requests answered with TTFT within ``--slo`` per second of offered load (failed,
rejected and timed-out requests are not good: shown apart); TTFT p50/p90 over every
offered request (a failed one counts as never answered: ``>T``); hit rate, cached /
prompt tokens from the engines' usage; the offline bound of the hit rate (the same
arrivals served one at a time by one prefix cache as large as the fleet's, or by kvbus's
policy with exact knowledge of every cache, whichever is higher; with a restart or a
reset, the second alone, its engine's cache emptied at the same point; bench/mooncake.py)
over every arrival, and "of ok" over the requests the router served (past saturation a
router that sheds serves a subset, and its hit rate is that subset's), placed offline with
only the arrivals the router admitted (a shed turn of a conversation is cached nowhere,
so its next turn finds less in any placement; it is the bound of every arrival for a
router that shed nothing); and the CPU: the
busiest process's share of one core (the sim, a router, nats-server or this client; over
~70% it, not the routing, limits TTFT) and the machine's.

Then, with kvbus ``kv`` beside a peer, kv against the best peer of each repetition and
stage, request by request (bench/fleet_verdicts.py): the p90's difference and the central
95% of it over resamples of the stage's requests (a burst's siblings drawn together),
"ahead" or "behind" only where that excludes 0 or the goodputs differ, and each p99.

The vllm-router runs go on a fleet of their own at a quarter of ``--speedup``
(``--speedup-for``): vllm-router renders each prompt on every engine, which on one sim
process costs 8 tokenizations a request. A router's own wall time then counts a quarter
as much in vllm-router's simulated TTFT as in kv's; ``--kv-at-every-speedup`` also runs
kv on that fleet, and the verdicts judge each peer against kv at its own speed. Time on
2 cores: about 10 min a scenario for kv and the two cache-aware peers at three
repetitions, (b) longer (the vllm-router rows take about 60% of it); ``--quick`` runs
(a) and (e) once, a sixth as long (about 7 min; all six scenarios so, 30 min);
``--routers`` picks fewer.

    python bench/bench_fleet_routing.py [--quick] [--scenarios a,e,c,f,d,b]
        [--routers kv,round_robin,sglang-cache_aware,...] [--repetitions N] [--json FILE]
        [--logs DIR [--router-debug]] [--trace .../conversation_trace.jsonl]
        [--kv-at-every-speedup]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

from cluster import BLOCK  # noqa: E402
from peers import PEERS, PEERS_VENV, PeerRouter, policies_to_compare  # noqa: E402
from router_demo import Cluster, Request, Result, Sim, send  # noqa: E402

from bench import fleet_verdicts  # noqa: E402
from bench.bench_fleet import cpu_seconds, machine_busy_seconds  # noqa: E402
from bench.mooncake import (  # noqa: E402
    DEFAULT_TRACE,
    VOCAB,
    Prompts,
    TraceRequest,
    Workload,
    load_trace,
    pooled_cached,
    simulated_cached,
)
from kvbus.routing.router import Router  # noqa: E402

# --- workloads ---------------------------------------------------------------------------


@dataclass
class Arrival:
    at: float
    """Simulated seconds after the run's start."""
    tokens: list[int]
    stage: str = ""
    kind: str = ""
    """What the request is in its scenario ("burst", "background", ...)."""


@dataclass
class Plan:
    """One repetition's schedule: arrivals, and actions on engines mid-run."""

    arrivals: list[Arrival]
    stages: list[tuple[str, float, float]]
    """(name, start, end) in simulated seconds: goodput is per second of a stage."""
    actions: list[tuple[float, str, int]] = field(default_factory=list)
    """(at, "restart" or "reset", engine index)."""
    output_tokens: int = 16


class SharedPrefix:
    """llm-d's shared-prefix shape: ``groups`` prefixes of ``prefix`` tokens, each with
    ``per_group`` questions of ``question`` tokens; a request is a random group's random
    question after its prefix."""

    def __init__(self, seed: int, groups: int, per_group: int, prefix: int, question: int):
        rng = random.Random(f"shared-prefix:{seed}")

        def words(n: int) -> list[int]:
            return [rng.choice(VOCAB) for _ in range(n)]

        self.prompts = [
            [p + words(question) for _ in range(per_group)]
            for p in (words(prefix) for _ in range(groups))
        ]

    def working_set(self) -> int:
        """Distinct full blocks of all the prompts: each group's common prefix once, then
        each prompt's own blocks."""
        total = 0
        for group in self.prompts:
            common = _common_blocks(group)
            total += common + sum(len(p) // BLOCK - common for p in group)
        return total

    def poisson(
        self, rng: random.Random, rate: float, start: float, end: float, stage: str
    ) -> list[Arrival]:
        arrivals, at = [], start
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                return arrivals
            group = rng.choice(self.prompts)
            arrivals.append(Arrival(at, rng.choice(group), stage, "shared"))


def _common_blocks(prompts: list[list[int]]) -> int:
    first = prompts[0]
    common = len(first)
    for other in prompts[1:]:
        same = next(
            (i for i, (x, y) in enumerate(zip(first, other, strict=False)) if x != y), len(first)
        )
        common = min(common, same)
    return common // BLOCK


# --- one run -----------------------------------------------------------------------------


@dataclass
class Run:
    scenario: str
    router: str
    repetition: int
    arrivals: list[Arrival]
    results: list[Result]
    speedup: float
    cpu: dict[str, float]
    """CPU seconds per second per process kind (max over processes of a kind)."""
    machine_cpu: float
    """Whole machine, busy share of all cores (others' work included)."""
    actions: list[str] = field(default_factory=list)
    router_metrics: dict[str, float] = field(default_factory=dict)
    engine_prompt_tokens: list[float] = field(default_factory=list)
    """Prompt tokens each engine was asked (its prefix-cache queries) during the run."""
    admitted_bound: list[int] | None = None
    """For a run that shed requests (503): per arrival, its cached tokens in the offline
    placement of the arrivals it admitted alone (a shed one is 0), `offline_bound`."""

    @property
    def busiest(self) -> float:
        """The busiest engine's share of the prompt tokens, times the engines (1: even)."""
        total = sum(self.engine_prompt_tokens)
        if not total:
            return math.nan
        return max(self.engine_prompt_tokens) / total * len(self.engine_prompt_tokens)


def text(tokens: Sequence[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


async def run_router(
    cluster: Cluster,
    scenario: str,
    policy: str,
    repetition: int,
    plan: Plan,
    replicas: int,
    speedup: float,
    timeout: float,
) -> Run:
    """``plan`` through ``replicas`` routers of ``policy`` on freshly emptied caches."""
    began = time.monotonic()
    await settle(cluster)
    settled = time.monotonic()
    await cluster.fresh_caches()
    emptied = time.monotonic()
    model = str(cluster.model)
    bodies = [
        {
            "model": model,
            "prompt": text(a.tokens),
            "max_tokens": plan.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for a in plan.arrivals
    ]
    results = [Result(0, 0, "", -1) for _ in plan.arrivals]
    done_actions: list[str] = []
    async with cluster.routers(policy, replicas) as routers:
        ready = time.monotonic()
        say(f"    settled {settled - began:.1f} s, caches emptied {emptied - settled:.1f} s, "
            f"router ready {ready - emptied:.1f} s")  # fmt: skip
        bases = [r.url for r in routers]
        pids = {"client": os.getpid()}
        if cluster.fleet and cluster.fleet.process:
            pids["sim"] = cluster.fleet.process.pid
        if cluster.nats.process:
            pids["nats"] = cluster.nats.process.pid
        for number, router in enumerate(routers):
            if router.process:
                pids[f"router{number}"] = router.process.pid
        engines_before = await engine_states(cluster)
        cpu_before = {k: _cpu(pid) for k, pid in pids.items()}
        machine_before, wall_before = machine_busy_seconds(), time.monotonic()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            loop = asyncio.get_running_loop()
            start = loop.time() + 0.2

            async def one(i: int) -> None:
                await asyncio.sleep(max(0.0, start + plan.arrivals[i].at / speedup - loop.time()))
                request = Request(0, "/v1/completions", bodies[i])
                try:
                    await asyncio.wait_for(
                        send(session, bases[i % len(bases)], request, i, results[i]),
                        timeout / speedup,
                    )
                except Exception:
                    # Failed or timed out: status 0, but its first token's time kept
                    # (the JSON's, to tell a late first token from a slow decode).
                    results[i].status = 0

            async def act(at: float, what: str, engine: int) -> None:
                await asyncio.sleep(max(0.0, start + at / speedup - loop.time()))
                done_actions.append(await asyncio.to_thread(_act, cluster, what, engine))

            await asyncio.gather(
                *(one(i) for i in range(len(plan.arrivals))),
                *(act(*a) for a in plan.actions),
            )
        wall = time.monotonic() - wall_before
        machine = (machine_busy_seconds() - machine_before) / wall / (os.cpu_count() or 1)
        cpu: dict[str, float] = {}
        for key, pid in pids.items():
            kind = "router" if key.startswith("router") else key
            used = (_cpu(pid) - cpu_before[key]) / wall
            cpu[kind] = max(cpu.get(kind, 0.0), used)
        engines_after = await engine_states(cluster)
        prompt_tokens = [
            (b["queries"] if a is None else a["queries"]) - b["queries"] if b else 0.0
            for b, a in zip(engines_before, engines_after, strict=True)
        ]
        metrics: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            first = routers[0]
            metrics = (
                first.metrics() if isinstance(first, PeerRouter) else router_metrics(first.url)
            )
    return Run(
        scenario, policy, repetition, plan.arrivals, results, speedup, cpu, machine,
        done_actions, metrics, prompt_tokens,
    )  # fmt: skip


def _cpu(pid: int) -> float:
    with contextlib.suppress(OSError):
        return cpu_seconds(pid)
    return 0.0


def _act(cluster: Cluster, what: str, engine: int) -> str:
    """Restart an engine, or reset its prefix cache as an operator (or an RL weight
    sync) does under load: ``reset_running_requests`` preempts what runs (vLLM refuses a
    plain reset while requests hold blocks, which under load is always)."""
    server = cluster.servers[engine]
    if what == "restart":
        server.restart()  # type: ignore[union-attr]
        return f"restart {server.source}"
    if not server.reset_prefix_cache(running=True):
        return f"reset {server.source} refused"
    return f"reset {server.source}"


def router_metrics(base: str) -> dict[str, float]:
    """kvbus's router's Prometheus samples (``name{labels}`` -> value), ``kvbus_`` ones."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        body = response.read().decode()
    samples = {}
    for line in body.splitlines():
        if line.startswith("kvbus_"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[key] = float(value)
    return samples


async def settle(cluster: Cluster, within: float = 3) -> None:
    """Until no engine runs or queues a request; an engine still busy after ``within``
    s (the last run's backlog, which a client's timeout does not cancel) is restarted:
    its requests fail, its cache empties, as a fresh engine's."""
    deadline = time.monotonic() + within
    while True:
        busy = [i for i, s in enumerate(await engine_states(cluster)) if s is None or s["busy"]]
        if not busy:
            return
        if time.monotonic() > deadline:
            for i in busy:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(cluster.servers[i].restart)  # type: ignore[union-attr]
            deadline = time.monotonic() + 60
            within = 60
            continue
        await asyncio.sleep(0.2)


async def engine_states(cluster: Cluster) -> list[dict[str, Any] | None]:
    """Per engine: busy (requests running or waiting), and its prefix-cache counters."""

    def read(server: Any) -> dict[str, Any] | None:
        try:
            state = server.state()
            counters = server.counters()
        except (OSError, ValueError):
            return None
        return {
            "busy": bool(state["running"] or state["waiting"]),
            "queries": counters.get("vllm:prefix_cache_queries_total", 0.0),
            "hits": counters.get("vllm:prefix_cache_hits_total", 0.0),
        }

    return list(await asyncio.gather(*(asyncio.to_thread(read, s) for s in cluster.servers)))


# --- figures -----------------------------------------------------------------------------


@dataclass
class Figures:
    offered: float
    goodput: float
    failed: int
    requests: int
    ttft_p50: float
    ttft_p90: float
    hit_rate: float
    bound: float | None  # over every arrival of the stage
    bound_ok: float | None  # over the requests this router served: its hit rate's own base


def figures(
    run: Run, stage: tuple[str, float, float], slo: float, bound: list[int] | None
) -> Figures:
    name, start, end = stage
    chosen = [i for i, a in enumerate(run.arrivals) if a.stage == name]
    results = [run.results[i] for i in chosen]
    served = [i for i in chosen if run.results[i].status == 200 and run.results[i].ttft > 0]
    ok = [run.results[i] for i in served]
    ttfts = sorted([r.ttft * run.speedup for r in ok] + [math.inf] * (len(results) - len(ok)))
    seconds = max(end - start, 1e-9)
    good = sum(1 for r in ok if r.ttft * run.speedup <= slo)
    prompt = sum(r.prompt_tokens for r in ok)
    bound_rate = bound_ok = None
    if bound is not None:
        total = sum(len(run.arrivals[i].tokens) for i in chosen)
        bound_rate = sum(bound[i] for i in chosen) / max(1, total)
        # Past saturation a router that sheds serves a subset; its hit rate is of that
        # subset, so the bound it is held to is the same subset's, placed offline with
        # only what it admitted: a shed turn of a conversation is cached nowhere, and
        # the bound of every arrival would count it cached for the next turn.
        tokens = sum(len(run.arrivals[i].tokens) for i in served)
        placed = bound if run.admitted_bound is None else run.admitted_bound
        bound_ok = sum(placed[i] for i in served) / max(1, tokens)
    return Figures(
        offered=len(results) / seconds,
        goodput=good / seconds,
        failed=len(results) - len(ok),
        requests=len(results),
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p90=_quantile(ttfts, 0.9),
        hit_rate=sum(r.cached_tokens for r in ok) / max(1, prompt),
        bound=bound_rate,
        bound_ok=bound_ok,
    )


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]


def offline_bound(
    plan: Plan,
    engines: int,
    blocks: int,
    max_requests: int = 4000,
    admitted: list[bool] | None = None,
) -> list[int] | None:
    """Per arrival, its cached tokens in the better of two offline placements (one cache
    as large as the fleet's; kvbus's policy knowing every cache exactly), one request at
    a time; None for plans too long to simulate here. A plan's restarts and resets
    empty the same engine's cache at the same point of the arrivals; one shared cache
    has no engine to empty, so such a plan is bounded by the second placement alone.
    ``admitted``: only the arrivals it marks are placed (each with the same output as in
    the whole plan); the others count 0."""
    if len(plan.arrivals) > max_requests:
        return None
    rng = random.Random(0)
    outputs = [[rng.choice(VOCAB) for _ in range(plan.output_tokens)] for _ in plan.arrivals]
    kept = [i for i in range(len(plan.arrivals)) if admitted is None or admitted[i]]
    arrivals = [plan.arrivals[i] for i in kept]
    prompts = Prompts(BLOCK, [(plan.arrivals[i].tokens, outputs[i]) for i in kept])
    clears: dict[int, list[int]] = {}
    for at, _, engine in plan.actions:
        first = next((i for i, a in enumerate(arrivals) if a.at >= at), None)
        if first is not None:
            clears.setdefault(first, []).append(engine)
    cached = simulated_cached(Router(block_size=BLOCK), prompts, engines, blocks, clears)
    if not clears:
        pooled = pooled_cached(prompts, engines * blocks)
        cached = pooled if sum(pooled) >= sum(cached) else cached
    placed = [0] * len(plan.arrivals)
    for i, tokens in zip(kept, cached, strict=True):
        placed[i] = tokens
    return placed


def fmt_ms(seconds: float, timeout: float) -> str:
    if math.isinf(seconds):
        return f">{timeout:g}s"
    return f"{seconds * 1000:.0f}ms"


def table(
    runs: list[Run], plans: dict[int, Plan], bounds: dict[int, list[int] | None],
    slo: float, timeout: float,
) -> str:  # fmt: skip
    head = (
        f"{'stage':10} {'router':24} {'rep':>3} {'offered/s':>9} {'goodput/s':>9} "
        f"{'failed':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'hit rate':>8} {'bound':>6} "
        f"{'of ok':>6} {'CPU max':>7} {'machine':>7}"
    )
    lines = [head, "-" * len(head)]
    stages = plans[0].stages
    speeds: dict[str, set[float]] = {}
    for run in runs:
        speeds.setdefault(run.router, set()).add(run.speedup)

    def label(run: Run) -> str:  # a router run at several speedups: one row each
        return run.router if len(speeds[run.router]) < 2 else f"{run.router}@{run.speedup:g}"

    for index, stage in enumerate(stages):
        if stage[0] == WARM_UP:
            continue
        for router in dict.fromkeys(label(r) for r in runs):
            for run in (r for r in runs if label(r) == router):
                f = figures(run, plans[run.repetition].stages[index], slo, bounds[run.repetition])
                busiest = max(run.cpu.items(), key=lambda kv: kv[1])
                lines.append(
                    f"{stage[0]:10} {router:24} {run.repetition + 1:>3} {f.offered:>9.1f} "
                    f"{f.goodput:>9.1f} {f.failed:>6} {fmt_ms(f.ttft_p50, timeout):>9} "
                    f"{fmt_ms(f.ttft_p90, timeout):>9} {f.hit_rate:>8.3f} "
                    f"{'-' if f.bound is None else f'{f.bound:.3f}':>6} "
                    f"{'-' if f.bound_ok is None else f'{f.bound_ok:.3f}':>6} "
                    f"{busiest[1]:>6.0%}{busiest[0][0]} {run.machine_cpu:>7.0%}"
                )
        if index < len(stages) - 1:
            lines.append("")
    return "\n".join(lines)


# --- scenarios ---------------------------------------------------------------------------


@dataclass
class Scenario:
    key: str
    title: str
    engines: int
    blocks: int
    plan: Callable[[int], Plan]
    replicas: int = 1
    sim_args: tuple[str, ...] = ()
    max_model_len: int = 8192
    notes: str = ""


def shared_prefix_setup(args: argparse.Namespace, engines: int) -> tuple[SharedPrefix, int]:
    """The shared-prefix prompts and the per-engine KV blocks that put the working set at
    ``--pressure`` of the fleet's KV."""
    workload = SharedPrefix(
        0, args.groups, args.per_group, args.prefix_tokens, args.question_tokens
    )
    blocks = math.ceil(workload.working_set() / args.pressure / engines)
    return workload, blocks


def scenario_a(args: argparse.Namespace) -> Scenario:
    engines = args.engines
    workload, blocks = shared_prefix_setup(args, engines)
    rates = [float(r) for r in args.ladder.split(",")]

    def plan(repetition: int) -> Plan:
        rng = random.Random(f"a:{repetition}")
        arrivals, stages = warm_up(rng, workload, args.warmup_rate)
        at = stages[0][2]
        for rate in rates:
            name = f"{rate:g}/s"
            arrivals += workload.poisson(rng, rate, at, at + args.stage_seconds, name)
            stages.append((name, at, at + args.stage_seconds))
            at += args.stage_seconds
        return Plan(arrivals, stages, output_tokens=args.output_tokens)

    return Scenario(
        "a", f"shared prefix ({args.groups} groups x {args.per_group} prompts, "
        f"{args.prefix_tokens}-token prefix, {args.question_tokens}-token question), "
        f"working set {args.pressure:.0%} of the fleet's KV, rate ladder",
        engines, blocks, plan,
    )  # fmt: skip


def warm_up(
    rng: random.Random, workload: SharedPrefix, rate: float
) -> tuple[list[Arrival], list[tuple[str, float, float]]]:
    """One request of each group, in a random order, ``rate`` a second: the stage
    "warm-up" (not in the tables), where the router places the groups."""
    groups = rng.sample(workload.prompts, len(workload.prompts))
    arrivals = [Arrival(i / rate, rng.choice(g), WARM_UP, "warm-up") for i, g in enumerate(groups)]
    return arrivals, [(WARM_UP, 0.0, len(groups) / rate)]


WARM_UP = "warm-up"


def bursts_plan(
    args: argparse.Namespace, workload: SharedPrefix, key: str, repetition: int
) -> Plan:
    """Bursts of ``--burst`` requests with a new prompt each, ``--burst-rate`` a second
    (Poisson), over shared-prefix background traffic at ``--background-rate``; the
    bursts and the background are reported apart."""
    rng = random.Random(f"{key}:{repetition}")
    seconds = args.run_seconds
    arrivals = workload.poisson(rng, args.background_rate, 0.0, seconds, "background")
    at = 0.0
    while True:
        at += rng.expovariate(args.burst_rate)
        if at >= seconds:
            break
        prompt = [rng.choice(VOCAB) for _ in range(args.burst_tokens)]
        arrivals += [Arrival(at + i * 1e-4, prompt, "bursts", "burst") for i in range(args.burst)]
    arrivals.sort(key=lambda a: a.at)
    stages = [("bursts", 0.0, seconds), ("background", 0.0, seconds)]
    return Plan(arrivals, stages, output_tokens=args.output_tokens)


def scenario_e(args: argparse.Namespace) -> Scenario:
    workload, blocks = shared_prefix_setup(args, args.engines)
    return Scenario(
        "e", f"sibling bursts ({args.burst} x a new {args.burst_tokens}-token prompt, "
        f"{args.burst_rate:g} bursts/s) over shared-prefix traffic at "
        f"{args.background_rate:g} req/s",
        args.engines, blocks, lambda r: bursts_plan(args, workload, "e", r),
    )  # fmt: skip


def steady_plan(
    args: argparse.Namespace,
    workload: SharedPrefix,
    key: str,
    repetition: int,
    rate: float,
    marks: Sequence[tuple[str, float]] = (),
) -> Plan:
    """After a warm-up, shared-prefix traffic at ``rate`` for ``--run-seconds``, in
    stages that start at ``marks`` ((name, share of the run)) after a first one,
    "steady"."""
    rng = random.Random(f"{key}:{repetition}")
    arrivals, stages = warm_up(rng, workload, args.warmup_rate)
    begin = stages[0][2]
    end = begin + args.run_seconds
    steady = workload.poisson(rng, rate, begin, end, "")
    starts = [
        ("steady", begin),
        *((name, begin + share * args.run_seconds) for name, share in marks),
    ]
    stages += [
        (name, at, starts[i + 1][1] if i + 1 < len(starts) else end)
        for i, (name, at) in enumerate(starts)
    ]
    for arrival in steady:
        arrival.stage = next(name for name, b, e in stages[1:] if b <= arrival.at < e)
    return Plan(arrivals + steady, stages, output_tokens=args.output_tokens)


def scenario_c(args: argparse.Namespace) -> Scenario:
    workload, blocks = shared_prefix_setup(args, args.engines)

    def plan(repetition: int) -> Plan:
        marks = [("restarted", 1 / 3), ("reset", 2 / 3)]
        plan = steady_plan(args, workload, "c", repetition, args.steady_rate, marks)
        # Engine 0 restarts a third into the run, engine 1's cache is reset at two thirds.
        at = {name: begin for name, begin, _ in plan.stages}
        plan.actions = [(at["restarted"], "restart", 0), (at["reset"], "reset", 1)]
        return plan

    return Scenario(
        "c", f"engine sim-0 restarted at 1/3, sim-1's prefix cache reset at 2/3 of the run, "
        f"shared-prefix traffic at {args.steady_rate:g} req/s",
        args.engines, blocks, plan,
        notes="the bound's caches empty at the same restart and reset",
    )  # fmt: skip


def scenario_f(args: argparse.Namespace) -> Scenario:
    workload, blocks = shared_prefix_setup(args, args.engines)
    return Scenario(
        "f", f"engine sim-0 {args.slow_factor:g}x slower than the others "
        f"(kvbus sim --slow), shared-prefix traffic at {args.slow_rate:g} req/s",
        args.engines, blocks, lambda r: steady_plan(args, workload, "f", r, args.slow_rate),
        sim_args=("--slow", f"0={args.slow_factor:g}"),
    )  # fmt: skip


def scenario_d(args: argparse.Namespace) -> Scenario:
    workload, blocks = shared_prefix_setup(args, args.engines)
    return Scenario(
        "d", f"{args.replicas} router replicas, requests alternating between them: sibling "
        f"bursts ({args.burst} x {args.burst_tokens} tokens, {args.burst_rate:g}/s) over "
        f"shared-prefix traffic at {args.background_rate:g} req/s",
        args.engines, blocks, lambda r: bursts_plan(args, workload, "d", r),
        replicas=args.replicas,
    )  # fmt: skip


def scenario_b(args: argparse.Namespace) -> Scenario:
    """Mooncake's conversation trace from ``--trace-start`` s for ``--trace-seconds``,
    one stage per rate of ``--trace-rates``: each stage takes its own ``--trace-share``
    of the conversations (whole: every turn of a kept conversation, picked by a hash
    of its first two block ids, as are one-off requests), at their recorded arrival
    times compressed to that mean rate. Each trace block id is ``--trace-id-tokens``
    tokens. Reuse in the trace is mostly a conversation's later turns, minutes apart:
    a short window holds almost none, hence a share of the whole hour."""
    if not args.trace.is_file():
        raise FileNotFoundError(f"no trace at {args.trace} (--trace)")
    rates = [float(r) for r in args.trace_rates.split(",")]
    if args.trace_share * len(rates) > 1:
        raise ValueError("--trace-share times the number of --trace-rates is over 1")
    timed = [
        (ms, r, zlib.crc32(repr(r.conversation).encode()) % 10_000 / 10_000)
        for ms, r in load_trace_timed(args.trace)
        if args.trace_start <= ms / 1000 < args.trace_start + args.trace_seconds
    ]
    stages = [
        [(ms, r) for ms, r, bucket in timed
         if k * args.trace_share <= bucket < (k + 1) * args.trace_share]
        for k in range(len(rates))
    ]  # fmt: skip
    workload = Workload(
        block_size=BLOCK, max_blocks=args.trace_max_ids, output_tokens=args.output_tokens,
        id_tokens=args.trace_id_tokens,
    )  # fmt: skip
    engines = args.trace_engines
    biggest = max(workload.working_set(r for _, r in stage) for stage in stages)
    blocks = math.ceil(biggest / args.pressure / engines)
    longest = max(len(workload.tokens(r)) for stage in stages for _, r in stage)

    def plan(repetition: int) -> Plan:
        # The trace is the trace: every repetition replays the same arrivals.
        del repetition
        arrivals: list[Arrival] = []
        names: list[tuple[str, float, float]] = []
        begin = 0.0
        for rate, stage in zip(rates, stages, strict=True):
            first, last = stage[0][0] / 1000, stage[-1][0] / 1000
            speed = max(1e-9, (last - first) / len(stage) * rate)
            name = f"{rate:g}/s"
            arrivals += [
                Arrival(begin + (ms / 1000 - first) / speed, workload.tokens(r), name, "trace")
                for ms, r in stage
            ]
            end = arrivals[-1].at + 1e-3
            names.append((name, begin, end))
            begin = end + args.trace_gap
        return Plan(arrivals, names, output_tokens=args.output_tokens)

    return Scenario(
        "b", f"Mooncake conversation trace ({args.trace_start:g} s on for "
        f"{args.trace_seconds:g} s), per stage {args.trace_share:.1%} of its conversations "
        f"({', '.join(str(len(s)) for s in stages)} requests) at their recorded arrival "
        f"times compressed to a mean of {args.trace_rates} req/s, {args.trace_id_tokens} "
        f"tokens per trace block (first {args.trace_max_ids}), each stage's working set at "
        f"most {args.pressure:.0%} of the fleet's KV",
        engines, blocks, plan,
        max_model_len=max(2048, longest + 2 * BLOCK + args.output_tokens),
    )  # fmt: skip


def load_trace_timed(path: Path) -> list[tuple[int, TraceRequest]]:
    """The trace's requests with their arrival times (ms)."""
    times = [int(json.loads(line).get("timestamp", 0)) for line in path.open()]
    return list(zip(times, load_trace(path), strict=True))


# --- main --------------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[argparse.Namespace], Scenario]] = {
    "a": scenario_a,
    "e": scenario_e,
    "c": scenario_c,
    "f": scenario_f,
    "d": scenario_d,
    "b": scenario_b,
}


def speedups(policies: list[str], args: argparse.Namespace) -> dict[float, list[str]]:
    """The routers by the sim's speedup they run at: ``--speedup``, or less for routers
    that cost the sim more CPU per request (``--speedup-for``). The figures are in
    simulated time, so rows run at different speedups compare as long as no process
    is CPU-bound, except in the routers' own wall time, which counts for less at a
    lower speedup: ``--kv-at-every-speedup`` also runs kv beside each slower peer."""
    special = dict(args.speedup_for or [])
    groups: dict[float, list[str]] = {}
    for policy in policies:
        groups.setdefault(special.get(policy, args.speedup), []).append(policy)
    if args.kv_at_every_speedup and "kv" in policies:
        for routers in groups.values():
            if "kv" not in routers and any(r in PEERS for r in routers):
                routers.insert(0, "kv")
    return groups


async def run_scenario(
    scenario: Scenario, policies: list[str], args: argparse.Namespace
) -> tuple[list[Run], dict[int, Plan], dict[int, list[int] | None]]:
    repetitions = args.repetitions or (3 if scenario.key in "ae" else 2)
    plans = {r: scenario.plan(r) for r in range(repetitions)}
    runs: list[Run] = []
    for speedup, routers in speedups(policies, args).items():
        runs += await run_fleet(scenario, routers, plans, speedup, args)
    started = time.monotonic()
    bounds = {r: offline_bound(p, scenario.engines, scenario.blocks) for r, p in plans.items()}
    for run in runs:
        admitted = [result.status != 503 for result in run.results]
        if bounds[run.repetition] is not None and not all(admitted):
            plan = plans[run.repetition]
            run.admitted_bound = offline_bound(
                plan, scenario.engines, scenario.blocks, admitted=admitted
            )
    say(f"  offline bounds in {time.monotonic() - started:.0f} s")
    return runs, plans, bounds


async def run_fleet(
    scenario: Scenario,
    policies: list[str],
    plans: dict[int, Plan],
    speedup: float,
    args: argparse.Namespace,
) -> list[Run]:
    """Every repetition's plan through each of ``policies`` in turn, on one sim fleet."""
    runs: list[Run] = []
    peers = any(p in PEERS for p in policies)
    with tempfile.TemporaryDirectory(prefix="kvbus-fleet-routing-") as tmp:
        directory = Path(tmp)
        if args.logs:
            directory = args.logs / f"{scenario.key}-{time.strftime('%H%M%S')}"
            directory.mkdir(parents=True)
        cluster = Cluster(
            directory, servers=scenario.engines, blocks=scenario.blocks,
            model=(256, 2, scenario.max_model_len), max_model_len=scenario.max_model_len,
            peers=(args.peers or PEERS_VENV) if peers else None,
            sim=Sim(args.profile, speedup, scenario.sim_args),
        )  # fmt: skip
        # As the peers' (no access log); debug: each decision's Decision.explain().
        cluster.router_args = ["--log-level", "debug" if args.router_debug else "warning"]
        if args.kvbus_block_size:
            # As the peers are told theirs (vllm-router's --kv-event-block-size); without
            # it kvbus learns it from the engines' load records (LoadMetrics.block_size).
            cluster.router_args += ["--block-size", str(BLOCK)]
        if args.kvbus_shed:
            # The SLO (or --kvbus-shed-after), in the router's (wall) seconds: a request
            # that would start later counts for nothing, and only takes the engines' time
            # from the others.
            limit = args.slo if args.kvbus_shed_after is None else args.kvbus_shed_after
            cluster.router_args += ["--shed-after", f"{limit / speedup:g}"]
        if args.kvbus_deadline:
            # The clients' timeout, in the router's seconds: a request that would end
            # later is lost, its decode too (past saturation most lost ones had their
            # first token in time).
            cluster.router_args += ["--deadline", f"{args.timeout / speedup:g}"]
        for weight in args.kv_weight:
            cluster.router_args += ["--weight", weight]
        cluster.router_args += args.kv_arg
        started = time.monotonic()
        cluster.start()
        say(f"  {scenario.engines} engines x {scenario.blocks} blocks, speedup {speedup:g}, "
            f"up in {time.monotonic() - started:.0f} s")  # fmt: skip
        try:
            for repetition, plan in plans.items():
                turn = repetition % len(policies)
                for policy in policies[turn:] + policies[:turn]:
                    began = time.monotonic()
                    try:
                        run = await run_router(
                            cluster, scenario.key, policy, repetition, plan,
                            scenario.replicas, speedup, args.timeout,
                        )  # fmt: skip
                    except Exception as error:  # one router's failure ends only its run
                        say(f"  ({scenario.key}) repetition {repetition + 1} {policy}: "
                            f"failed: {error!r}")  # fmt: skip
                        continue
                    runs.append(run)
                    measured = [s for s in plan.stages if s[0] != WARM_UP]
                    whole = ("all", min(s[1] for s in measured), max(s[2] for s in measured))
                    f = figures(_whole(run), whole, args.slo, None)
                    say(
                        f"  ({scenario.key}) repetition {repetition + 1} {policy}: goodput "
                        f"{f.goodput:.1f}/s of {f.offered:.1f}/s, failed {f.failed}, TTFT p90 "
                        f"{fmt_ms(f.ttft_p90, args.timeout)}, hit rate {f.hit_rate:.3f}, "
                        f"CPU {', '.join(f'{k} {v:.0%}' for k, v in run.cpu.items())}, "
                        f"machine {run.machine_cpu:.0%}; busiest engine x{run.busiest:.2f}; "
                        f"{time.monotonic() - began:.0f} s"
                        + (f"; {'; '.join(run.actions)}" if run.actions else "")
                    )
        finally:
            cluster.stop()
    return runs


def _whole(run: Run) -> Run:
    """``run`` with every arrival but the warm-up's in one stage "all"."""
    arrivals = [
        Arrival(a.at, a.tokens, a.stage if a.stage == WARM_UP else "all", a.kind)
        for a in run.arrivals
    ]
    return Run(run.scenario, run.router, run.repetition, arrivals, run.results, run.speedup,
               run.cpu, run.machine_cpu, run.actions, run.router_metrics,
               run.engine_prompt_tokens)  # fmt: skip


def _router_speedup(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    return name, float(value)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios", help="of a,e,c,f,d,b, comma-separated (default all; --quick: a,e)"
    )
    parser.add_argument("--routers", help="default: kv,round_robin and every installed peer's")
    parser.add_argument("--peers", type=Path, help="venv of the peers (default .venv-peers)")
    parser.add_argument(
        "--repetitions", type=int, help="default 3 for (a) and (e), 2 for the others"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a few minutes: (a) and (e) unless --scenarios, 1 repetition, stages and "
        "runs a sixth as long",
    )  # fmt: skip
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument(
        "--profile", default="2xh100-qwen3-32b",
        help="kvbus sim's step timing (default: llm-d's Qwen3-32B on 2 H100s per engine)",
    )  # fmt: skip
    parser.add_argument(
        "--speedup", type=float, default=0.1, help="kvbus sim's (below 1: slower than real)"
    )
    parser.add_argument(
        "--speedup-for", action="append", type=_router_speedup, metavar="ROUTER=SPEEDUP",
        help="run ROUTER on a fleet of this speedup instead (repeatable; default: the "
        "vllm-router runs at a quarter of --speedup: they render each prompt on every "
        "engine, 8 renders a request, which would make the one sim process CPU-bound)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-at-every-speedup", action="store_true",
        help="kvbus's kv also on each fleet a peer runs on at another speedup (--speedup-for), "
        "so that each peer is judged against kv at its own speed (a router's wall time "
        "counts for less, simulated, on a slower fleet); the verdicts pair them",
    )  # fmt: skip
    parser.add_argument("--slo", type=float, default=1.0, help="TTFT SLO, simulated seconds")
    parser.add_argument(
        "--timeout", type=float, default=1.5,
        help="a request not answered within this (simulated s) counts as failed",
    )  # fmt: skip
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--per-group", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--question-tokens", type=int, default=300)
    parser.add_argument("--pressure", type=float, default=0.73, help="working set / fleet KV")
    parser.add_argument("--ladder", default="150,300,450,600", help="(a): rates, simulated req/s")
    parser.add_argument(
        "--stage-seconds", type=float, default=0.6,
        help="(a): simulated (at 0.2 s, its 150/s stage had 23-36 requests)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-rate", type=float, default=80.0,
        help="(a): each group's first request at this rate (req/s) before the ladder",
    )  # fmt: skip
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--burst-tokens", type=int, default=1800)
    parser.add_argument("--burst-rate", type=float, default=10.0, help="bursts per simulated s")
    parser.add_argument("--background-rate", type=float, default=200.0, help="(d, e): req/s")
    parser.add_argument(
        "--run-seconds", type=float, default=2.4,
        help="(c-f): simulated (at 0.8 s a stage had 60-255 requests, and one router's p90 "
        "moved by up to 80 ms between runs of one plan)",
    )  # fmt: skip
    parser.add_argument("--steady-rate", type=float, default=300.0, help="(c): req/s")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="(f)")
    parser.add_argument(
        "--slow-rate", type=float, default=650.0,
        help="(f): req/s (at 300 the slow engine keeps up and every router ties; at 650 "
        "it doubled sglang-router's TTFT p90: 258 ms, against 114 on a uniform fleet)",
    )  # fmt: skip
    parser.add_argument("--replicas", type=int, default=3, help="(d)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="(b)")
    parser.add_argument("--trace-start", type=float, default=0.0, help="(b): seconds")
    parser.add_argument(
        "--trace-seconds", type=float, default=3600.0, help="(b): of the trace (all of it)"
    )
    parser.add_argument(
        "--trace-share", type=float, default=1 / 16, help="(b): of its conversations"
    )
    parser.add_argument(
        "--trace-rates", default="150,300",
        help="(b): a stage per mean rate (req/s), each with conversations of its own",
    )  # fmt: skip
    parser.add_argument(
        "--trace-gap", type=float, default=1.0, help="(b): simulated s between stages"
    )
    parser.add_argument("--trace-id-tokens", type=int, default=128, help="(b)")
    parser.add_argument("--trace-max-ids", type=int, default=48, help="(b)")
    parser.add_argument("--trace-engines", type=int, default=16, help="(b)")
    parser.add_argument(
        "--json", type=Path,
        help="write every request's figures here (its engine: kvbus's x-kvbus-worker, or "
        "for a peer the engine kvbus sim names in the answer's id)",
    )  # fmt: skip
    parser.add_argument("--logs", type=Path, help="keep the processes' logs here")
    parser.add_argument(
        "--kvbus-block-size", action=argparse.BooleanOptionalAction, default=False,
        help="give kvbus's routers the engines' block size (default: they learn it from "
        "the engines' load records; before LoadMetrics.block_size, from the first KV event)",
    )  # fmt: skip
    parser.add_argument(
        "--kvbus-shed", action=argparse.BooleanOptionalAction, default=True,
        help="give kvbus's routers --shed-after at the --slo (a request predicted to start "
        "later would not count; the peers have no predicted-wait limit; a shed request "
        "counts as failed)",
    )  # fmt: skip
    parser.add_argument(
        "--kvbus-shed-after", type=float, metavar="SECONDS",
        help="kvbus's routers' --shed-after in simulated seconds instead of the --slo (past "
        "saturation what they admit must leave its decode room within --timeout)",
    )  # fmt: skip
    parser.add_argument(
        "--kvbus-deadline", action=argparse.BooleanOptionalAction, default=True,
        help="give kvbus's routers --deadline at the clients' --timeout (a request "
        "predicted to end later is shed: it would time out anyway)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-weight", action="append", default=[], metavar="NAME=VALUE",
        help="a cost weight for kvbus's routers (their --weight; kvbus.routing.cost)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-arg", action="append", default=[], metavar="ARG",
        help="another option for kvbus's routers (--kv-arg=--late-ratio --kv-arg=1.5)",
    )  # fmt: skip
    parser.add_argument(
        "--router-debug", action="store_true",
        help="kvbus's routers log every decision with its reason (with --logs; costs CPU)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.kvbus_shed_after is not None and not (
        args.kvbus_shed and 0 < args.kvbus_shed_after < math.inf
    ):
        parser.error("--kvbus-shed-after takes a positive number of seconds, with --kvbus-shed")
    if not 0 < args.timeout < math.inf:
        parser.error("--timeout takes a positive number of seconds")
    if args.speedup_for is None:
        args.speedup_for = [(name, args.speedup / 4) for name in PEERS if "vllm-router" in name]
    if args.quick:
        args.repetitions = 1
        args.scenarios = args.scenarios or "a,e"
        args.stage_seconds /= 6  # 0.1 s
        args.run_seconds /= 6  # 0.4 s: a few minutes for the demo's (c) and (d)
        args.trace_share /= 2
    args.scenarios = args.scenarios or "a,e,c,f,d,b"
    return args


async def main() -> None:
    args = parse_args()
    policies = policies_to_compare(args.routers, args.peers)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "scenarios": {}}
    out = []
    for key in args.scenarios.split(","):
        try:
            scenario = SCENARIOS[key](args)
        except FileNotFoundError as error:
            say(f"({key}) skipped: {error}")
            continue
        say(f"({key}) {scenario.title}: {', '.join(policies)}")
        runs, plans, bounds = await run_scenario(scenario, policies, args)
        slower = ", ".join(
            f"{', '.join(routers)}: {speedup:g}"
            for speedup, routers in speedups(policies, args).items()
            if speedup != args.speedup
        )
        report["scenarios"][key] = {
            "title": scenario.title,
            "engines": scenario.engines,
            "blocks": scenario.blocks,
            "runs": [
                {
                    "router": r.router,
                    "repetition": r.repetition,
                    "speedup": r.speedup,
                    "cpu": r.cpu,
                    "machine_cpu": r.machine_cpu,
                    "actions": r.actions,
                    "engine_prompt_tokens": r.engine_prompt_tokens,
                    "router_metrics": r.router_metrics,
                    "stages": {
                        s[0]: vars(figures(r, s, args.slo, bounds[r.repetition]))
                        for s in plans[r.repetition].stages
                    },
                    "requests": [
                        [
                            a.at,
                            a.stage,
                            a.kind,
                            x.status,
                            x.ttft * r.speedup,
                            x.prompt_tokens,
                            x.cached_tokens,
                            x.worker,
                            None if bounds[r.repetition] is None else bounds[r.repetition][i],
                            # the bound of what the run admitted, where it shed any
                            None if r.admitted_bound is None else r.admitted_bound[i],
                        ]
                        for i, (a, x) in enumerate(zip(r.arrivals, r.results, strict=True))
                    ],
                }
                for r in runs
            ],
        }
        if args.json:  # before the verdicts: a fault in them loses no run
            args.json.write_text(json.dumps(report, indent=1))
        out.append(
            f"\n({key}) {scenario.title}; {scenario.engines} engines x {scenario.blocks} KV "
            f"blocks of {BLOCK} ({args.profile}, speedup {args.speedup:g}"
            f"{f'; {slower}' if slower else ''}), "
            f"{len(plans)} repetition(s); SLO TTFT <= {args.slo:g} s"
            f"{f'; {scenario.notes}' if scenario.notes else ''}\n"
            + table(runs, plans, bounds, args.slo, args.timeout)
            + (
                "\n\nkv against the best peer, request by request (bench/fleet_verdicts.py):\n"
                + fleet_verdicts.table(report["scenarios"][key], "kv", args.slo, peers=PEERS)
                if "kv" in policies and any(p in PEERS for p in policies)
                else ""
            )
        )
    print("\n".join(out))


if __name__ == "__main__":
    asyncio.run(main())
