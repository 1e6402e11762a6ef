"""A simulated fleet: many engines publishing recorded vLLM event streams into one NATS
JetStream server and one router process; the router's event lag, decision latency,
memory and CPU, beside the same fleet read by a consumer that does not apply (the bus
alone), at each fleet size of a sweep.

What is real: nats-server (started here on a free loopback port, file storage, its
default sync policy), one `kvbus.Publisher` per engine for the kv stream and one per
engine for the metrics stream (each with its own sender thread, event loop and NATS
connection, as in an engine process), the engine's bytes (vLLM KV event batches recorded
from real engines, ``tests/data/vllm_streams.msgpack``: stores, evictions, a prefix-cache
reset, LoRA blocks), `kvbus.subscribe()` over both streams and `kvbus.routing.router.Router`
applying them in a process of its own, with ``route()`` queries on the same event loop
while the fleet publishes (what ``kvbus router``'s follow loops and handlers do).

What is simulated: the engines. Each replays the 48 recorded batches in a loop at its
own rate (spread evenly over ``--rate-min``..``--rate-max`` batches/s, random phase),
several engines per publisher process, paced by one thread per process; its content is
one of ``engines / --share`` variants of the recording (token ids and block hashes
shifted per variant), so each prefix is held by ``--share`` engines, like a tenant's
prompts on a few replicas. Each engine also publishes a `LoadMetrics` every
``--metrics-interval`` s (the stat logger's rate while the engine is busy). The engine's
step is absent: only ``publish()`` runs where the engine would.

Figures per fleet size, for the router and for the baseline consumer (same streams,
same subscription, nothing applied, no queries):

- event lag: publish() (the envelope's timestamp) to applied in the router's index, for
  kv batches published in the measured window (p50, p99; batches not applied by the
  end of the drain count as lost);
- decision: ``Router.route()`` wall time for queries of recorded prompts (a variant held
  by some engines), ``--qps`` of them, issued on the router's loop while it applies;
- RSS of the consumer process (now and peak), CPU seconds per second of the consumer,
  of the publisher processes and of nats-server (from /proc), and those per 1,000
  engines;
- messages/s offered (the fleet's rates), published (publish() calls) and applied, the
  pacer's lateness (a publisher process that cannot keep its schedule), drops
  (publishers' counters) and losses the subscriber announced (Resync with seqs lost).

Run: python bench/bench_fleet.py [--points 20@1,100@0.2,300@0.067,1000@0.02,100@0.5]
     [--seconds 15] [--repeats 3]   (ENGINES@SCALE: production rates times SCALE)
     python bench/bench_fleet.py --quick   (smoke run, under a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbus
from kvbus.routing.router import Router
from kvbus.wire.events import LoadMetrics

REPO = Path(__file__).resolve().parents[1]
STREAMS = REPO / "tests/data/vllm_streams.msgpack"
BLOCK = 32  # the recorded engines' block size
VOCAB = 1024  # the recorded model's vocabulary: variant v shifts token ids by v * VOCAB
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HEARTBEAT = 2.0  # the stat logger's idle heartbeat (KVBUS_METRICS_HEARTBEAT)


# --- the recorded streams and their variants ---------------------------------------------


def recorded() -> tuple[list[Any], list[list[int]]]:
    """The recorded engines' batches (decoded wire form: [ts, events, dp_rank]) in
    recording order, and the prompts they served."""
    data = msgspec.msgpack.decode(STREAMS.read_bytes())
    runs = [data["runs"][name] for name in ("a", "b")]
    batches = [msgspec.msgpack.decode(p) for run in runs for p in run["payloads"]]
    prompts = [step["tokens"] for run in runs for step in run["steps"] if "tokens" in step]
    return batches, prompts


def _salt(variant: int) -> int:
    return random.Random(variant).getrandbits(64)


def variant_payloads(batches: list[Any], variant: int) -> list[bytes]:
    """The recording as engine ``variant`` publishes it: the same events, its own token
    ids and block hashes (consistently, so its removals name its stores)."""
    salt = _salt(variant)
    payloads = []
    for ts, events, rank in batches:
        changed = []
        for event in events:
            event = dict(event)
            if "block_hashes" in event:
                event["block_hashes"] = [h ^ salt for h in event["block_hashes"]]
            if event.get("parent_block_hash") is not None:
                event["parent_block_hash"] ^= salt
            if event.get("token_ids"):
                event["token_ids"] = [t + variant * VOCAB for t in event["token_ids"]]
            changed.append(event)
        payloads.append(msgspec.msgpack.encode([ts, changed, rank]))
    return payloads


def variant_prompt(prompt: list[int], variant: int) -> list[int]:
    return [t + variant * VOCAB for t in prompt]


# --- /proc ----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine used so far (others' included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def memory_mib(field: str) -> float:
    """VmRSS or VmHWM (peak RSS) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


# --- the engines ------------------------------------------------------------------------------


class FleetSpec(msgspec.Struct, frozen=True):
    url: str
    kv_stream: str
    metrics_stream: str
    engines: int
    share: int
    rate_min: float
    rate_max: float
    scale: float
    """production rates times this: the simulation's time dilation"""
    metrics_interval: float

    def source(self, engine: int) -> str:
        return f"engine-{engine:04d}/dp0"

    def rate(self, engine: int) -> float:
        """Batches/s of ``engine``: evenly spread over the range."""
        spread = engine / max(1, self.engines - 1)
        return (self.rate_min + (self.rate_max - self.rate_min) * spread) * self.scale

    @property
    def load_interval(self) -> float:
        """Seconds between an engine's load records: the busy rate, dilated like the
        batches, but at least the stat logger's heartbeat (2 s), as in production."""
        return min(HEARTBEAT, self.metrics_interval / self.scale)

    def variant(self, engine: int) -> int:
        return engine % max(1, self.engines // self.share)

    def offered(self) -> tuple[float, float]:
        """kv batches/s and metrics records/s the whole fleet publishes."""
        kv = sum(self.rate(e) for e in range(self.engines))
        return kv, self.engines / self.load_interval


class PublisherReport(msgspec.Struct):
    published: int = 0
    """kv batches published in the measured window (accepted by publish())"""
    history: int = 0
    """kv batches accepted over the whole run"""
    metrics: int = 0
    dropped: int = 0
    """all Publishers' drop counters at the end"""
    late_p99: float = 0.0
    """seconds the pacer published a window batch after it was due (p99)"""


def run_engines(spec: FleetSpec, engines: list[int], control: Connection) -> None:
    """A publisher process: real Publishers for ``engines``, paced by this thread."""
    batches, _ = recorded()
    variants = {spec.variant(e) for e in engines}
    payloads = {v: variant_payloads(batches, v) for v in variants}

    def publishers(stream: str) -> dict[int, kvbus.Publisher]:
        # one per engine and stream, as the event publisher and the stat logger have
        return {e: kvbus.Publisher(spec.url, stream=stream, source=spec.source(e)) for e in engines}

    kv, load = publishers(spec.kv_stream), publishers(spec.metrics_stream)
    for publisher in [*kv.values(), *load.values()]:
        publisher.flush(120)  # connected, streams created
    control.send("ready")
    start, window_start, end = control.recv()
    rng = random.Random(engines[0])
    # (due, engine, kind): kind 0 a kv batch, 1 a load record
    due: list[tuple[float, int, int]] = []
    for e in engines:
        due.append((start + rng.random() / spec.rate(e), e, 0))
        due.append((start + rng.random() * spec.load_interval, e, 1))
    heapq.heapify(due)
    position = dict.fromkeys(engines, 0)
    report = PublisherReport()
    late: list[float] = []
    while True:
        when, e, kind = due[0]
        if when >= end:
            break
        now = time.time()
        if when - now > 0.001:
            time.sleep(when - now)
            continue
        if kind == 0:
            batch = payloads[spec.variant(e)][position[e] % len(batches)]
            position[e] += 1
            accepted = kv[e].publish(batch)
            report.history += accepted
            if window_start <= now < end:  # by publish time, as the consumer counts
                report.published += accepted
                late.append(now - when)
            heapq.heapreplace(due, (when + 1 / spec.rate(e), e, 0))
        else:
            busy = rng.randrange(1, 9)
            record = LoadMetrics(
                ts=now,
                running=busy,
                waiting=rng.randrange(0, 3),
                kv_cache_usage=rng.random(),
                kv_cache_blocks=BLOCK,
            )
            load[e].publish(record, kvbus.Kind.METRICS)
            report.metrics += when >= window_start
            heapq.heapreplace(due, (when + spec.load_interval, e, 1))
    report.late_p99 = float(np.percentile(late, 99)) if late else 0.0
    report.dropped = sum(p.stats.dropped for p in [*kv.values(), *load.values()])
    control.send(msgspec.msgpack.encode(report))
    control.recv()  # the consumer drained: close (SourceStopped) only now
    for publisher in [*kv.values(), *load.values()]:
        publisher.close(5)


# --- the router (or the baseline consumer) ------------------------------------------------------


class ConsumerReport(msgspec.Struct):
    applied: int = 0
    """kv batches of the window applied by the end of the drain"""
    lag_p50: float = 0.0
    lag_p99: float = 0.0
    metrics: int = 0
    routes: int = 0
    route_p50: float = 0.0
    route_p99: float = 0.0
    routed_with_prefix: int = 0
    """queries whose pick held some of the prompt"""
    workers: int = 0
    """workers eligible at the end"""
    resyncs: dict[str, int] = {}
    lost: int = 0
    """seqs the subscriber announced lost"""
    malformed: int = 0
    rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    stuck: int = 0
    """subscriptions still open 10 s after they were cancelled"""


def run_consumer(spec: FleetSpec, apply_index: bool, qps: float, control: Connection) -> None:
    asyncio.run(_consume(spec, apply_index, qps, control))
    os._exit(0)  # a subscription that would not close (reported) must not hold us


def _stop_reading(tasks: list[asyncio.Task[None]]) -> Any:
    """Cancel ``tasks``; at most 10 s for them to end (a NATS subscription stalled by a
    slow-consumer drop has been seen never to)."""
    for task in tasks:
        task.cancel()
    return asyncio.wait(tasks, timeout=10)


async def _consume(spec: FleetSpec, apply_index: bool, qps: float, control: Connection) -> None:
    router = Router(block_size=BLOCK)
    report = ConsumerReport()
    window = [float("inf"), float("inf")]
    lags: list[float] = []
    resyncs: Counter[str] = Counter()
    subscriptions: list[kvbus.Subscription] = []

    async def follow(stream: str, apply: Callable[[Any], None], kv: bool, **options: Any) -> None:
        sub = kvbus.subscribe(stream, spec.url, **options)
        subscriptions.append(sub)
        async with sub:
            async for item in sub:
                if apply_index:
                    apply(item)
                now = time.time()
                if isinstance(item, kvbus.Resync):
                    resyncs[item.reason.value] += 1
                    if item.lost:
                        report.lost += item.lost[1] - item.lost[0] + 1
                    continue
                if not window[0] <= item.ts < window[1]:
                    continue
                if not kv:
                    report.metrics += 1
                elif item.kind is kvbus.Kind.KV:
                    lags.append(now - item.ts)

    tasks = [
        asyncio.create_task(follow(spec.kv_stream, router.apply_kv, True)),
        # as kvbus router reads load records: state, a gap is not worth waiting for
        asyncio.create_task(
            follow(spec.metrics_stream, router.apply_metrics, False, gap_timeout=0)
        ),
    ]
    control.send("ready")
    _, window[0], window[1], drain_until = await asyncio.to_thread(control.recv)
    routes: list[float] = []
    if apply_index and qps > 0:
        _, prompts = recorded()
        rng = random.Random(1)
        variants = max(1, spec.engines // spec.share)
        await asyncio.sleep(max(0.0, window[0] - time.time()))
        while time.time() < window[1]:
            tokens = variant_prompt(rng.choice(prompts), rng.randrange(variants))
            began = time.perf_counter()
            decision = router.route(tokens)
            routes.append(time.perf_counter() - began)
            if decision is not None:
                report.routed_with_prefix += decision.matched_tokens > 0
                router.finished(decision)
            await asyncio.sleep(1 / qps)
    await asyncio.sleep(max(0.0, drain_until - time.time()))
    _, pending = await _stop_reading(tasks)
    report.stuck = len(pending)
    report.applied = len(lags)
    if lags:
        report.lag_p50, report.lag_p99 = (float(x) for x in np.percentile(lags, [50, 99]))
    report.routes = len(routes)
    if routes:
        report.route_p50, report.route_p99 = (float(x) for x in np.percentile(routes, [50, 99]))
    report.workers = len(router.eligible()) if apply_index else 0
    report.resyncs = dict(resyncs)
    report.malformed = sum(s.stats.malformed for s in subscriptions)
    report.rss_mib = memory_mib("VmRSS")
    report.peak_rss_mib = memory_mib("VmHWM")
    control.send(msgspec.msgpack.encode(report))


class ReplayReport(msgspec.Struct):
    batches: int
    complete: bool
    seconds: float
    cpu_seconds: float
    peak_rss_mib: float


def run_replay(spec: FleetSpec, apply_index: bool, seconds: float, control: Connection) -> None:
    asyncio.run(_replay(spec, apply_index, seconds, control))
    os._exit(0)


async def _replay(spec: FleetSpec, apply_index: bool, limit: float, control: Connection) -> None:
    """The kv stream's history read from its start (for at most ``limit`` seconds), as a
    (re)starting router reads it before it says ready."""
    router = Router(block_size=BLOCK)
    batches = 0
    cpu, began = time.process_time(), time.perf_counter()

    async def read() -> None:
        nonlocal batches
        async with kvbus.subscribe(spec.kv_stream, spec.url, follow=False) as sub:
            async for item in sub:
                if apply_index:
                    router.apply_kv(item)
                batches += isinstance(item, kvbus.Message) and item.kind is kvbus.Kind.KV

    reading = asyncio.create_task(read())
    done, _ = await asyncio.wait([reading], timeout=limit)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    report = ReplayReport(batches, bool(done), seconds, cpu, memory_mib("VmHWM"))
    control.send(msgspec.msgpack.encode(report))  # before a close that may not end
    await _stop_reading([reading])


# --- one measured run ----------------------------------------------------------------------------


class Point(msgspec.Struct):
    engines: int
    scale: float
    consumer: str
    offered_kv: float
    offered_metrics: float
    published_per_s: float
    applied_per_s: float
    load_applied_per_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    unapplied: int
    route_p50_us: float
    route_p99_us: float
    routes: int
    routed_with_prefix: int
    workers: int
    consumer_cpu: float
    """CPU seconds per second"""
    publishers_cpu: float
    nats_cpu: float
    machine_cpu: float
    rss_mib: float
    peak_rss_mib: float
    late_p99_ms: float
    dropped: int
    lost: int
    resyncs: dict[str, int]
    malformed: int
    replay_per_s: float
    replayed: int
    history: int
    replay_complete: int
    replay_cpu_us: float
    """consumer CPU µs per replayed batch"""
    stuck: int
    """subscriptions that did not close when cancelled"""
    setup_s: float


def spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    """A process running ``target(*args, pipe)``, and our end of the pipe."""
    ours, theirs = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=target, args=(*args, theirs))
    process.start()
    return process, ours


def measure(nats: tuple[str, int], engines: int, scale: float, args: Any, tag: str) -> list[Point]:
    """One fleet, followed by the router and the bus-only consumer side by side (the
    same traffic and the same machine noise for both); then each replays the history."""
    url, nats_pid = nats
    spec = FleetSpec(
        url + "?max_age=300",
        f"kv{tag}",
        f"metrics{tag}",
        engines,
        args.share,
        args.rate_min,
        args.rate_max,
        scale,
        args.metrics_interval,
    )
    setup = time.time()
    consumers = {index: spawn(run_consumer, spec, index, args.qps) for index in (True, False)}
    for _, pipe in consumers.values():
        assert pipe.recv() == "ready"
    processes = args.processes or min(40, max(2, engines // 25))
    groups = [list(range(engines))[i::processes] for i in range(processes)]
    publishers = [spawn(run_engines, spec, group) for group in groups if group]
    for _, pipe in publishers:
        assert pipe.recv() == "ready"
    setup_s = time.time() - setup
    start = time.time() + 0.5
    window_start, end = start + args.warmup, start + args.warmup + args.seconds
    for _, pipe in publishers:
        pipe.send((start, window_start, end))
    for _, pipe in consumers.values():
        pipe.send((start, window_start, end, end + args.drain))
    pids = {
        "router": [consumers[True][0].pid],
        "bus": [consumers[False][0].pid],
        "publishers": [p.pid for p, _ in publishers],
        "nats": [nats_pid],
    }

    def sample() -> dict[str, float]:
        used = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
        used["machine"] = machine_busy_seconds()
        return used

    time.sleep(max(0.0, window_start - time.time()))
    before = sample()
    time.sleep(max(0.0, end - time.time()))
    after = sample()
    cpu = {k: (after[k] - before[k]) / args.seconds for k in after}
    reports = [msgspec.msgpack.decode(pipe.recv(), type=PublisherReport) for _, pipe in publishers]
    followed = {
        index: msgspec.msgpack.decode(pipe.recv(), type=ConsumerReport)
        for index, (_, pipe) in consumers.items()
    }
    for process, _ in consumers.values():
        process.join(10)
        if process.is_alive():  # its stuck subscription keeps asyncio.run from ending
            process.kill()
    for _, pipe in publishers:
        pipe.send("close")
    for process, _ in publishers:
        process.join(60)
    offered_kv, offered_metrics = spec.offered()
    published = sum(r.published for r in reports)
    points = []
    for index, router in followed.items():
        replayer, pipe = spawn(run_replay, spec, index, args.replay_seconds)
        replay = msgspec.msgpack.decode(pipe.recv(), type=ReplayReport)
        replayer.join(10)
        if replayer.is_alive():
            replayer.kill()
        points.append(
            Point(
                engines=engines,
                scale=scale,
                consumer="router" if index else "bus only",
                offered_kv=offered_kv,
                offered_metrics=offered_metrics,
                published_per_s=published / args.seconds,
                applied_per_s=router.applied / args.seconds,
                load_applied_per_s=router.metrics / args.seconds,
                lag_p50_ms=router.lag_p50 * 1e3,
                lag_p99_ms=router.lag_p99 * 1e3,
                unapplied=published - router.applied,
                route_p50_us=router.route_p50 * 1e6,
                route_p99_us=router.route_p99 * 1e6,
                routes=router.routes,
                routed_with_prefix=router.routed_with_prefix,
                workers=router.workers,
                consumer_cpu=cpu["router" if index else "bus"],
                publishers_cpu=cpu["publishers"],
                nats_cpu=cpu["nats"],
                machine_cpu=cpu["machine"],
                rss_mib=router.rss_mib,
                peak_rss_mib=router.peak_rss_mib,
                late_p99_ms=max(r.late_p99 for r in reports) * 1e3,
                dropped=sum(r.dropped for r in reports),
                lost=router.lost,
                resyncs=router.resyncs,
                malformed=router.malformed,
                replay_per_s=replay.batches / replay.seconds,
                replayed=replay.batches,
                history=sum(r.history for r in reports),
                replay_complete=replay.complete,
                stuck=router.stuck,
                replay_cpu_us=replay.cpu_seconds / max(1, replay.batches) * 1e6,
                setup_s=setup_s,
            )
        )
    return points


# --- the tables -----------------------------------------------------------------------------------


def median_point(points: list[Point]) -> dict[str, Any]:
    """Each number's median over repeats; losses and Resyncs summed."""
    summed = {"dropped", "lost", "unapplied", "malformed", "replay_complete", "stuck"}
    out: dict[str, Any] = {}
    for field in Point.__struct_fields__:
        values = [getattr(p, field) for p in points]
        if field in summed:
            out[field] = sum(values)
        elif isinstance(values[0], (int, float)):
            out[field] = statistics.median(values)
        else:
            out[field] = values[0]
    resyncs: Counter[str] = Counter()
    for p in points:
        resyncs.update(p.resyncs)
    out["resyncs"] = dict(resyncs)
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("| --- |" + " ---: |" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def fleet(m: dict[str, Any], rate_min: float, rate_max: float) -> str:
    scale = m["scale"]
    return f"{m['engines']:.0f} x {rate_min * scale:g}-{rate_max * scale:g}/s"


def print_tables(results: dict[tuple[int, float, str], list[Point]], args: Any) -> None:
    medians = {key: median_point(points) for key, points in results.items()}
    keys = sorted(medians)
    print(f"\nmedians of {args.repeats} run(s); CPU in CPU-seconds per second\n")
    print("Live: the fleet publishing, the consumer following (router, or bus only):\n")
    table(
        ["fleet (engines x kv batches/s)", "consumer", "kv + load offered/s", "published/s",
         "applied/s", "lag p50 ms", "lag p99 ms", "unapplied", "dropped", "lost",
         "pacer late p99 ms", "machine CPU"],
        [
            [fleet(m, args.rate_min, args.rate_max), m["consumer"],
             f"{m['offered_kv']:,.0f} + {m['offered_metrics']:,.0f}",
             f"{m['published_per_s']:,.0f}", f"{m['applied_per_s']:,.0f}",
             f"{m['lag_p50_ms']:.1f}", f"{m['lag_p99_ms']:.1f}", str(m["unapplied"]),
             str(m["dropped"]), str(m["lost"]), f"{m['late_p99_ms']:.0f}",
             f"{m['machine_cpu']:.2f}"]
            for m in (medians[k] for k in keys)
        ],
    )  # fmt: skip
    print("The router, and per 1,000 engines (CPU scaled from this fleet's size):\n")
    rows = []
    for engines, scale, consumer in keys:
        if consumer != "router":
            continue
        r = medians[engines, scale, "router"]
        per_k = 1000 / engines
        per_message = max(r["applied_per_s"] + r["load_applied_per_s"], 1) / 1e6
        rows.append(
            [fleet(r, args.rate_min, args.rate_max), f"{r['route_p50_us']:.0f}",
             f"{r['route_p99_us']:.0f}", f"{r['routed_with_prefix']:.0f}/{r['routes']:.0f}",
             f"{r['workers']:.0f}", f"{r['rss_mib']:.0f} ({r['peak_rss_mib']:.0f})",
             f"{r['consumer_cpu']:.2f}", f"{r['consumer_cpu'] / per_message:.0f}",
             f"{r['consumer_cpu'] * per_k:.2f}", f"{r['publishers_cpu'] * per_k:.2f}",
             f"{r['nats_cpu'] * per_k:.2f}"]
        )  # fmt: skip
    table(
        ["fleet", "route p50 µs", "route p99 µs", "queries with a prefix hit", "eligible workers",
         "RSS MiB (peak)", "router CPU", "router CPU µs/message", "router CPU /1k engines",
         "publishers CPU /1k engines", "nats CPU /1k engines"],
        rows,
    )  # fmt: skip
    print("Router beside the bus-only consumer (ratios), and what the router can follow:\n")
    rows = []
    for engines, scale, consumer in keys:
        if consumer != "router" or (engines, scale, "bus only") not in medians:
            continue
        r, b = medians[engines, scale, "router"], medians[engines, scale, "bus only"]
        # messages/s of one production engine: its mean batch rate and busy load rate
        engine_rate = (args.rate_min + args.rate_max) / 2 + 1 / args.metrics_interval
        messages = r["applied_per_s"] + r["load_applied_per_s"]
        rows.append(
            [fleet(r, args.rate_min, args.rate_max), ratio(r["lag_p99_ms"], b["lag_p99_ms"]),
             ratio(r["consumer_cpu"], b["consumer_cpu"]),
             f"{r['replayed']:,.0f} / {b['replayed']:,.0f} of {r['history']:,.0f}",
             f"{r['replay_complete']} / {b['replay_complete']} of {args.repeats}",
             f"{r['replay_cpu_us']:.0f} / {b['replay_cpu_us']:.0f}",
             f"{messages / max(r['consumer_cpu'], 1e-9) / engine_rate:,.0f}"]
        )  # fmt: skip
    table(
        ["fleet", "lag p99 router/bus", "consumer CPU router/bus",
         f"history read in {args.replay_seconds:g} s, batches: router / bus of published",
         "reads complete: router / bus", "read CPU µs/batch router / bus",
         "production engines per router core (live CPU/message)"],
        rows,
    )  # fmt: skip
    seen = {f"{k[0]}x{k[1]:g} {k[2]}": m["resyncs"] for k, m in medians.items() if m["resyncs"]}
    print("Resyncs (all runs):", seen or "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--points",
        default="20@1,100@0.2,300@0.067,1000@0.02,100@0.5",
        help="ENGINES@SCALE,...: fleet sizes, each at the production rates times SCALE",
    )
    parser.add_argument("--rate-min", type=float, default=20.0, help="batches/s, slowest engine")
    parser.add_argument("--rate-max", type=float, default=100.0, help="batches/s, fastest engine")
    parser.add_argument("--metrics-interval", type=float, default=0.25, help="busy load records")
    parser.add_argument("--share", type=int, default=8, help="engines holding each variant")
    parser.add_argument(
        "--processes", type=int, default=0, help="publisher processes (0: one per 25 engines)"
    )
    parser.add_argument("--qps", type=float, default=100.0, help="route() queries per second")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--drain", type=float, default=3.0, help="seconds to apply the tail")
    parser.add_argument("--replay-seconds", type=float, default=8.0, help="history read")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: small and short")
    args = parser.parse_args()
    if args.quick:
        args.points, args.seconds, args.warmup, args.drain = "20@1,200@0.1", 3, 1, 1.5
        args.replay_seconds = 2
        args.repeats, args.processes = 1, 2
    points = [(int(e), float(s)) for e, s in (p.split("@") for p in args.points.split(","))]
    print(
        f"Fleet points {args.points} (engines@scale of {args.rate_min:g}-{args.rate_max:g} kv "
        f"batches/s per engine, recorded vLLM batches, {args.share} engines per variant, a "
        f"load record every {args.metrics_interval:g} s / scale, at most {HEARTBEAT:g} s); "
        f"{args.processes or 'one per 25 engines'} publisher processes; {args.qps:g} "
        f"route() queries/s; window "
        f"{args.seconds:g} s after {args.warmup:g} s; {os.cpu_count()} cores (shared)."
    )
    results: dict[tuple[int, float, str], list[Point]] = {}
    # Here, not at the top: bench_transports brings the test servers' clients (redis),
    # which the demo's install lacks, and bench_sim / bench_fleet_routing import this
    # module for its CPU counters alone.
    from bench.bench_transports import _DefaultSyncNats

    with tempfile.TemporaryDirectory() as tmp:
        server = _DefaultSyncNats(Path(tmp))
        server.start()
        assert server.process is not None
        nats = (server.url, server.process.pid)
        try:
            for engines, scale in points:
                for repeat in range(args.repeats):
                    tag = f"{engines}s{scale:g}r{repeat}".replace(".", "_")
                    for point in measure(nats, engines, scale, args, tag):
                        results.setdefault((engines, scale, point.consumer), []).append(point)
                        print(
                            f"  {engines}@{scale:g} {point.consumer}: applied "
                            f"{point.applied_per_s:,.0f}/s of {point.published_per_s:,.0f}/s, "
                            f"lag p99 {point.lag_p99_ms:.1f} ms, history read "
                            f"{point.replayed:,} of {point.history:,}, machine CPU "
                            f"{point.machine_cpu:.2f}, set-up {point.setup_s:.1f} s, "
                            f"subscriptions stuck at close {point.stuck}",
                            flush=True,
                        )
        finally:
            server.stop()
    print_tables(results, args)


if __name__ == "__main__":
    main()
