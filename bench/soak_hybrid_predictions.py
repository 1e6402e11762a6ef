"""Soak: the router's predictions on a real hybrid vLLM CPU engine, round after round,
on a loaded machine (tests/test_router_window.py's workload, a fresh engine and router
each round).

Each round sends 32 requests one at a time (conversations' turns and siblings sharing
their system prompt only) and compares each ``x-kvbus-predicted-cached-tokens`` with the
engine's ``cached_tokens``. A wrong prediction is *late* when the engine had published a
kv batch before the request was sent that the router had not applied when it routed it
(``x-kvbus-kv-seq``): its events were still on their way. Any other wrong prediction is
*unexplained*: the router had every event and still predicted wrong, which is a bug.

``--load N`` runs N busy loops (70% of a core each) beside it, as a full CI run loads
this 2-core machine. Prints a row per round and the totals.

Run: python bench/soak_hybrid_predictions.py [--rounds 10] [--model linear|window] [--load 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from cluster import NatsServer, RouterProcess, VllmServer, hybrid_conversations, make_model

COUNTS = "{} requests, {} wrong, {} late, {} unexplained"


def busy() -> None:
    while True:
        start = time.time()
        while time.time() - start < 0.05:
            pass
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--model", choices=["linear", "window"], default="linear")
    parser.add_argument("--load", type=int, default=2, help="busy loops beside it")
    parser.add_argument("--seed", type=int, default=5, help="the test's workload: 5")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    base = Path(tempfile.mkdtemp(prefix="kvbus-soak-"))
    (base / "nats").mkdir()
    nats = NatsServer(base / "nats")
    nats.start()
    model = base / "model"
    model.mkdir()
    if args.model == "linear":
        make_model(model, linear_attention=True)
    else:
        make_model(model, sliding_window=64)
    for hog in hogs:
        hog.start()
    totals = [0, 0, 0, 0]
    print(
        f"{args.model} model, {args.load} busy loops; per round: requests, wrong, late, unexplained"
    )
    try:
        for n in range(args.rounds):
            directory = base / f"r{n}"
            directory.mkdir()
            engine = VllmServer(directory, model, f"{args.model}{n}", nats.url,
                                blocks=40 if args.model == "linear" else 80)  # fmt: skip
            router = RouterProcess(directory, {engine.source: engine.url}, "kv", nats.url)
            engine.launch()
            try:
                engine.wait_healthy(300)
                router.launch()
                router.wait_ready(1, timeout=60)
                seen = hybrid_conversations(engine, router, args.seed)
            finally:
                router.stop()
                engine.stop()
            wrong = [s for s in seen if s.predicted != s.reported]
            row = [len(seen), len(wrong), sum(s.late for s in wrong)]
            row.append(row[1] - row[2])
            totals = [t + v for t, v in zip(totals, row, strict=True)]
            print(f"round {n}: " + COUNTS.format(*row), flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
        nats.stop()
        shutil.rmtree(base, ignore_errors=True)
    print("total: " + COUNTS.format(*totals))
    return 1 if totals[3] else 0


if __name__ == "__main__":
    sys.exit(main())
