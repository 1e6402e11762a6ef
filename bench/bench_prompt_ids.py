"""What ``kvbus router --send-token-ids`` saves a real vLLM server: its API server's CPU
per completion, and the latency a client sees, with the prompt sent as text (the engine
tokenizes it) and as the token ids the router computed (it does not).

One vLLM CPU server of the tiny model (examples/cluster.py: a word-level tokenizer, so
its tokenizing is cheap next to a real model's BPE), NATS, and two kvbus routers in front
of it, one with ``--no-send-token-ids``. One sequential client sends, in turns, the same
``--requests`` prompts of ``--prompt-words`` tokens (each its own, so no prefix is
cached and the engine's prefill is the same for every arm), ``max_tokens`` 1, to:

* ``direct text``: the server, the prompt as text (the baseline);
* ``direct ids``: the server, the prompt as ids (what it costs the server untokenized);
* ``router text``: the router with ``--no-send-token-ids``;
* ``router ids``: the router as it runs by default (``--send-token-ids``).

The table shows, per arm, the median over ``--repeats`` of: the latency p50, the CPU
time of the vLLM API server process per request (the engine core is another process,
its work the same in every arm) and of the router's.

    python bench/bench_prompt_ids.py [--repeats 3] [--requests 60] [--prompt-words 1800]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from cluster import NatsServer, RouterProcess, VllmServer, make_model, post_json

ARMS = ("direct text", "direct ids", "router text", "router ids")


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process ``pid`` (its children not), in ns steps."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9


def post(url: str, body: dict[str, Any]) -> float:
    """Seconds from the send to the whole answer (a 200)."""
    began = time.perf_counter()
    status, _, answer = post_json(url, body)
    assert status == 200, answer
    return time.perf_counter() - began


def run_arm(
    arm: str,
    base: str,
    model: Path,
    prompts: list[list[int]],
    server: VllmServer,
    router: RouterProcess | None,
) -> tuple[float, float, float]:
    """Latency p50, the API server's and the router's CPU seconds per request, over
    ``prompts`` after the first three (a warm-up)."""
    pids = [p.process.pid for p in (server, router) if p is not None and p.process is not None]
    latencies: list[float] = []
    cpu = [0.0] * len(pids)
    for i, ids in enumerate(prompts):
        prompt: Any = ids if arm == "direct ids" else " ".join(f"w{t}" for t in ids)
        if i == 3:
            cpu = [cpu_seconds(pid) for pid in pids]
        latency = post(
            f"{base}/v1/completions", {"model": str(model), "prompt": prompt, "max_tokens": 1}
        )
        if i >= 3:
            latencies.append(latency)
    spent = [(cpu_seconds(pid) - c) / len(latencies) for pid, c in zip(pids, cpu, strict=True)]
    return statistics.median(latencies), spent[0], spent[1] if len(spent) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--prompt-words", type=int, default=1800)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvbus-prompt-ids-") as tmp:
        directory = Path(tmp)
        model = directory / "model"
        model.mkdir()
        make_model(model, 256, 2, args.prompt_words + 64)
        nats = NatsServer(directory)
        nats.start()
        server = VllmServer(directory, model, "a", nats.url, None, args.prompt_words + 64)
        server.launch()
        started: list[Any] = [server, nats]
        try:
            server.wait_healthy()
            workers = {server.source: server.url}
            text_router = RouterProcess(directory, workers, "kv", nats.url, ["--no-send-token-ids"])
            ids_router = RouterProcess(directory, workers, "kv", nats.url, ["--send-token-ids"])
            ids_router.name = "router-kv-ids"
            for router in (text_router, ids_router):
                router.launch()
                started.append(router)
            for router in (text_router, ids_router):
                router.wait_ready(1, timeout=120)
            assert "as token ids" in ids_router.log_tail(100_000)
            urls = {
                "direct text": server.url,
                "direct ids": server.url,
                "router text": text_router.url,
                "router ids": ids_router.url,
            }
            pids = {"router text": text_router, "router ids": ids_router}
            rows: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
            for repeat in range(args.repeats):
                for turn in range(len(ARMS)):
                    arm = ARMS[(turn + repeat) % len(ARMS)]
                    prompts = [
                        [rng.randrange(3, 1024) for _ in range(args.prompt_words)]
                        for _ in range(args.requests + 3)
                    ]
                    rows[arm].append(run_arm(arm, urls[arm], model, prompts, server, pids.get(arm)))
                print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
        finally:
            for process in reversed(started):
                process.stop()
    print("| arm | p50 ms | vLLM API server CPU µs/request | router CPU µs/request |")
    print("| --- | ---: | ---: | ---: |")
    for arm in ARMS:
        p50, engine, routed = (statistics.median(r[k] for r in rows[arm]) for k in range(3))
        shown = f"{routed * 1e6:,.0f}" if arm.startswith("router") else "-"
        print(f"| {arm} | {p50 * 1e3:.2f} | {engine * 1e6:,.0f} | {shown} |")


if __name__ == "__main__":
    main()
