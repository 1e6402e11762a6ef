"""Failover: seconds from killing the server that leads a stream to the first message
published after the kill reaching a subscriber, beside the backend's own failover time
measured in the same run (prints a table).

Each run is one of tests/test_cluster.py's scenarios on fresh servers: 3,000 messages at
600/s, a following subscriber, SIGKILL a third of the way.

- nats, leader killed: a 3-node JetStream cluster, ``replicas=3``; the stream's leader is
  killed and restarted 1 s later. Baseline: a plain nats-py client asking for the
  stream's info every 0.25 s, until a new leader answers.
- nats, subscriber's server killed: the same, the subscriber connected to the leader.
- redis (+ ``wait=1``): a primary, two replicas and a Sentinel (``down-after-milliseconds
  1000``), the replicas cut off 0.3 s before the kill. Baseline: the Sentinel naming the
  new primary (asked every 10 ms).

Run: python bench/bench_failover.py [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.servers import NatsCluster, RedisWithSentinel
from tests.test_cluster import Failover, redis_failover, ride_through_a_kill


async def nats_run(directory: Path, subscriber_on_leader: bool) -> Failover:
    cluster = NatsCluster(directory)
    await asyncio.to_thread(cluster.start)
    try:
        sub_url = "nats://127.0.0.1:{leader.port}" if subscriber_on_leader else None
        return await ride_through_a_kill(cluster, "bench", sub_url)
    finally:
        await asyncio.to_thread(cluster.stop)


async def redis_run(directory: Path, wait: int) -> Failover:
    group = RedisWithSentinel(directory)
    await group.start()
    try:
        return await redis_failover(group, wait)
    finally:
        await group.stop()


SCENARIOS: dict[str, Callable[[Path], Awaitable[Failover]]] = {
    "nats R3, stream leader killed": lambda d: nats_run(d, False),
    "nats R3, the subscriber's server (the leader) killed": lambda d: nats_run(d, True),
    "redis + Sentinel": lambda d: redis_run(d, 0),
    "redis + Sentinel, wait=1": lambda d: redis_run(d, 1),
}


async def run(runs: int) -> None:
    print(
        "| scenario | runs passed | backend failover, s (median) | kvbus: kill to next "
        "message delivered, s (median) | kvbus / backend | added by kvbus, s (median) | "
        "announced lost (median) | send errors (median) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, scenario in SCENARIOS.items():
        results = []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as directory:
                try:
                    results.append(await scenario(Path(directory)))
                except AssertionError as failure:
                    print(f"  {name}: run failed: {failure}", file=sys.stderr)
        if not results:
            print(f"| {name} | 0/{runs} | | | | | | |")
            continue
        server = statistics.median(r.server for r in results)
        delivered = statistics.median(r.delivered for r in results)
        added = statistics.median(r.delivered - r.server for r in results)
        lost = statistics.median(r.lost for r in results)
        errors = statistics.median(r.send_errors for r in results)
        print(
            f"| {name} | {len(results)}/{runs} | {server:.2f} | {delivered:.2f} | "
            f"{delivered / server:.2f} | {added:.2f} | {lost:g} | {errors:g} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    logging.basicConfig(level=logging.ERROR)  # each run's reconnect warnings are expected
    asyncio.run(run(parser.parse_args().runs))


if __name__ == "__main__":
    main()
