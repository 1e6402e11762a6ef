"""Router replicas in processes of their own co-locating bursts (issue 28).

Two ``kvbus router`` replicas, each a process with a hash seed of its own, share one
nats-server in front of scripted workers (aiohttp stubs that answer after ``--hold``
seconds, standing in for a prefill: the request stays in flight meanwhile), each worker
sending its load on the metrics stream. Each burst is a new prompt (a long prefix no
worker holds) sent ``--burst`` times, ``--spacing`` seconds apart, to the replicas in
turn: faster than an engine's events could tell where its blocks went, so only the
routes stream can. Per kvbus tree (``--tree NAME=ROOT``, the source whose ``kvbus
router`` runs, so two commits compare in one run) and mode (``shared``: the replicas on
``--routes-stream``; ``unshared``: not): the share of bursts whose requests all went to
one worker, and of requests after a burst's first for which the router predicted cached
tokens (it saw the burst's blocks about to be cached there).

    python bench/bench_replicas.py [--bursts 40] [--burst 4] [--workers 4]
        [--spacing 0.05] [--hold 0.3] [--tree now=.] [--tree before=/path/to/old/kvbus]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

from cluster import NatsServer, beat_idle_load, free_port, make_model  # noqa: E402


class Workers:
    """Scripted workers on loopback: each answers a completion after ``hold`` seconds."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.urls: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []

    async def start(self, names: list[str]) -> None:
        for name in names:
            app = web.Application()
            app.router.add_post("/v1/completions", self.complete)
            app.router.add_get("/v1/models", self.models)
            runner = web.AppRunner(app)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self._runners.append(runner)
            self.urls[name] = f"http://127.0.0.1:{port}"

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(self.hold)
        usage = {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response({"id": "cmpl-1", "choices": [], "usage": usage})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "root": "m"}]})

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


@contextlib.contextmanager
def replicas(
    root: Path,
    url: str,
    tokenizer: Path,
    workers: dict[str, str],
    tag: str,
    shared: bool,
    logs: Path,
) -> Iterator[list[str]]:
    """Two ``kvbus router`` processes of the kvbus at ``root``; yields their base URLs."""
    processes, bases = [], []
    try:
        for number in (1, 2):
            port = free_port()
            command = [sys.executable, "-m", "kvbus.cli", "router", "--port", str(port)]
            command += [f"--worker={name}={base}" for name, base in workers.items()]
            command += ["--url", url, "--tokenizer", str(tokenizer), "--block-size", "16"]
            command += ["--kv-stream", f"kv-{tag}", "--metrics-stream", f"metrics-{tag}"]
            command += ["--seed", str(number)]
            if shared:
                command += ["--routes-stream", f"routes-{tag}", "--replica", f"r{number}"]
            env = {**os.environ, "PYTHONHASHSEED": str(number), "PYTHONPATH": str(root)}
            with open(logs / f"router-{tag}-{number}.log", "wb") as log:
                processes.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=log, cwd=root)
                )
            bases.append(f"http://127.0.0.1:{port}")
        yield bases
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


async def wait_ready(session: aiohttp.ClientSession, base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientConnectionError):
            async with session.get(f"{base}/health") as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"router {base} never got ready")
        await asyncio.sleep(0.1)


async def run_bursts(
    bases: list[str], bursts: int, burst: int, spacing: float, seed: int
) -> tuple[float, float]:
    """(bursts all on one worker, later requests predicted cached) as shares."""
    rng = random.Random(seed)
    together = predicted = later = 0
    async with aiohttp.ClientSession() as session:
        for base in bases:
            await wait_ready(session, base)

        async def post(base: str, body: str) -> tuple[str, int]:
            async with session.post(f"{base}/v1/completions", data=body) as response:
                assert response.status == 200, await response.text()
                headers = response.headers
                return headers["x-kvbus-worker"], int(headers["x-kvbus-predicted-cached-tokens"])

        turn = 0
        for _ in range(bursts):
            words = " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(256))
            body = json.dumps({"model": "m", "prompt": words, "max_tokens": 1})
            sent = []
            for _ in range(burst):
                sent.append(asyncio.create_task(post(bases[turn % len(bases)], body)))
                turn += 1
                await asyncio.sleep(spacing)
            answers = await asyncio.gather(*sent)
            together += len({worker for worker, _ in answers}) == 1
            predicted += sum(cached > 0 for _, cached in answers[1:])
            later += len(answers) - 1
    return together / bursts, predicted / max(later, 1)


def parse_trees(specs: list[str]) -> list[tuple[str, Path]]:
    return [(name, Path(root).resolve()) for name, root in (s.split("=", 1) for s in specs)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=40)
    parser.add_argument("--burst", type=int, default=4, help="requests per burst")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--spacing", type=float, default=0.05, help="seconds between a burst's")
    parser.add_argument("--hold", type=float, default=0.3, help="seconds a worker takes")
    parser.add_argument(
        "--tree",
        action="append",
        metavar="NAME=ROOT",
        help="a kvbus source tree whose router runs (repeat; default: this one)",
    )
    args = parser.parse_args()
    trees = parse_trees(args.tree or [f"now={REPO}"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbus-replicas-") as tmp:
        root = Path(tmp)
        tokenizer = root / "tokenizer"
        tokenizer.mkdir()
        make_model(tokenizer)
        nats = NatsServer(root)
        nats.start()
        workers = Workers(args.hold)
        names = [f"w{i}" for i in range(args.workers)]
        await workers.start(names)
        try:
            for name, tree in trees:
                for shared in (True, False):
                    tag = f"{name}-{'shared' if shared else 'unshared'}-{time.time_ns()}"
                    beating = asyncio.create_task(beat_idle_load(nats.url, f"metrics-{tag}", names))
                    try:
                        with replicas(
                            tree,
                            nats.url,
                            tokenizer,
                            workers.urls,
                            tag,
                            shared,
                            root,
                        ) as bases:
                            together, predicted = await run_bursts(
                                bases, args.bursts, args.burst, args.spacing, seed=1
                            )
                    finally:
                        beating.cancel()
                        await asyncio.gather(beating, return_exceptions=True)
                    mode = "shared" if shared else "unshared"
                    rows.append((name, mode, together, predicted))
                    print(
                        f"  {name} {mode}: bursts on one worker {together:.0%}, "
                        f"later requests predicted cached {predicted:.0%}",
                        file=sys.stderr,
                    )
        finally:
            await workers.close()
            nats.stop()
    print(
        f"\n{args.bursts} bursts of {args.burst} requests (one new 256-token prompt each), "
        f"{args.spacing * 1000:.0f} ms apart, to two `kvbus router` processes in turn; "
        f"{args.workers} workers answering after {args.hold * 1000:.0f} ms\n"
    )
    print("| kvbus | routes stream | bursts on one worker | later requests predicted cached |")
    print("| --- | --- | ---: | ---: |")
    for name, mode, together, predicted in rows:
        print(f"| {name} | {mode} | {together:.0%} | {predicted:.0%} |")


if __name__ == "__main__":
    asyncio.run(main())
