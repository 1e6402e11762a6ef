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
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from cluster import NatsServer, RouterProcess, VllmServer, kv_steps, make_model
from cluster import post_json as post

COUNTS = "{} requests, {} wrong, {} late, {} unexplained"


def busy() -> None:
    while True:
        start = time.time()
        while time.time() - start < 0.05:
            pass
        time.sleep(0.02)


def one_round(engine: VllmServer, router: RouterProcess, seed: int) -> list[tuple[int, int, bool]]:
    """(predicted, reported, late) of each request of the test's workload."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as response:
        found = re.search(r'block_size="(\d+)"', response.read().decode())
    assert found is not None
    block = int(found.group(1))
    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(count))

    systems = [words(3 * block) for _ in range(2)]
    conversations = [f"{systems[c % 2]} {words(block + 8)}" for c in range(4)]
    sent: list[tuple[float, str, int, int, int]] = []
    for _turn in range(4):
        for c in rng.sample(range(4), 4):
            sibling = f"{systems[c % 2]} {words(rng.randrange(block + 8, 2 * block))}"
            for kind, prompt in (("turn", conversations[c]), ("sibling", sibling)):
                body = {"model": str(engine.model), "prompt": prompt, "max_tokens": 4,
                        "ignore_eos": True, "temperature": 0.0}  # fmt: skip
                at = time.time()
                status, headers, answer = post(f"{router.url}/v1/completions", body)
                assert status == 200, answer
                reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted = int(headers["x-kvbus-predicted-cached-tokens"])
                seq = int(headers["x-kvbus-kv-seq"])
                sent.append((at, headers["x-kvbus-worker"], seq, predicted, reported))
                if kind == "turn":
                    conversations[c] = f"{prompt} {answer['choices'][0]['text']} {words(block + 8)}"
    time.sleep(1.0)  # the last batches onto the stream
    steps = kv_steps(router.kvbus_url, sent[0][1])
    return [
        (p, r, any(s > seq and ts < at for s, ts in steps)) for at, _, seq, p, r in sent
    ]  # fmt: skip


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
                seen = one_round(engine, router, args.seed)
            finally:
                router.stop()
                engine.stop()
            wrong = [(p, r, late) for p, r, late in seen if p != r]
            row = [len(seen), len(wrong), sum(late for *_, late in wrong)]
            row.append(row[1] - row[2])
            totals = [t + v for t, v in zip(totals, row, strict=True)]
            print(f"round {n}: " + COUNTS.format(*row), flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
        nats.stop()
        subprocess.run(["rm", "-rf", str(base)], check=False)
    print(
        f"total: {totals[0]} requests, {totals[1]} wrong, {totals[2]} late, {totals[3]} unexplained"
    )
    return 1 if totals[3] else 0


if __name__ == "__main__":
    sys.exit(main())
