"""`kvbus sim` at fleet scale (issue 31): how many simulated engines one core carries at
20 and 100 steps/s, and a 1,000-engine fleet followed by a router, extrapolated to
production rates.

What is real: vLLM's own Scheduler and KV cache manager in each engine (`kvbus.sim`'s
`SimEngine`, driven by its own loop as in ``kvbus sim``), each engine's two
`kvbus.Publisher`s (KV events through the vLLM plugin's `KvbusEventPublisher`, load
through `KvbusStatLogger`: a sender thread, an event loop and a connection each, plus
the stat logger's heartbeat thread), nats-server (JetStream, file storage, default
sync, started here), and the router (`kvbus.subscribe()` over the kv and metrics
streams into `kvbus.routing.router.Router`, with ``route()`` queries on the same loop,
as ``kvbus router`` follows them). Not here: the engines' HTTP API (requests are handed
to `SimEngine.submit` directly, to isolate an engine's own cost).

The workload: each engine keeps ``--running`` requests in flight (a new one as soon as
one ends): a prompt of a shared prefix (one of ``--prefixes``, 256 tokens) and 256 tokens
of its own, ``--max-tokens`` tokens out, so steps mix decodes with a prefill now and
then, and blocks are stored and (the cache full) evicted as on a busy engine. The step
time is a profile with every term 0 but ``weight_read = 1 / RATE``: each step lasts
1/RATE seconds of modelled forward pass, so an engine that keeps its schedule steps RATE
times a second; one that gets too little CPU falls behind (the sim never catches up).

Part 1, the engine side: K engines in one process (one GIL: about one core), no router,
for each bus (``none``: no publishers, the scheduler alone; ``nats``: the real bus),
each rate and each K of the sweep. Figures: steps/s achieved per engine (and % of the
target), the process's CPU (every thread, from getrusage) per engine-step and per
engine-second, KV batches and load records published per engine-second. The engines one
core carries at a rate: the largest K still at >= 95% of the rate one engine alone
achieves (K = 1), and 1 / (CPU-seconds per engine-second) at the sweep's points that
kept the rate. Splitting a process's engines over more processes is part 2's
``--processes``: the publishers' cost per message grows with the threads under one GIL.

Part 2, the fleet: ``--fleet`` engines (1,000) over ``--processes`` processes at a rate
the machine sustains, publishing to nats-server, with a router following: event lag
(publish() timestamp to applied in the router's index) p50/p99, ``route()`` p50/p99
with the fleet's blocks in the index, and the CPU of each side (engines, nats-server,
router) per 1,000 engines, extrapolated linearly to 20 and 100 steps/s (the messages
per engine-second and the engine side's CPU from part 1's steady-state engines at that
rate; nats-server's and the router's CPU per message from this fleet: taken at a low
message rate, where each message wakes its reader alone, they are ceilings).

Run: python bench/bench_sim.py [--repeats 2]   (about 10 minutes)
     python bench/bench_sim.py --quick        (smoke run, about a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fleet import cpu_seconds, machine_busy_seconds, memory_mib, spawn, table
from bench.bench_transports import _DefaultSyncNats

PREFIX_TOKENS = 256
OWN_TOKENS = 256
VOCAB = 1024  # examples/cluster.py's model: ids 3..1023 are words
SETUP_LIMIT = 300.0  # seconds an engine process may take to start its engines


# --- the workload -------------------------------------------------------------------------


def prefixes(count: int) -> list[list[int]]:
    """The shared prompt prefixes, the same in every process (seeded)."""
    rng = random.Random(31)
    return [[rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(count)]


class Prompts:
    """Prompts: a shared prefix and 256 tokens of the request's own (a slice of a random
    pool, led by two tokens from a counter so no two requests share it)."""

    def __init__(self, count: int, seed: int) -> None:
        self.prefixes = prefixes(count)
        self.rng = random.Random(seed)
        self.pool = [self.rng.randrange(3, VOCAB) for _ in range(8192)]
        self.made = 0

    def __call__(self) -> list[int]:
        n = self.made = self.made + 1
        start = self.rng.randrange(len(self.pool) - OWN_TOKENS)
        own = [3 + n % 1021, 3 + n // 1021 % 1021, *self.pool[start : start + OWN_TOKENS - 2]]
        return self.rng.choice(self.prefixes) + own


class Spec(msgspec.Struct, frozen=True):
    model: str
    url: str | None
    """the bus (None: no publishers)"""
    kv_stream: str
    metrics_stream: str
    rate: float
    """target steps/s of each engine"""
    running: int
    max_tokens: int
    prefixes: int
    kv_blocks: int
    block_size: int


class EngineReport(msgspec.Struct):
    engines: int
    steps: int
    """engine steps in the window, all engines"""
    cpu: float
    """this process's CPU seconds in the window (every thread)"""
    seconds: float
    kv_batches: int
    load_records: int
    dropped: int
    setup_s: float
    threads: int
    fds: int
    rss_mib: float


def run_engines(spec: Spec, first: int, count: int, control: Connection) -> None:
    """An engine process: engines ``sim-{first}``.. ``sim-{first+count-1}``."""
    faulthandler.dump_traceback_later(SETUP_LIMIT + 120, exit=True)  # a hang says where
    os.environ["KVBUS_STREAM"] = spec.kv_stream
    os.environ["KVBUS_METRICS_STREAM"] = spec.metrics_stream
    asyncio.run(_engines(spec, first, count, control))
    os._exit(0)  # the publishers' closes (SourceStopped each) are not measured


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _engines(spec: Spec, first: int, count: int, control: Connection) -> None:
    from vllm.sampling_params import SamplingParams

    from kvbus.sim.engine import BusOptions, SimEngine
    from kvbus.sim.engine_core import EngineShape, engine_config
    from kvbus.sim.fleet import _raise_file_limit
    from kvbus.sim.timing import Profile, TimingModel

    began = time.perf_counter()
    _raise_file_limit(count)
    shape = EngineShape(
        spec.model, spec.kv_blocks, spec.block_size, max_num_seqs=max(64, spec.running)
    )
    config = engine_config(shape)
    timing = TimingModel(Profile(0.0, 1 / spec.rate, 0.0, 0.0, 0.0))
    bus = BusOptions(url=spec.url)
    engines = [SimEngine(f"sim-{first + i}", config, timing, bus, "sim") for i in range(count)]
    kv = [p.publisher for e in engines for p in e._publishers.publishers]  # type: ignore[attr-defined]
    load = [e.stat_logger.publisher for e in engines if e.stat_logger and e.stat_logger.publisher]
    for publisher in [*kv, *load]:
        await publisher.aflush(SETUP_LIMIT)  # connected, streams made
    setup_s = time.perf_counter() - began
    control.send("ready")
    start, window_start, end = await asyncio.to_thread(control.recv)
    prompts = Prompts(spec.prefixes, first)
    sampling = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)

    async def top_up() -> None:
        # Each engine's finished requests replaced at once (what a busy server sees);
        # in one task for all, so the driver costs a scan per 20 ms, not a task each.
        while True:
            for engine in engines:
                for _ in range(spec.running - len(engine._streams)):
                    engine.submit(prompts(), sampling)
            await asyncio.sleep(0.02)

    await asyncio.sleep(max(0.0, start - time.time()))
    rng = random.Random(first)
    for engine in engines:  # random phases, as engines that started apart
        asyncio.get_running_loop().call_later(rng.random() / spec.rate, engine.start)
    driver = asyncio.create_task(top_up())

    def sample() -> tuple[float, int, int, int, float]:
        return (
            time.perf_counter(),
            sum(e.steps for e in engines),
            sum(p.stats.published for p in kv),
            sum(p.stats.published for p in load),
            _process_cpu(),
        )

    await asyncio.sleep(max(0.0, window_start - time.time()))
    t0, s0, k0, l0, c0 = sample()
    await asyncio.sleep(max(0.0, end - time.time()))
    t1, s1, k1, l1, c1 = sample()
    driver.cancel()
    report = EngineReport(
        engines=count,
        steps=s1 - s0,
        cpu=c1 - c0,
        seconds=t1 - t0,
        kv_batches=k1 - k0,
        load_records=l1 - l0,
        dropped=sum(p.stats.dropped for p in [*kv, *load]),
        setup_s=setup_s,
        threads=len(os.listdir("/proc/self/task")),
        fds=len(os.listdir("/proc/self/fd")),
        rss_mib=memory_mib("VmRSS"),
    )
    control.send(msgspec.msgpack.encode(report))
    # Kept open until the router has drained: what the publishers still hold gets sent.
    await asyncio.to_thread(control.recv)


# --- the router ---------------------------------------------------------------------------


class RouterReport(msgspec.Struct):
    applied: int = 0
    """kv batches published in the window and applied by the end of the drain"""
    lag_p50: float = 0.0
    lag_p99: float = 0.0
    load_records: int = 0
    routes: int = 0
    route_p50: float = 0.0
    route_p99: float = 0.0
    matched: int = 0
    """queries whose pick held some of the prompt"""
    route_seconds: float = 0.0
    """route() wall time in the window, all queries (taken from the router's CPU)"""
    workers: int = 0
    lost: int = 0
    rss_mib: float = 0.0


def run_router(spec: Spec, qps: float, control: Connection) -> None:
    asyncio.run(_route(spec, qps, control))
    os._exit(0)  # a subscription slow to close must not hold the run


async def _route(spec: Spec, qps: float, control: Connection) -> None:
    import kvbus
    from kvbus.routing.router import Router

    assert spec.url is not None
    router = Router(block_size=spec.block_size)
    report = RouterReport()
    window = [float("inf"), float("inf")]
    lags: list[float] = []

    async def follow(stream: str, apply: Callable[[Any], None], kv: bool, **options: Any) -> None:
        async with kvbus.subscribe(stream, spec.url, **options) as sub:
            async for item in sub:
                apply(item)
                if isinstance(item, kvbus.Resync):
                    if item.lost:
                        report.lost += item.lost[1] - item.lost[0] + 1
                    continue
                if not window[0] <= item.ts < window[1]:
                    continue
                if not kv:
                    report.load_records += 1
                elif item.kind is kvbus.Kind.KV:
                    lags.append(time.time() - item.ts)

    tasks = [
        asyncio.create_task(follow(spec.kv_stream, router.apply_kv, True)),
        asyncio.create_task(
            follow(spec.metrics_stream, router.apply_metrics, False, gap_timeout=0)
        ),
    ]
    control.send("ready")
    window[0], window[1], drain_until = await asyncio.to_thread(control.recv)
    prompts = Prompts(spec.prefixes, 10**6)
    routes: list[float] = []
    await asyncio.sleep(max(0.0, window[0] - time.time()))
    while time.time() < window[1]:
        tokens = prompts()
        began = time.perf_counter()
        decision = router.route(tokens)
        routes.append(time.perf_counter() - began)
        if decision is not None:
            report.matched += decision.matched_tokens > 0
            router.finished(decision)
        await asyncio.sleep(1 / qps)
    await asyncio.sleep(max(0.0, drain_until - time.time()))
    for task in tasks:
        task.cancel()
    report.applied = len(lags)
    if lags:
        report.lag_p50, report.lag_p99 = (float(x) for x in np.percentile(lags, [50, 99]))
    report.routes = len(routes)
    if routes:
        report.route_p50, report.route_p99 = (float(x) for x in np.percentile(routes, [50, 99]))
    report.route_seconds = sum(routes)
    report.workers = len(router.eligible())
    report.rss_mib = memory_mib("VmRSS")
    control.send(msgspec.msgpack.encode(report))


# --- one measured run -----------------------------------------------------------------------


class Point(msgspec.Struct):
    bus: str
    rate: float
    engines: int
    processes: int
    steps_per_s: float
    """achieved, per engine"""
    cpu_us_per_step: float
    """engine processes' CPU per engine-step"""
    core_per_engine: float
    """engine processes' CPU-seconds per engine-second"""
    engine_cpu: float
    """engine processes' CPU-seconds per second, all"""
    kv_per_s: float
    """KV batches per engine-second"""
    load_per_s: float
    dropped: int
    setup_ms: float
    """per engine"""
    threads: int
    fds: int
    rss_mib: float
    machine_cpu: float
    nats_cpu: float = 0.0
    router_cpu: float = 0.0
    router: RouterReport | None = None


def measure(
    spec: Spec, engines: int, processes: int, args: Any, nats_pid: int | None, router: bool
) -> Point:
    consumer = spawn(run_router, spec, args.qps) if router else None
    if consumer is not None:
        assert consumer[1].recv() == "ready"
    shares = [engines // processes + (i < engines % processes) for i in range(processes)]
    firsts = [sum(shares[:i]) for i in range(processes)]
    workers = [spawn(run_engines, spec, f, n) for f, n in zip(firsts, shares, strict=True) if n]
    for process, pipe in workers:
        if not pipe.poll(SETUP_LIMIT) or pipe.recv() != "ready":
            raise RuntimeError(f"engine process {process.pid} did not start")
    start = time.time() + 0.5
    window_start = start + args.warmup
    end = window_start + args.seconds
    for _, pipe in workers:
        pipe.send((start, window_start, end))
    if consumer is not None:
        consumer[1].send((window_start, end, end + args.drain))
    pids = {"nats": [nats_pid] if nats_pid else [], "router": [consumer[0].pid] if consumer else []}

    def sample() -> dict[str, float]:
        used = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
        used["machine"] = machine_busy_seconds()
        return used

    time.sleep(max(0.0, window_start - time.time()))
    before = sample()
    time.sleep(max(0.0, end - time.time()))
    after = sample()
    cpu = {k: (after[k] - before[k]) / args.seconds for k in after}
    reports = [msgspec.msgpack.decode(pipe.recv(), type=EngineReport) for _, pipe in workers]
    routed = None
    if consumer is not None:
        routed = msgspec.msgpack.decode(consumer[1].recv(), type=RouterReport)
        consumer[0].join(10)
        if consumer[0].is_alive():
            consumer[0].kill()
    for process, pipe in workers:
        pipe.send("close")
        process.join(30)
    steps = sum(r.steps for r in reports)
    seconds = statistics.fmean(r.seconds for r in reports)
    engine_cpu = sum(r.cpu for r in reports) / seconds
    return Point(
        bus=(spec.url or "none").partition(":")[0],
        rate=spec.rate,
        engines=engines,
        processes=processes,
        steps_per_s=steps / seconds / engines,
        cpu_us_per_step=sum(r.cpu for r in reports) / max(1, steps) * 1e6,
        core_per_engine=engine_cpu / engines,
        engine_cpu=engine_cpu,
        kv_per_s=sum(r.kv_batches for r in reports) / seconds / engines,
        load_per_s=sum(r.load_records for r in reports) / seconds / engines,
        dropped=sum(r.dropped for r in reports),
        setup_ms=max(r.setup_s for r in reports) / max(reports[0].engines, 1) * 1e3,
        threads=sum(r.threads for r in reports),
        fds=sum(r.fds for r in reports),
        rss_mib=sum(r.rss_mib for r in reports),
        machine_cpu=cpu["machine"],
        nats_cpu=cpu["nats"],
        router_cpu=cpu["router"],
        router=routed,
    )


# --- the tables -----------------------------------------------------------------------------


def median(points: list[Point], field: str) -> float:
    return float(statistics.median(getattr(p, field) for p in points))


def routed_median(points: list[Point], field: str) -> float:
    return float(statistics.median(getattr(p.router, field) for p in points if p.router))


def sweep_tables(results: dict[tuple[str, float, int], list[Point]], args: Any) -> None:
    print(f"\nThe engine side: K engines in one process, medians of {args.repeats} run(s)\n")
    rows = []
    for (bus, rate, engines), points in sorted(results.items()):
        steps = median(points, "steps_per_s")
        rows.append(
            [bus, f"{rate:g}", str(engines), f"{steps:.1f} ({steps / rate:.0%})",
             f"{median(points, 'engine_cpu'):.2f}", f"{median(points, 'cpu_us_per_step'):.0f}",
             f"{median(points, 'core_per_engine') * 100:.2f}",
             f"{median(points, 'kv_per_s'):.1f} + {median(points, 'load_per_s'):.1f}",
             f"{1 / max(median(points, 'core_per_engine'), 1e-9):.0f}",
             f"{median(points, 'machine_cpu'):.2f}"]
        )  # fmt: skip
    table(
        ["bus", "target steps/s", "engines", "steps/s per engine (of target)",
         "process CPU", "CPU µs per engine-step", "% of a core per engine",
         "kv batches + load records /s per engine", "engines per core (CPU)", "machine CPU"],
        rows,
    )  # fmt: skip
    print("Engines one core carries (one process):\n")
    rows = []
    for bus in dict.fromkeys(k[0] for k in results):
        for rate in sorted({k[1] for k in results if k[0] == bus}):
            keys = sorted(k for k in results if k[:2] == (bus, rate))
            # within 5% of one engine alone (the sim's step also waits out its own
            # end_step, so even one engine misses the nominal rate by a little)
            alone = median(results[keys[0]], "steps_per_s") if keys[0][2] == 1 else rate
            kept = [k for k in keys if median(results[k], "steps_per_s") >= 0.95 * alone]
            # the largest K that kept the rate: one engine alone pays its fixed costs
            # (heartbeats, idle loops) over few steps
            most = results[kept[-1]] if kept else None
            rows.append(
                [bus, f"{rate:g}", str(kept[-1][2] if kept else 0),
                 f"{max((k[2] for k in keys), default=0)}",
                 f"{1 / median(most, 'core_per_engine'):.0f}" if most else "n/a",
                 f"{median(most, 'cpu_us_per_step'):.0f}" if most else "n/a"]
            )  # fmt: skip
    table(
        ["bus", "steps/s", "most engines at >= 95% of one engine's rate", "largest K tried",
         "engines per core from CPU (at that K)", "CPU µs per engine-step (at that K)"],
        rows,
    )  # fmt: skip


def fleet_table(
    points: list[Point], sweep: dict[tuple[str, float, int], list[Point]], args: Any
) -> None:
    print(f"\nThe fleet with a router, medians of {len(points)} run(s)\n")
    m = {f: median(points, f) for f in Point.__struct_fields__ if f not in ("bus", "router")}
    r = {f: routed_median(points, f) for f in RouterReport.__struct_fields__}
    engines, rate = m["engines"], m["rate"]
    kv_rate = m["kv_per_s"] * engines
    load_rate = m["load_per_s"] * engines
    table(
        ["fleet", "steps/s per engine (of target)", "kv batches + load records /s", "applied",
         "lag p50 ms", "lag p99 ms", "route p50 µs", "route p99 µs", "queries with a prefix hit",
         "eligible workers", "lost", "dropped", "engines CPU", "nats CPU", "router CPU",
         "router RSS MiB", "machine CPU"],
        [[f"{engines:.0f} x {rate:g} steps/s in {m['processes']:.0f} processes",
          f"{m['steps_per_s']:.2f} ({m['steps_per_s'] / rate:.0%})",
          f"{kv_rate:,.0f} + {load_rate:,.0f}",
          f"{r['applied'] / args.fleet_seconds:,.0f}/s of {kv_rate:,.0f}/s",
          f"{r['lag_p50'] * 1e3:.1f}",
          f"{r['lag_p99'] * 1e3:.1f}", f"{r['route_p50'] * 1e6:.0f}",
          f"{r['route_p99'] * 1e6:.0f}", f"{r['matched']:.0f}/{r['routes']:.0f}",
          f"{r['workers']:.0f}", f"{r['lost']:.0f}", f"{m['dropped']:.0f}",
          f"{m['engine_cpu']:.2f}", f"{m['nats_cpu']:.2f}", f"{m['router_cpu']:.2f}",
          f"{r['rss_mib']:.0f}", f"{m['machine_cpu']:.2f}"]],
    )  # fmt: skip
    print(
        f"Per engine: {m['threads'] / engines:.1f} threads, {m['fds'] / engines:.1f} open files, "
        f"{m['rss_mib'] / engines:.1f} MiB RSS, set-up {m['setup_ms']:.0f} ms "
        f"(one process's engines, one after another)\n"
    )
    # Linear in steps/s, as the issue asks: each side's CPU per engine-step (engines) or
    # per message (nats-server, router less its route() queries) at this point, times a
    # fleet of 1,000 at the rate; kv batches per step as here, load records at the stat
    # logger's busy rate (one per 0.25 s, fewer when steps are rarer); or, better, the
    # messages per engine-second of part 1's engines at that rate, whose caches are in
    # steady state (a fleet at a fraction of a step per second is still in its first
    # prefills: a batch per step). The engine side also from part 1's points at that
    # rate (few engines per process).
    steps = m["steps_per_s"] * engines
    engine_step = m["engine_cpu"] / steps
    messages = kv_rate + load_rate
    nats_message = m["nats_cpu"] / messages
    router_message = max(0.0, m["router_cpu"] - r["route_seconds"] / args.fleet_seconds) / messages
    kv_per_step = kv_rate / steps
    rows = []
    for target in (m["steps_per_s"], 20.0, 100.0):
        load = min(4.0, max(load_rate / engines, target))
        production = 1000 * (kv_per_step * target + load)
        few = sorted((k, p) for k, p in sweep.items() if k[:2] == ("nats", target))
        alone = median(few[0][1], "steps_per_s") if few and few[0][0][2] == 1 else target
        kept = [ps for _, ps in few if median(ps, "steps_per_s") >= 0.95 * alone]
        if kept:  # part 1's engines at the rate, in steady state (this fleet's are young)
            per_engine = median(kept[-1], "kv_per_s") + median(kept[-1], "load_per_s")
            production = 1000 * per_engine
        from_sweep = f"{median(kept[-1], 'core_per_engine') * 1000:.1f}" if kept else ""
        rows.append(
            [f"{target:.3g}" + (" (measured)" if target == m["steps_per_s"] else ""),
             f"{production:,.0f}",
             f"{engine_step * 1000 * target:.1f}" if target == m["steps_per_s"] else "",
             from_sweep,
             f"{nats_message * production:.2f}", f"{router_message * production:.2f}"]
        )  # fmt: skip
    print(
        f"Per message: nats-server {nats_message * 1e6:.0f} µs, router "
        f"{router_message * 1e6:.0f} µs (less route()); engines {engine_step * 1e6:.0f} µs "
        f"per engine-step. Per 1,000 engines, linear in the rate:\n"
    )
    table(
        ["steps/s per engine", "messages/s per 1,000 engines",
         "engine-side cores (this fleet)",
         "engine-side cores (part 1, largest K at >= 95% of one engine's rate)",
         "nats-server cores", "router cores"],
        rows,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep", default="20:1,20,40,80;100:1,4,8,16",
        help="RATE:K,K,...;...: engines in one process at each rate",
    )  # fmt: skip
    parser.add_argument("--buses", default="none,nats", help="none (no publishers), memory, nats")
    parser.add_argument("--fleet", type=int, default=1000, help="engines in part 2 (0: skip)")
    parser.add_argument("--fleet-rate", type=float, default=0.5, help="steps/s per engine")
    parser.add_argument("--processes", type=int, default=2, help="engine processes in part 2")
    parser.add_argument("--fleet-seconds", type=float, default=20.0)
    parser.add_argument("--running", type=int, default=32, help="requests in flight per engine")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prefixes", type=int, default=64, help="shared prompt prefixes")
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--qps", type=float, default=100.0, help="route() queries/s")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window (sweep)")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--drain", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args()
    if args.quick:
        args.sweep, args.buses, args.repeats = "20:1,10;100:2", "none,nats", 1
        args.fleet, args.fleet_seconds, args.seconds, args.warmup = 40, 8.0, 3.0, 1.5
    sweep = {
        float(rate): [int(k) for k in ks.split(",")]
        for rate, ks in (part.split(":") for part in args.sweep.split(";") if part)
    }
    print(
        f"kvbus sim engines: {args.running} requests in flight each (prompts {PREFIX_TOKENS} "
        f"shared of {args.prefixes} prefixes + {OWN_TOKENS} own tokens, {args.max_tokens} out), "
        f"{args.kv_blocks} blocks of {args.block_size}; window {args.seconds:g} s after "
        f"{args.warmup:g} s; {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the start.",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        from examples.cluster import make_model

        model = Path(tmp) / "model"
        make_model(model)
        server = _DefaultSyncNats(Path(tmp))
        server.start()
        assert server.process is not None
        nats_pid = server.process.pid
        url = server.url + "?max_age=120"
        try:
            results: dict[tuple[str, float, int], list[Point]] = {}
            for repeat in range(args.repeats):
                for bus in args.buses.split(","):
                    for rate, counts in sweep.items():
                        for engines in counts:
                            tag = f"{bus}{rate:g}x{engines}r{repeat}".replace(".", "_")
                            urls = {"none": None, "nats": url, "memory": f"memory://{tag}"}
                            spec = Spec(
                                str(model), urls[bus], f"kv{tag}",
                                f"metrics{tag}", rate, args.running, args.max_tokens,
                                args.prefixes, args.kv_blocks, args.block_size,
                            )  # fmt: skip
                            point = measure(spec, engines, 1, args, nats_pid, router=False)
                            results.setdefault((bus, rate, engines), []).append(point)
                            print(
                                f"  {bus} {rate:g} steps/s x {engines}: "
                                f"{point.steps_per_s:.1f} steps/s, process CPU "
                                f"{point.engine_cpu:.2f}, {point.cpu_us_per_step:.0f} µs/step, "
                                f"machine CPU {point.machine_cpu:.2f}",
                                flush=True,
                            )
            sweep_tables(results, args)
            fleet: list[Point] = []
            # at low rates an engine's first steps come seconds after its start
            seconds, args.seconds = args.seconds, args.fleet_seconds
            args.warmup = max(args.warmup, 2 / args.fleet_rate)
            for repeat in range(args.repeats if args.fleet else 0):
                tag = f"fleet{repeat}"
                spec = Spec(
                    str(model), url, f"kv{tag}", f"metrics{tag}", args.fleet_rate,
                    args.running, args.max_tokens, args.prefixes, args.kv_blocks,
                    args.block_size,
                )  # fmt: skip
                began = time.perf_counter()
                point = measure(spec, args.fleet, args.processes, args, nats_pid, router=True)
                fleet.append(point)
                assert point.router is not None
                print(
                    f"  fleet {args.fleet} x {args.fleet_rate:g}: {point.steps_per_s:.2f} "
                    f"steps/s, lag p99 {point.router.lag_p99 * 1e3:.1f} ms, route p99 "
                    f"{point.router.route_p99 * 1e6:.0f} µs, machine CPU "
                    f"{point.machine_cpu:.2f}, run {time.perf_counter() - began:.0f} s",
                    flush=True,
                )
            args.seconds = seconds
            if fleet:
                fleet_table(fleet, results, args)
        finally:
            with contextlib.suppress(Exception):
                server.stop()


if __name__ == "__main__":
    main()
