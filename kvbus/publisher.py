"""`Publisher`: hands messages from engine code to a transport without ever blocking it.

``publish()`` runs on the caller's thread (vLLM's scheduler thread, or an event loop)
and only stamps a seq and appends to a bounded in-memory queue. A background thread
with its own event loop drains that queue in batches, wraps each message in an
`Envelope` and appends it to the transport, retrying with backoff while the backend is
down. When the queue is full the message is dropped and counted; its seq is still
used, so the next message sent carries ``lost_from`` and every consumer learns exactly
which seqs will never arrive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from typing import Any, Final

import msgspec

from kvbus import __version__, instruments
from kvbus.config import redact_url, resolve_source, resolve_stream, resolve_url
from kvbus.envelope import SCHEMA_VERSION, Envelope, Kind, decode_envelope, encode_envelope
from kvbus.events import LossNotice, SourceStarted, SourceStopped, encode
from kvbus.logs import LimitedLog
from kvbus.retry import log_failure, retry_forever
from kvbus.shutdown import CLOSE_WITHIN, cancel_sticks, close_within
from kvbus.transports import Record, RecordTooLarge, Transport, open_transport
from kvbus.transports.packing import DEFAULT_RECORDS

log = logging.getLogger("kvbus.publisher")
_limited = LimitedLog(log)

DEFAULT_MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024
DEFAULT_MAX_QUEUE_BYTES: Final = 64 * 1024 * 1024
_STRUCT_BYTES: Final = 256  # what a queued Struct payload is counted as (encoded later)

# (seq, kind, payload, ts) as queued by publish(); a Struct payload is encoded by the
# sender thread so that the engine thread pays nothing for it.
_Queued = tuple[int, int, "bytes | msgspec.Struct", float]


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


_open_publishers: weakref.WeakSet[Publisher] = weakref.WeakSet()


def _publishers_after_fork_in_child() -> None:
    for publisher in list(_open_publishers):
        publisher._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_publishers_after_fork_in_child)


class PublisherStats(msgspec.Struct):
    published: int = 0
    """Messages accepted by ``publish()``."""
    sent: int = 0
    """Messages the transport accepted."""
    dropped: int = 0
    """Messages lost: queue full, publisher closed, oversized, or unsent at close."""
    send_errors: int = 0
    """Failed append attempts (each is retried)."""
    reconnects: int = 0
    """Appends that succeeded after failed attempts: the backend came back."""


class Publisher:
    """Publishes messages of one ``source`` to one ``stream`` of a transport.

    Delivery guarantee: at-least-once to the transport for every message accepted by
    ``publish()`` while the process lives and the backend recovers within the queue's
    capacity; otherwise the loss is announced to consumers by the next message's gap
    marker. Per-source order is preserved.

    Any thread may publish, and close() while others publish: what publish() accepted
    is sent, what it refused is counted in ``stats.dropped``, and nothing follows the
    epoch's ``SourceStopped``. A process forked while the Publisher is open gets it
    closed (its sender thread stays in the parent): a child opens its own.

    Args:
        url: transport URL; default ``$KVBUS_URL``, else ``memory://``.
        stream: stream name; default ``$KVBUS_STREAM``, else ``kv``.
        source: stable publisher id; default ``$KVBUS_SOURCE``, else ``hostname-pid``.
        max_queue: messages held while the backend is slow or down before dropping.
        max_queue_bytes: payload bytes held likewise (64 MiB), whichever fills first.
        max_batch: most messages handed to the transport in one append.
        max_message_bytes: larger envelopes are dropped (and announced as lost).
        data_parallel_rank: recorded in the epoch's ``SourceStarted`` message.
        transport: an already opened transport to use instead of opening ``url``.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        stream: str | None = None,
        source: str | None = None,
        max_queue: int = 10_000,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        max_batch: int = DEFAULT_RECORDS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        data_parallel_rank: int | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.stream = resolve_stream(stream)
        self.source = resolve_source(source)
        self.epoch = time.time_ns()
        self.stats = PublisherStats()
        self.append_latency = instruments.LatencyHistogram()
        """Seconds from an append's first try to the transport's acknowledgement."""
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        # Queued bytes = in - out; each counter has one writer (the publishing thread,
        # the sender thread), so neither needs a lock.
        self._bytes_in = 0
        self._bytes_out = 0
        self._max_batch = max_batch
        self._max_message_bytes = max_message_bytes
        self._seqs = itertools.count(1)
        self._queue: deque[_Queued] = deque()
        self._closed = False
        # Held for a few bytecodes by publish(), and by the sender only to count a drop
        # (see _enqueue): it never waits on I/O.
        self._lock = threading.Lock()
        # The sender sets _idle before sleeping; publish() wakes it only then, so a busy
        # sender costs publish() nothing beyond a deque append. The wake-up is one byte
        # written to a pipe the sender's loop watches, by a write that keeps the GIL
        # (`_write_keeping_gil`): loop.call_soon_threadsafe's socket write would hand the
        # GIL to the sender in the middle of the engine's step.
        self._idle = False
        self._transport = transport or open_transport(self.url)
        self._loop = asyncio.new_event_loop()
        self._wakeup = asyncio.Event()
        pipe = _wake_pipe(self._loop, self._wakeup)
        self._wake_fd = -1 if pipe is None else pipe[0]
        self._close_pipe = weakref.finalize(self, _close_fds, *(pipe or ()))
        # Closed once nothing can write to it; not at exit, where a Publisher never
        # closed may still be in use (the process's exit closes them).
        self._close_pipe.atexit = False
        self._forked = False
        self._settled = 0  # accepted messages the sender has sent or dropped
        self._last_dropped = 0  # newest dropped seq
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"kvbus-publisher-{self.stream}", daemon=True
        )
        self._thread.start()
        self._sending: asyncio.Task[None] | None = None  # the sender, in the thread's loop
        self._sender = asyncio.run_coroutine_threadsafe(self._run_sender(), self._loop)
        instruments.track_publisher(self)
        _open_publishers.add(self)
        self.publish(
            SourceStarted(
                host=socket.gethostname(),
                pid=os.getpid(),
                kvbus_version=__version__,
                data_parallel_rank=data_parallel_rank,
            ),
            Kind.CONTROL,
        )

    # --- engine side: never blocks -------------------------------------------------

    def publish(self, payload: bytes | msgspec.Struct, kind: Kind = Kind.KV) -> bool:
        """Queue one message; returns False (and counts it) if it had to be dropped.

        ``payload`` is the engine's encoded bytes, or a msgspec Struct that the sender
        thread encodes the way vLLM does. Safe to call from any thread or event loop.
        """
        size = len(payload) if isinstance(payload, bytes) else _STRUCT_BYTES
        with self._lock:
            accepted = self._enqueue(payload, kind, size)
        if self._idle:
            self._wake_sender()
        return accepted

    def _enqueue(self, payload: bytes | msgspec.Struct, kind: Kind, size: int) -> bool:
        """publish() under ``_lock``: a seq is taken, counted and queued (or dropped) as
        one step, so that close() cannot slip in between the check and the append (the
        message would be accepted after the sender's last look at the queue), and
        counters written from several threads keep every increment."""
        if self._closed:  # the epoch ended with SourceStopped: no seq, no LossNotice
            self.stats.dropped += 1
            if self._forked:
                _limited.warning(
                    "forked",
                    "kvbus: dropped a message published in process %d through a Publisher "
                    "of stream %s opened before the fork; open a Publisher in the child",
                    os.getpid(),
                    self.stream,
                )
            return False
        seq = next(self._seqs)
        if (
            len(self._queue) >= self._max_queue
            or self._bytes_in + size - self._bytes_out > self._max_queue_bytes
        ):
            self.stats.dropped += 1
            self._last_dropped = seq
            return False
        self._bytes_in += size
        self._queue.append((seq, kind, payload, time.time()))
        self.stats.published += 1
        return True

    def announce_loss(self, count: int = 1) -> None:
        """Declare ``count`` messages lost upstream (a bridge whose source skipped
        messages it cannot recover): consumers get ``Resync(reason="dropped")`` before
        the next message, as for messages this publisher dropped. One seq stands for the
        whole loss, so this costs O(1) whatever ``count`` says."""
        with self._lock:
            self._last_dropped = next(self._seqs)
            self.stats.dropped += max(1, count)
        if self._idle:
            self._wake_sender()

    def _after_fork_in_child(self) -> None:
        """This process was forked while the Publisher was open. Its sender thread did
        not survive the fork, and its seqs belong to the parent, which sends what it had
        queued: here it is closed, and drops (counts, and logs) whatever is published.
        A lock a parent thread held at the fork would stay held here: it is replaced.
        The child's copies of the wake pipe are closed (the parent's stay open) and the
        loop is left alone: closing it would unregister the parent's pipe from the
        epoll instance they share."""
        self._lock = threading.Lock()
        self._closed = self._forked = True
        self._idle = False  # only the sender sets it: nothing here wakes a sender
        self._queue.clear()
        self._close_pipe()
        self._wake_fd = -1

    def _wake_sender(self) -> None:
        self._idle = False
        if self._wake_fd >= 0:
            _write_keeping_gil(self._wake_fd, b"\0", 1)
        else:  # releases the GIL: see __init__
            self._loop.call_soon_threadsafe(self._wakeup.set)

    # --- sender thread ---------------------------------------------------------------

    async def _run_sender(self) -> None:
        # A task whose cancel sticks: the backend's client may swallow the cancel close()
        # sends when it gives up (kvbus.shutdown), and the sender must end all the same.
        self._sending = cancel_sticks(self._send_forever(), name=f"kvbus-sender-{self.stream}")
        await self._sending

    async def _stop_sending(self) -> None:
        """Cancel the sender and give it `CLOSE_WITHIN` seconds to end."""
        sending = self._sending
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.wait([sending], timeout=CLOSE_WITHIN)

    async def _send_forever(self) -> None:
        last_sent = 0
        while True:
            batch = self._take_batch()
            if not batch and self._last_dropped > last_sent:
                # Nothing queued behind the newest drops: announce them now, under the
                # last dropped seq (which nothing else can use, so no race with publish()).
                notice = LossNotice(dropped=self.stats.dropped)
                batch = [(self._last_dropped, Kind.CONTROL, notice, time.time())]
                self._settled -= 1  # sending it settles nothing publish() accepted
            if not batch:
                # _closed is set under publish()'s lock: once it is seen, the queue only
                # shrinks, and an empty queue is final.
                if self._closed and not self._queue:
                    return
                self._idle = True
                # published, or a loss announced, between _take_batch and _idle = True
                if self._queue or self._last_dropped > last_sent:
                    self._idle = False
                    continue
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            records = []
            for seq, kind, payload, ts in batch:
                try:
                    envelope = Envelope(
                        SCHEMA_VERSION,
                        kind,
                        self.source,
                        self.epoch,
                        seq,
                        ts,
                        payload if isinstance(payload, bytes) else encode(payload),
                        lost_from=0 if seq == last_sent + 1 else last_sent + 1,
                    )
                    data = encode_envelope(envelope)
                except (TypeError, ValueError) as error:  # a payload msgspec cannot encode
                    self._drop_taken(seq, f"unencodable message {seq}: {error}")
                    continue
                if len(data) > self._max_message_bytes:
                    self._drop_taken(
                        seq,
                        f"message {envelope.msg_id} of {len(data)} bytes "
                        f"(max_message_bytes={self._max_message_bytes})",
                    )
                    continue
                records.append(Record(self.source, envelope.msg_id, data))
                last_sent = seq
            if records:
                await self._append(records)

    def _drop_taken(self, seq: int, what: str) -> None:
        """Drop a message the sender took from the queue; the next one sent carries
        the gap marker that announces it."""
        with self._lock:  # publish() counts drops too
            self.stats.dropped += 1
            self._last_dropped = max(self._last_dropped, seq)
        self._settled += 1
        log.error("kvbus: dropped %s", what)

    def _take_batch(self) -> list[_Queued]:
        batch: list[_Queued] = []
        queue = self._queue
        while queue and len(batch) < self._max_batch:
            batch.append(queue.popleft())
        self._bytes_out += sum(
            len(payload) if isinstance(payload, bytes) else _STRUCT_BYTES
            for _, _, payload, _ in batch
        )
        return batch

    async def _append(self, records: list[Record]) -> None:
        started = time.perf_counter()
        try:  # the usual case, without tenacity's per-call set-up (tens of µs a step)
            await self._append_all(records)
        except Exception as error:
            await self._append_retrying(records, error)
        self.append_latency.observe(time.perf_counter() - started)
        self.stats.sent += len(records)
        self._settled += len(records)

    async def _append_retrying(self, records: list[Record], error: Exception) -> None:
        """After the first attempt failed with ``error``: retry until the transport
        takes ``records`` (what of them it can), the first retry at once."""

        def count() -> None:
            self.stats.send_errors += 1

        what = f"append to {redact_url(self.url)}"
        count()
        log_failure(log, what, error, self.url)
        async for attempt in retry_forever(what, count, log, self.url):
            with attempt:
                await self._append_all(records)
        self.stats.reconnects += 1

    async def _append_all(self, records: list[Record]) -> None:
        """Append ``records``, dropping any the transport refuses as too large. Each is
        replaced in ``records`` itself by a `LossNotice` under its seq, with its gap
        marker: consumers learn of the loss at once (not after ``gap_timeout``, as a
        gap), and a retry after a later failure neither sends nor drops it again."""
        while records:
            try:
                await self._transport.append(self.stream, records)
                break
            except RecordTooLarge as error:  # nothing of this call was stored
                index = next(i for i, r in enumerate(records) if r.msg_id == error.msg_id)
                refused = decode_envelope(records[index].data)
                self._drop_taken(refused.seq, str(error))
                if refused.kind == Kind.CONTROL:  # a limit too small even for a notice
                    del records[index]
                    continue
                notice = encode(LossNotice(dropped=self.stats.dropped))
                envelope = msgspec.structs.replace(refused, kind=Kind.CONTROL, payload=notice)
                records[index] = Record(self.source, refused.msg_id, encode_envelope(envelope))
                self._settled -= 1  # sending it settles nothing publish() accepted

    @property
    def queue_messages(self) -> int:
        """Messages accepted by ``publish()`` and not yet handed to the transport."""
        return len(self._queue)

    @property
    def queue_bytes(self) -> int:
        return max(0, self._bytes_in - self._bytes_out)

    # --- lifecycle ---------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything published so far was handed to the transport."""
        deadline = time.monotonic() + timeout
        target = self.stats.published
        while time.monotonic() < deadline:
            if self._settled >= target:
                return True
            if self._sender.done() or self._forked:
                break
            time.sleep(0.001)
        return False

    async def aflush(self, timeout: float = 10.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Publish ``SourceStopped``, send what is queued (up to ``timeout`` seconds),
        close the transport and stop the sender thread. Idempotent.

        Ends within about ``timeout`` + 2 s whatever the backend does (a server down or
        stopped, a client that swallows a cancel): what is still unsent after
        ``timeout`` is counted in ``stats.dropped``, the sender is cancelled and given
        `CLOSE_WITHIN` seconds, and so is the transport's close."""
        with self._lock:
            if self._closed:
                return
            # The last message of the epoch: nothing is accepted after it.
            self._enqueue(SourceStopped(dropped=self.stats.dropped), Kind.CONTROL, _STRUCT_BYTES)
            self._closed = True
        self._wake_sender()
        try:
            self._sender.result(timeout)
        except (TimeoutError, concurrent.futures.CancelledError):  # the latter: aclose()
            self._sender.cancel()
            stopping = asyncio.run_coroutine_threadsafe(self._stop_sending(), self._loop)
            with contextlib.suppress(TimeoutError):
                stopping.result(2 * CLOSE_WITHIN)
            unsent = self.stats.published - self._settled
            with self._lock:
                self.stats.dropped += unsent
            log.error("kvbus: closed with %d messages unsent to %s", unsent, redact_url(self.url))
        what = f"transport {redact_url(self.url)}"
        close = asyncio.run_coroutine_threadsafe(
            close_within(self._transport.aclose(), what), self._loop
        )
        try:
            close.result(2 * CLOSE_WITHIN)
        except Exception:
            log.exception("kvbus: closing %s failed", what)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()  # the pipe is closed with the Publisher: see __init__

    async def aclose(self, timeout: float = 10.0) -> None:
        """`close` without blocking the event loop. Cancelled (a timeout around it,
        ``asyncio.run`` ending), it gives up on what is still queued at once rather
        than after ``timeout``, and waits up to about 2 s for the close to end."""
        closing = asyncio.ensure_future(asyncio.to_thread(self.close, timeout))
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            self._sender.cancel()  # close() stops waiting for the sender: see there
            await asyncio.wait([closing], timeout=3 * CLOSE_WITHIN)
            if closing.done() and not closing.cancelled() and closing.exception():
                log.error("kvbus: closing %r failed: %r", self, closing.exception())
            raise

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"Publisher({redact_url(self.url)!r}, stream={self.stream!r}, source={self.source!r})"
        )
