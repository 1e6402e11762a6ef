"""Soak: many server faults in a row under load, each run checked for catching up and
for a shutdown that ends (prints a table).

Per backend (redis-server with ``appendonly yes``, ``appendfsync always``; nats-server
with ``sync_interval: always``), one server for all runs, and for each run a stream of
its own, a publisher fed at 4,000 messages/s by an "engine" thread (the default queue,
10,000 messages) and a following subscriber. After 0.3 s one fault:

- ``kill``: SIGKILL of the server, restarted on the same store and port 1 s later;
- ``stop``: SIGSTOP of the server for 3 s, then SIGCONT (the queue overflows: the
  dropped seqs must be announced);
- ``cut``: publisher and subscriber reach the server through a loopback TCP proxy
  (tests/servers.py ``CuttableProxy``) that resets every connection and refuses new
  ones for 1 s.

Publishing goes on 0.3 s past the fault, then the publisher is closed. A run passes when
the subscriber got every seq (SourceStarted .. SourceStopped) delivered once, in order,
or announced lost (a Resync), and when its ``asyncio.run`` ended within 20 s. Even runs
close the subscription; odd runs leave it open, reading, for ``asyncio.run``'s final
cancellation. "Caught up" is the time from the fault's end (restart, SIGCONT, heal) to
the subscriber having everything published before that moment. A "hang" is a run whose
``asyncio.run`` did not end (its thread is left behind).

Run: python bench/soak_restart.py [--runs 50] [--backends redis,nats] [--faults kill,stop,cut]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbus
from kvbus import Message, Resync
from tests.conftest import Item, lost_seqs, seqs
from tests.servers import CuttableProxy, NatsServer, RedisServer, Server
from tests.test_faults import PacedPublishing

RATE = 4000  # messages/s
BEFORE = 0.3  # seconds of publishing before the fault, and after its end
FAULT_SECONDS = {"kill": 1.0, "stop": 3.0, "cut": 1.0}
CATCH_UP_WITHIN = 60.0  # seconds after the publisher's close
SHUTDOWN_WITHIN = 20.0  # seconds for asyncio.run to end once the run's main() returned
SERVERS: dict[str, type[Server]] = {"nats": NatsServer, "redis": RedisServer}


@dataclass
class Outcome:
    caught_up: float | None = None  # seconds from the fault's end
    complete: bool = False  # every seq delivered once or announced lost
    lost: int = 0  # seqs announced lost (queue overflow during the fault)
    shutdown: float | None = None  # seconds from main() returning to asyncio.run's end
    problem: str = ""
    main_returned: float = field(default=0.0, repr=False)


class Watch:
    """The subscriber's side: every item, and when the seq ``target`` of ``source`` was
    first delivered or announced lost."""

    def __init__(self, sub: kvbus.Subscription, source: str, last: int) -> None:
        self.sub = sub
        self.source = source
        self.last = last
        self.items: list[Item] = []
        self.target: int | None = None
        self.reached_at: float | None = None
        self.done = asyncio.Event()

    def aim_at(self, target: int) -> None:
        """Time from now until seq ``target`` is delivered or announced lost."""
        self.target = target
        self._reached(max(seqs(self.items) or [0]))

    def _reached(self, seq: int) -> None:
        if self.target is not None and self.reached_at is None and seq >= self.target:
            self.reached_at = time.monotonic()
        if seq >= self.last:
            self.done.set()

    async def run(self) -> None:
        async for item in self.sub:
            self.items.append(item)
            if item.source != self.source:
                continue
            if isinstance(item, Message):
                self._reached(item.seq)
            elif isinstance(item, Resync) and item.lost is not None:
                self._reached(item.lost[1])


async def one_run(backend: str, fault: str, server: Server, index: int, outcome: Outcome) -> None:
    """One fault under load, the checks filled into ``outcome``."""
    proxy = None
    url = server.url
    if fault == "cut":
        proxy = CuttableProxy(server.port)
        await proxy.start()
        url = f"{url.rsplit(':', 1)[0]}:{proxy.port}" + ("?timeout=2" if backend == "nats" else "")
    stream = f"soak{index}{fault}"
    fault_seconds = FAULT_SECONDS[fault]
    total = int(RATE * (2 * BEFORE + fault_seconds))
    publisher = kvbus.Publisher(url, stream=stream, source="engine")
    sub = kvbus.subscribe(stream, url)
    watch = Watch(sub, "engine", total + 2)  # SourceStarted, total, SourceStopped
    watching = asyncio.create_task(watch.run())
    engine = PacedPublishing(publisher, total, rate=RATE).start()
    await asyncio.sleep(BEFORE)
    if fault == "kill":
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(fault_seconds)
        await asyncio.to_thread(server.start)
    elif fault == "stop":
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)
        await asyncio.sleep(fault_seconds)
        os.kill(server.process.pid, signal.SIGCONT)
    else:
        assert proxy is not None
        proxy.cut()
        await asyncio.sleep(fault_seconds)
        proxy.heal()
    healed = time.monotonic()
    watch.aim_at(1 + len(engine.accepted))  # SourceStarted is seq 1
    await engine.join()
    await publisher.aclose()
    try:
        async with asyncio.timeout(CATCH_UP_WITHIN):
            await watch.done.wait()
    except TimeoutError:
        outcome.problem = f"not caught up: {len(seqs(watch.items))} of {total + 2} delivered"
    if watch.reached_at is not None:
        outcome.caught_up = max(0.0, watch.reached_at - healed)
    delivered = seqs(watch.items, "engine")
    lost = lost_seqs(watch.items)
    everything = set(range(1, total + 3))
    outcome.lost = len(lost)
    if delivered != sorted(set(delivered)):
        outcome.problem += " out of order or twice;"
    elif lost & set(delivered):
        outcome.problem += " delivered and announced lost;"
    elif watch.done.is_set() and (set(delivered) | lost) != everything:
        missing = sorted(everything - set(delivered) - lost)
        outcome.problem += f" {len(missing)} seqs neither delivered nor announced, {missing[:5]}"
    outcome.complete = watch.done.is_set() and not outcome.problem
    if index % 2 == 0:
        watching.cancel()
        await sub.aclose()
    # Odd runs leave the subscription open, its reader reading: asyncio.run cancels it.
    if proxy is not None:
        await proxy.close()
    outcome.main_returned = time.monotonic()


def run_in_thread(main: Callable[[], object], outcome: Outcome) -> bool:
    """``asyncio.run(main())`` in a thread of its own; False if it did not end within
    SHUTDOWN_WITHIN seconds of main() returning (the thread is left: a hang)."""
    ended = threading.Event()

    def target() -> None:
        try:
            asyncio.run(main())  # type: ignore[arg-type]
        except Exception as error:  # reported, not raised: the soak goes on
            outcome.problem += f" {error!r}"
        ended.set()

    threading.Thread(target=target, daemon=True, name="soak-run").start()
    while not ended.wait(0.1):
        if outcome.main_returned and time.monotonic() - outcome.main_returned > SHUTDOWN_WITHIN:
            return False
    if outcome.main_returned:
        outcome.shutdown = time.monotonic() - outcome.main_returned
    return True


def soak(backend: str, fault: str, runs: int, directory: Path) -> list[str]:
    server = SERVERS[backend](directory)
    server.start()
    outcomes: list[Outcome] = []
    hangs = 0
    began = time.monotonic()
    try:
        for index in range(runs):
            outcome = Outcome()
            ended = run_in_thread(
                lambda i=index, o=outcome: one_run(backend, fault, server, i, o), outcome
            )
            hangs += not ended
            outcomes.append(outcome)
            if outcome.problem or not ended:
                print(
                    f"  {backend} {fault} run {index}: {outcome.problem or 'hung at exit'}",
                    file=sys.stderr,
                )
            if server.process is None or server.process.poll() is not None:
                server.start()  # a run that failed mid-kill
    finally:
        server.stop()
    passed = [o for o in outcomes if o.complete and o.shutdown is not None]
    caught = [o.caught_up for o in outcomes if o.caught_up is not None]
    shutdowns = [o.shutdown for o in outcomes if o.shutdown is not None]
    lost = [o.lost for o in outcomes]
    return [
        backend,
        fault,
        str(runs),
        str(len(passed)),
        f"{statistics.median(caught):.2f} / {max(caught):.2f}" if caught else "-",
        f"{max(shutdowns):.2f}" if shutdowns else "-",
        str(hangs),
        f"{sum(lost)} ({sum(1 for n in lost if n)} runs)",
        f"{time.monotonic() - began:.0f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per backend and fault")
    parser.add_argument("--backends", default="redis,nats")
    parser.add_argument("--faults", default="kill,stop,cut")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # each run's reconnect warnings are expected
    header = [
        "backend",
        "fault",
        "runs",
        "passed",
        "caught up, s (median / max)",
        "shutdown, s (max)",
        "hangs",
        "seqs announced lost",
        "wall, s",
    ]
    rows = []
    for backend in args.backends.split(","):
        for fault in args.faults.split(","):
            with tempfile.TemporaryDirectory() as directory:
                rows.append(soak(backend, fault, args.runs, Path(directory)))
                print(f"  done: {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" if i < 2 else "---:" for i in range(len(header))) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
