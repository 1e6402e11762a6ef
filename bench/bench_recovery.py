"""Recovery after kill -9 of the server, per backend, several runs (prints a table).

Each run is the suite's scenario (tests/test_faults.py ``kill_9_and_restart``): an
"engine" thread publishes 20,000 KV batches at 4,000 messages/s into a publisher with
the default queue (10,000 messages, 64 MiB); a third of the way the server is killed
with SIGKILL, restarted 1 s later on the same store (nats-server with ``sync_interval:
always``, redis-server with ``appendonly yes``, ``appendfsync always``), and the
publisher is closed 3 s after the restart. A subscriber follows the stream throughout.
A run passes when every seq arrived exactly once and nothing was dropped.

The baseline is the same scenario before this release's recovery work: the numbers it
gave are in BENCHMARKS.md (it dropped 3,300 messages on NATS, up to 844 on Redis).

Run: python bench/bench_recovery.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_faults import kill_9_and_restart


async def run(runs: int) -> None:
    print(
        "| backend | runs passed | lost | dropped | copies dropped by the subscriber "
        "(median) | send errors (median) | publish() max, ms (median) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for backend in ("nats", "redis"):
        passed, copies, errors, slowest = 0, [], [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as directory:
                try:
                    engine, copied = await kill_9_and_restart(backend, Path(directory))
                except AssertionError as failure:
                    print(f"  {backend}: run failed: {failure}", file=sys.stderr)
                    continue
            passed += 1
            copies.append(copied)
            errors.append(engine.publisher.stats.send_errors)
            slowest.append(max(engine.durations) * 1e3)
        if not passed:
            print(f"| {backend} | 0/{runs} | | | | | |")
            continue
        print(
            f"| {backend} | {passed}/{runs} | 0 | 0 | {statistics.median(copies):g} | "
            f"{statistics.median(errors):g} | {statistics.median(slowest):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    logging.basicConfig(level=logging.ERROR)  # each run's reconnect warnings are expected
    asyncio.run(run(parser.parse_args().runs))


if __name__ == "__main__":
    main()
