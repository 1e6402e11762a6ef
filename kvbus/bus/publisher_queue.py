"""The hand-off from ``Publisher.publish()`` to the sender thread: a bounded queue of
messages under the seqs they were given, the drops it counts, and the wake-up of an
idle sender that costs the engine's thread no GIL hand-over."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvbus.logs import LimitedLog
from kvbus.wire.envelope import Kind

if TYPE_CHECKING:
    from kvbus.bus.publisher_stats import PublisherStats

log = logging.getLogger("kvbus.bus.publisher")
_limited = LimitedLog(log)

STRUCT_BYTES: Final = 256  # what a queued Struct payload is counted as (encoded later)

Queued = tuple[int, int, "bytes | msgspec.Struct", float]
"""(seq, kind, payload, ts) as queued by publish(); a Struct payload is encoded by the
sender thread so that the engine thread pays nothing for it."""


def _libc_write() -> Any:
    """libc's ``write`` called without releasing the GIL (a ctypes.PyDLL function), or
    None where there is no libc to load (Windows)."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError, TypeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


_write_keeping_gil: Final = _libc_write()
"""``(fd, data, size)``: a non-blocking write of a wake-up byte that keeps the GIL: the
engine's thread goes on with its step at once, where a write that releases the GIL could
wait for the sender thread to run first. Measured with ``bench/bench_core.py``: the
wake-up this way costs the process a small part of what relaying it through a thread
did (`BENCHMARKS.md`)."""


def _wake_pipe(loop: asyncio.AbstractEventLoop, wakeup: asyncio.Event) -> tuple[int, int] | None:
    """A non-blocking pipe whose read end sets ``wakeup`` in ``loop`` (not running yet);
    returns (write end, read end), or None where the GIL-keeping write or the loop's
    ``add_reader`` is missing (Windows)."""
    if _write_keeping_gil is None:
        return None
    read_fd, write_fd = os.pipe()
    for fd in (read_fd, write_fd):
        os.set_blocking(fd, False)
    try:
        loop.add_reader(read_fd, lambda: _drain(read_fd, wakeup))
    except NotImplementedError:
        _close_fds(read_fd, write_fd)
        return None
    return write_fd, read_fd


def _drain(read_fd: int, wakeup: asyncio.Event) -> None:
    with contextlib.suppress(OSError):
        while os.read(read_fd, 4096):
            pass
    wakeup.set()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SendQueue:
    """Messages accepted by ``publish()`` (any thread) until the sender (the thread's
    event loop ``loop``) takes them, with the counts both sides keep in ``stats``.

    ``lock`` is held for a few bytecodes by publish(), and by the sender only to count
    a drop: it never waits on I/O. The sender sets ``idle`` before sleeping; publish()
    wakes it only then, so a busy sender costs publish() nothing beyond a deque append.
    The wake-up is one byte written to a pipe the sender's loop watches, by a write that
    keeps the GIL (`_write_keeping_gil`): loop.call_soon_threadsafe's socket write would
    hand the GIL to the sender in the middle of the engine's step.
    """

    def __init__(
        self,
        stats: PublisherStats,
        loop: asyncio.AbstractEventLoop,
        *,
        stream: str,
        max_queue: int,
        max_queue_bytes: int,
        max_batch: int,
    ) -> None:
        self.stats = stats
        self._stream = stream
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        self._max_batch = max_batch
        # Queued bytes = in - out; each counter has one writer (the publishing thread,
        # the sender thread), so neither needs a lock.
        self._bytes_in = 0
        self._bytes_out = 0
        self._next_seq = 1
        self._queue: deque[Queued] = deque()
        self.closed = False
        self.forked = False
        self.lock = threading.Lock()
        self.idle = False
        self.last_dropped = 0  # newest dropped seq
        self._loop = loop
        self._wakeup = asyncio.Event()
        pipe = _wake_pipe(loop, self._wakeup)
        self._wake_fd = -1 if pipe is None else pipe[0]
        self._close_pipe = weakref.finalize(self, _close_fds, *(pipe or ()))
        # Closed once nothing can write to it; not at exit, where a Publisher never
        # closed may still be in use (the process's exit closes them).
        self._close_pipe.atexit = False

    # --- the publishing side: never blocks ------------------------------------------

    def enqueue(
        self,
        payload: bytes | msgspec.Struct,
        kind: Kind,
        size: int,
        seq: int = 0,
        ts: float = 0.0,
    ) -> bool:
        """Called under ``lock``: a seq is taken, counted and queued (or dropped) as
        one step, so that a close cannot slip in between the check and the append (the
        message would be accepted after the sender's last look at the queue), and
        counters written from several threads keep every increment.

        ``seq`` (a relay forwarding another process's messages, `resume`): the message's
        own, which must be past every seq taken so far (an older one is refused); the
        seqs it skips are announced as lost by the sender's gap marker."""
        if seq:
            if seq < self._next_seq:
                return False
            self._next_seq = seq
        if self.closed:  # the epoch ended with SourceStopped: no seq, no LossNotice
            self.stats.dropped += 1
            if self.forked:
                _limited.warning(
                    "forked",
                    "kvbus: dropped a message published in process %d through a Publisher "
                    "of stream %s opened before the fork; open a Publisher in the child",
                    os.getpid(),
                    self._stream,
                )
            return False
        seq = self._take_seq()
        if (
            len(self._queue) >= self._max_queue
            or self._bytes_in + size - self._bytes_out > self._max_queue_bytes
        ):
            self.stats.dropped += 1
            self.last_dropped = seq
            return False
        self._bytes_in += size
        self._queue.append((seq, kind, payload, ts or time.time()))
        self.stats.published += 1
        return True

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def resume(self, after: int) -> None:
        """Seqs go on after ``after`` (a relay taking over another's place in an epoch)."""
        self._next_seq = max(self._next_seq, after + 1)

    def announce_loss(self, count: int) -> None:
        """``count`` messages lost upstream, under one seq."""
        with self.lock:
            self.last_dropped = self._take_seq()
            self.stats.dropped += max(1, count)
        if self.idle:
            self.wake()

    def wake(self) -> None:
        self.idle = False
        if self._wake_fd >= 0:
            _write_keeping_gil(self._wake_fd, b"\0", 1)
        else:  # releases the GIL: see the class
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def after_fork_in_child(self) -> None:
        """The process was forked (see ``Publisher._after_fork_in_child``): closed, with
        a new lock (one a parent thread held at the fork would stay held here), nothing
        queued, and the child's copies of the wake pipe closed (the parent's stay open)."""
        self.lock = threading.Lock()
        self.closed = self.forked = True
        self.idle = False  # only the sender sets it: nothing here wakes a sender
        self._queue.clear()
        self._close_pipe()
        self._wake_fd = -1

    @property
    def messages(self) -> int:
        return len(self._queue)

    @property
    def bytes(self) -> int:
        return max(0, self._bytes_in - self._bytes_out)

    # --- the sender's side ------------------------------------------------------------

    def take_batch(self) -> list[Queued]:
        batch: list[Queued] = []
        queue = self._queue
        while queue and len(batch) < self._max_batch:
            batch.append(queue.popleft())
        self._bytes_out += sum(
            len(payload) if isinstance(payload, bytes) else STRUCT_BYTES
            for _, _, payload, _ in batch
        )
        return batch

    def count_drop(self, seq: int) -> None:
        """The sender dropped message ``seq`` after taking it."""
        with self.lock:  # publish() counts drops too
            self.stats.dropped += 1
            self.last_dropped = max(self.last_dropped, seq)

    async def wait(self, last_sent: int) -> bool:
        """Sleep, idle, until a message is queued or a loss after ``last_sent`` is to be
        announced; False at once when there is nothing more to send, ever."""
        # closed is set under publish()'s lock: once it is seen, the queue only shrinks,
        # and an empty queue is final.
        if self.closed and not self._queue:
            return False
        self.idle = True
        # published, or a loss announced, between take_batch and idle = True
        if self._queue or self.last_dropped > last_sent:
            self.idle = False
            return True
        await self._wakeup.wait()
        self._wakeup.clear()
        return True
