"""Core benchmarks, each beside its baseline in the same run (print a table).

1. Engine-thread cost of publish() for one 16-block KVEventBatch: kvbus
   ``Publisher.publish`` (engine bytes, and the batch object the vLLM plugin hands over)
   vs vLLM's own ``ZmqEventPublisher.publish``. Calls are paced like engine steps
   (``--gap-us`` apart) so each one finds the sender idle, the case that costs a wake-up.
2. The engine process's whole CPU per batch at engine pacing (``--pace`` batches/s,
   every thread: publish(), the sender thread, its event loop and wake-ups), kvbus on
   memory:// now and at ``--against`` (a git revision) vs vLLM's ZmqEventPublisher, whose
   own thread sends each batch as it comes.
3. End-to-end batches/s: kvbus Publisher -> memory:// -> ``kvbus.subscribe()`` (ordered,
   deduplicated, decoded) vs vLLM's ZmqEventPublisher -> SUB socket -> msgspec decode.

Run: python bench/bench_core.py [--repeats 5]   (needs vllm for the baselines)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import subprocess
import time
import types
from pathlib import Path
from typing import Any

import msgspec

import kvbus
from kvbus._moved import MOVED
from kvbus.wire.events import BlockStored, KVEventBatch, encode


def module_at(revision: str, path: str) -> types.ModuleType:
    """The module in file ``path`` of this repository as of git ``revision``, the rest of
    kvbus as now: a before/after row in the same run, on the same noise."""
    repo = str(Path(__file__).resolve().parents[1])
    shown = subprocess.run(
        ["git", "-C", repo, "show", f"{revision}:{path}"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        # A revision from before the subpackages (kvbus 0.2): the module's flat path.
        # Its imports of other moved modules resolve through kvbus._moved's old names;
        # ``kvbus.subscribe`` is the function there, so its module is named anew.
        new = path.removesuffix(".py").replace("/", ".")
        old = {moved: was for was, moved in MOVED.items()}.get(new, new)
        path = old.replace(".", "/") + ".py"
        shown = subprocess.run(
            ["git", "-C", repo, "show", f"{revision}:{path}"],
            capture_output=True,
            text=True,
            check=True,
        )
    source = shown.stdout.replace(
        "from kvbus.subscribe import", "from kvbus.bus.subscription import"
    )
    module = types.ModuleType(f"{Path(path).stem}_at_{revision}")
    exec(compile(source, f"{revision}:{path}", "exec"), module.__dict__)
    return module


VOCAB = 128_256
"""Token ids are drawn below Llama 3's vocabulary size. Before 2026-11-23 they were
``range(256)``: one-byte msgpack ints that Python caches, which made every decode look
cheaper than it is on real prompts (ids mostly take 3 bytes and a fresh int each)."""


def tokens256(i: int) -> list[int]:
    """256 token ids of step ``i``, spread over `VOCAB` (a multiplicative hash)."""
    return [(i * 256 + t) * 0x9E3779B1 % VOCAB for t in range(256)]


def batch16(i: int) -> KVEventBatch:
    """One engine step storing 16 blocks of 16 tokens (vLLM's event shape)."""
    hashes: list[int | bytes] = [(i * 16 + b) * 0x9E3779B97F4A7C15 % 2**64 for b in range(16)]
    return KVEventBatch(
        time.time(), [BlockStored(hashes, None, tokens256(i), 16, None, "GPU", None)], 0
    )


def vllm_batch16(i: int) -> Any:
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch as VBatch

    hashes = [(i * 16 + b) * 0x9E3779B97F4A7C15 % 2**64 for b in range(16)]
    stored = VStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens256(i),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return VBatch(ts=time.time(), events=[stored], data_parallel_rank=0)


def pace(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def time_calls(publish: Any, items: list[Any], gap: float) -> list[float]:
    costs = []
    for item in items:
        start = time.perf_counter_ns()
        publish(item)
        costs.append(time.perf_counter_ns() - start)
        pace(gap)
    return costs


def publish_cost(n: int, gap: float) -> dict[str, list[float]]:
    from vllm.distributed.kv_events import ZmqEventPublisher

    payloads = [encode(batch16(i)) for i in range(n)]
    structs = [batch16(i) for i in range(n)]
    vllm_batches = [vllm_batch16(i) for i in range(n)]
    url = f"memory://bench-publish-{time.monotonic_ns()}"
    out: dict[str, list[float]] = {}
    with kvbus.Publisher(url, source="bench", max_queue=n + 10) as pub:
        out["kvbus publish(bytes)"] = time_calls(pub.publish, payloads, gap)
    with kvbus.Publisher(url, source="bench2", max_queue=n + 10) as pub:
        out["kvbus publish(KVEventBatch)"] = time_calls(pub.publish, structs, gap)
    vllm_pub = ZmqEventPublisher(0, endpoint=f"inproc://bench-{time.monotonic_ns()}")
    out["vLLM ZmqEventPublisher.publish"] = time_calls(vllm_pub.publish, vllm_batches, gap)
    vllm_pub.shutdown()
    return out


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def paced_cpu(publish: Any, items: list[Any], rate: float, flush: Any = None) -> float:
    """Microseconds of this process's CPU per ``publish(item)`` called ``rate`` times a
    second (sleeping in between, as an engine between steps), minus what the same
    pacing costs with no publisher."""

    def run(call: Any) -> float:
        began, cpu = time.perf_counter(), process_cpu()
        for i, item in enumerate(items):
            call(item)
            ahead = began + (i + 1) / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
        if flush is not None:
            flush()
        return (process_cpu() - cpu) / len(items) * 1e6

    return run(publish) - run(lambda _: None)


def paced_publishing_cpu(n: int, rate: float, against: str) -> dict[str, float]:
    from vllm.distributed.kv_events import ZmqEventPublisher

    payloads = [encode(batch16(i)) for i in range(n)]
    url = f"memory://bench-paced-{time.monotonic_ns()}"
    out: dict[str, float] = {}
    with kvbus.Publisher(url, source="paced") as pub:
        out["kvbus Publisher, memory://"] = paced_cpu(pub.publish, payloads, rate, pub.flush)
    if against:
        before = module_at(against, "kvbus/bus/publisher.py").Publisher
        with before(url, source="paced-before") as pub:
            name = f"kvbus Publisher at {against}, memory://"
            out[name] = paced_cpu(pub.publish, payloads, rate, pub.flush)
    vllm_pub = ZmqEventPublisher(0, endpoint=f"inproc://bench-paced-{time.monotonic_ns()}")
    batches = [vllm_batch16(i) for i in range(n)]
    out["vLLM ZmqEventPublisher (baseline)"] = paced_cpu(vllm_pub.publish, batches, rate)
    vllm_pub.shutdown()
    return out


async def kvbus_end_to_end(n: int) -> float:
    url = f"memory://bench-e2e-{time.monotonic_ns()}"
    payloads = [encode(batch16(i)) for i in range(n)]
    start = time.perf_counter()
    received = 0
    async with kvbus.subscribe(url=url) as sub:
        with kvbus.Publisher(url, source="bench", max_queue=n + 10) as pub:
            for p in payloads:
                pub.publish(p)
            async for item in sub:
                if isinstance(item, kvbus.Message) and item.kind is kvbus.Kind.KV:
                    received += 1
                    if received == n:
                        break
    return n / (time.perf_counter() - start)


def vllm_end_to_end(n: int, bind: str = "", connect: str = "") -> float:
    """vLLM's ZmqEventPublisher on ``bind`` (default: inproc) -> SUB on ``connect``."""
    import zmq
    from vllm.distributed.kv_events import KVEventBatch as VBatch
    from vllm.distributed.kv_events import ZmqEventPublisher

    bind = bind or f"inproc://bench-e2e-{time.monotonic_ns()}"
    publisher = ZmqEventPublisher(0, endpoint=bind, hwm=n + 10, max_queue_size=n + 10)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, n + 10)
    sub.connect(connect or bind)
    time.sleep(0.2)  # slow-joiner: let the subscription reach the PUB socket
    decoder = msgspec.msgpack.Decoder(VBatch)
    batches = [vllm_batch16(i) for i in range(n)]
    start = time.perf_counter()
    for b in batches:
        publisher.publish(b)
    for _ in range(n):
        _topic, _seq, payload = sub.recv_multipart()
        decoder.decode(payload)
    rate = n / (time.perf_counter() - start)
    sub.close(linger=0)
    publisher.shutdown()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--gap-us", type=float, default=200.0)
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pace", type=float, default=200.0, help="batches/s, paced CPU")
    parser.add_argument("--paced", type=int, default=1000, help="batches per paced run")
    parser.add_argument("--against", default="", help="git revision for a 'before' row")
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"
    )

    medians: dict[str, list[float]] = {}
    p99s: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, costs in publish_cost(args.calls, args.gap_us / 1e6).items():
            costs.sort()
            medians.setdefault(name, []).append(costs[len(costs) // 2] / 1000)
            p99s.setdefault(name, []).append(costs[int(len(costs) * 0.99)] / 1000)
    base = statistics.median(medians["vLLM ZmqEventPublisher.publish"])
    print(
        f"\npublish() on the engine thread, one 16-block batch, {args.calls} calls "
        f"{args.gap_us:.0f} us apart, median of {args.repeats} runs"
    )
    print(f"{'publisher':34} {'median us':>10} {'p99 us':>8} {'vs vLLM':>8}")
    for name in medians:
        m = statistics.median(medians[name])
        print(f"{name:34} {m:10.2f} {statistics.median(p99s[name]):8.2f} {m / base:7.2f}x")

    paced: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, cost in paced_publishing_cpu(args.paced, args.pace, args.against).items():
            paced.setdefault(name, []).append(cost)
    base = statistics.median(paced["vLLM ZmqEventPublisher (baseline)"])
    print(
        f"\nthe engine process's CPU per 16-block batch, {args.paced} batches at "
        f"{args.pace:.0f}/s, every thread, median of {args.repeats} runs"
    )
    print(f"{'publisher':46} {'CPU us/batch':>12} {'vs vLLM':>8}")
    for name, costs in paced.items():
        m = statistics.median(costs)
        print(f"{name:46} {m:12.1f} {m / base:7.2f}x")

    kv_rates = [asyncio.run(kvbus_end_to_end(args.batches)) for _ in range(args.repeats)]
    vllm_rates = [vllm_end_to_end(args.batches) for _ in range(args.repeats)]
    kv, vl = statistics.median(kv_rates), statistics.median(vllm_rates)
    print(f"\nend to end, {args.batches} 16-block batches, median of {args.repeats} runs")
    print(f"{'path':52} {'batches/s':>10} {'ratio':>7}")
    print(f"{'vLLM ZmqEventPublisher -> SUB -> decode (baseline)':52} {vl:10.0f} {1.0:7.2f}")
    print(f"{'kvbus Publisher -> memory:// -> subscribe()':52} {kv:10.0f} {kv / vl:7.2f}")


if __name__ == "__main__":
    main()
