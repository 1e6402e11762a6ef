"""Shutdown ends in an outage, whatever the backend's client does with a cancellation
(real nats-server and redis-server, killed or SIGSTOPped).

A client library can swallow a cancel: in Python 3.11 ``asyncio.wait_for``, which
redis-py and nats-py wrap around socket writes and requests, returns its inner call's
outcome when that call ended just as the cancel landed. Redis being killed under a busy
subscription did that often enough that ``asyncio.run`` hung for ever at exit: the
reader retried the failed read with the cancel gone. Here the race is made certain: the
real transport is wrapped so that a cancel landing in any of its calls comes out as the
call's failure (`SwallowingTransport`).

Each test runs a program in a subprocess (``python -m tests.test_shutdown``) that opens
publishers and subscriptions, reads, and, once the server is down, closes one
subscription, cancels a publisher's close, and returns from ``main()`` leaving a
subscription open, so ``asyncio.run`` must cancel its reader. The test asserts the
program exits within a bounded wait (no timing is asserted beyond that).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from kvbus.transports import Entry, Position, Record, Transport, entries_of, open_transport

import kvbus
from kvbus.shutdown import cancel_sticks

from .conftest import kv_payload
from .servers import NatsServer, RedisServer, Server

ROOT = Path(__file__).absolute().parents[1]
SERVERS: dict[str, type[Server]] = {"nats": NatsServer, "redis": RedisServer}
EXIT_WITHIN = 20.0  # seconds: a bound for liveness, not a timing assertion


class SwallowingTransport(Transport):
    """A real transport whose every call, cancelled, ends with a ``ConnectionError`` in
    place of the ``CancelledError``: what redis-py or nats-py do when the cancel lands
    just as a command ends (the call's own outcome, a failure with the server down)."""

    def __init__(self, real: Transport) -> None:
        self.real = real

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        try:
            await self.real.append(stream, records)
        except asyncio.CancelledError:
            raise ConnectionError("a cancel swallowed by the client") from None

    def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        return entries_of(self.read_pages(stream, after, follow=follow))

    async def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        pages = self.real.read_pages(stream, after, follow=follow)
        while True:
            try:
                page = await anext(pages)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                raise ConnectionError("a cancel swallowed by the client") from None
            yield page

    async def aclose(self) -> None:
        await self.real.aclose()


def swallowing(url: str) -> SwallowingTransport:
    return SwallowingTransport(open_transport(url))


async def outage_program(url: str) -> None:
    """What the child process runs: see the module docstring. Prints each step."""

    async def read_some(sub: kvbus.Subscription, count: int) -> None:
        async with asyncio.timeout(EXIT_WITHIN):
            async for _ in sub:
                if sub.stats.delivered >= count:
                    return

    async def read_on(sub: kvbus.Subscription) -> None:
        async for _ in sub:
            pass

    publisher = kvbus.Publisher(url, stream="s", source="engine", transport=swallowing(url))
    for i in range(2000):
        publisher.publish(kv_payload(i))
    closed = kvbus.subscribe("s", url, transport=swallowing(url))
    left_open = kvbus.subscribe("s", url, transport=swallowing(url))
    await read_some(closed, 1000)
    await read_some(left_open, 1000)
    readers = [asyncio.create_task(read_on(sub)) for sub in (closed, left_open)]
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the server is down now
    for i in range(2000):  # queued: the publisher retries meanwhile
        publisher.publish(kv_payload(i))
    await asyncio.sleep(0.5)  # the readers retry, or wait in a read that will time out
    readers[0].cancel()
    await closed.aclose()
    print("closed a subscription", flush=True)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(0.5):
            # Its queue cannot be sent: a minute of waiting, cut short by the timeout.
            await publisher.aclose(timeout=60)
    print("cancelled a publisher's close", flush=True)
    # `left_open` and its reader are left to asyncio.run's final cancellation.


def _lines_of(process: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue[str], wanted: str, seen: list[str]) -> None:
    while True:
        try:
            line = lines.get(timeout=EXIT_WITHIN)
        except queue.Empty:
            raise AssertionError(f"no {wanted!r} from the program:\n{''.join(seen)}") from None
        seen.append(line)
        if line.strip() == wanted:
            return


@pytest.mark.parametrize("outage", ["killed", "stopped"])
@pytest.mark.parametrize("backend", ["redis", "nats"])
def test_shutdown_ends_in_an_outage_whatever_the_client_does_with_a_cancel(
    backend: str, outage: str, tmp_path: Path
) -> None:
    """Closing a subscription, cancelling a publisher's close and leaving a subscription
    open for ``asyncio.run`` to cancel, with the server killed or stopped: the program
    ends. (Before: the reader retried for ever once its cancel was swallowed, and a
    cancelled ``Publisher.aclose`` held ``asyncio.run`` for the whole close timeout.)"""
    server = SERVERS[backend](tmp_path)
    server.start()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.test_shutdown", server.url],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = _lines_of(process)
    seen: list[str] = []
    assert server.process is not None
    try:
        _wait_for_line(lines, "ready", seen)
        if outage == "killed":
            server.kill()
        else:
            os.kill(server.process.pid, signal.SIGSTOP)
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
        try:
            process.wait(EXIT_WITHIN)
        except subprocess.TimeoutExpired:
            process.kill()
        process.wait()
        while not lines.empty():
            seen.append(lines.get())
        output = "".join(seen)
        assert "asyncio.run returned" in output, f"the program hung:\n{output}"
        assert process.returncode == 0, output
    finally:
        if process.poll() is None:
            process.kill()
        if outage == "stopped":
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


if __name__ == "__main__":
    asyncio.run(outage_program(sys.argv[1]))
    print("asyncio.run returned", flush=True)


async def _timeouts_while_the_loop_stalls(log: list[str]) -> None:
    """A reader's probe of a dead server: a timeout around a 3.11 ``wait_for``, whose
    unwinding after the timeout's cancel takes a few loop iterations."""
    for i in range(3):
        try:
            async with asyncio.timeout(0.05):
                await asyncio.wait_for(asyncio.get_running_loop().create_future(), 10)
        except TimeoutError:
            log.append(f"timeout {i}")


async def _stall_the_loop_now_and_then() -> None:
    """The consumer's work on the same loop (or GC, or CPU throttling): 120 ms at a
    time, past `CANCEL_AGAIN_AFTER`."""
    while True:
        await asyncio.sleep(0.03)
        started = time.perf_counter()
        while time.perf_counter() - started < 0.12:
            pass


def test_a_sticky_task_survives_its_own_timeouts_on_a_stalling_loop() -> None:
    """The repeated cancel once took a timeout's own cancel, still in force while a
    stalled loop unwound it, for a request to stop: the timeout then let a
    CancelledError out, and the subscription's reader ended for good (a silent hang)."""

    async def main() -> tuple[list[str], bool]:
        log: list[str] = []
        staller = asyncio.create_task(_stall_the_loop_now_and_then())
        task = cancel_sticks(_timeouts_while_the_loop_stalls(log))
        await asyncio.wait([task], timeout=10)
        staller.cancel()
        return log, task.done() and not task.cancelled()

    log, ended_by_itself = asyncio.run(main())
    assert log == ["timeout 0", "timeout 1", "timeout 2"] and ended_by_itself


def test_a_request_to_stop_still_sticks_when_the_task_swallows_it() -> None:
    async def swallows_one_cancel() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # as a client library's wait_for may
        await asyncio.sleep(10)  # and goes on waiting: the repeated cancel lands here

    async def main() -> bool:
        task = cancel_sticks(swallows_one_cancel())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task], timeout=5)
        return task.cancelled()

    assert asyncio.run(main())
