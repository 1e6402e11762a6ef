"""`Publisher`: hands messages from engine code to a transport without ever blocking it.

``publish()`` runs on the caller's thread (vLLM's scheduler thread, or an event loop)
and only stamps a seq and appends to a bounded in-memory queue. A background thread
with its own event loop drains that queue in batches, wraps each message in an
`Envelope` and appends it to the transport, retrying with backoff while the backend is
down. When the queue is full the message is dropped and counted; its seq is still
used, so the next message sent carries ``lost_from`` and every consumer learns exactly
which seqs will never arrive.

On an in-process bus (memory://, whose append neither waits nor fails) ``publish()``
sends each message itself instead, on the caller's thread: the same envelopes, gap
markers and order, without waking the thread (`Transport.inline_append`).

The queue between the two threads is `kvbus.bus.publisher_queue`; the sender thread's work,
`kvbus.bus.publisher_sender`; this module holds what callers see.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

import msgspec

from kvbus._version import __version__
from kvbus.bus import instruments
from kvbus.bus.publisher_queue import STRUCT_BYTES, SendQueue
from kvbus.bus.publisher_sender import Sender
from kvbus.bus.publisher_stats import PublisherStats as PublisherStats
from kvbus.config import redact_url, resolve_source, resolve_stream, resolve_url
from kvbus.shutdown import CLOSE_WITHIN, close_within
from kvbus.transports import Transport, open_transport
from kvbus.transports.packing import DEFAULT_RECORDS
from kvbus.wire.envelope import Kind
from kvbus.wire.events import SourceStarted, SourceStopped

log = logging.getLogger("kvbus.bus.publisher")


class Relayed(msgspec.Struct, frozen=True):
    """A `Publisher` that relays another process's epoch (`kvbus.bus.relay`): messages
    come through `Publisher.forward` under that process's seqs, and ``after`` of them
    were sent before (by a relay that died); the sender's first gap marker announces
    what that one lost. ``on_sent`` is told, after each append, the newest seq sent and
    how many messages went."""

    epoch: int
    after: int = 0
    on_sent: Callable[[int, int], object] | None = None


DEFAULT_MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024
DEFAULT_MAX_QUEUE_BYTES: Final = 64 * 1024 * 1024

_open_publishers: weakref.WeakSet[Publisher] = weakref.WeakSet()


def _publishers_after_fork_in_child() -> None:
    for publisher in list(_open_publishers):
        publisher._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_publishers_after_fork_in_child)


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
        relayed: Relayed | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.stream = resolve_stream(stream)
        self.source = resolve_source(source)
        self.epoch = relayed.epoch if relayed is not None else time.time_ns()
        self.stats = PublisherStats()
        self.append_latency = instruments.LatencyHistogram()
        """Seconds from an append's first try to the transport's acknowledgement."""
        self._transport = transport or open_transport(self.url)
        self._loop = asyncio.new_event_loop()
        self._queue = SendQueue(
            self.stats,
            self._loop,
            stream=self.stream,
            max_queue=max_queue,
            max_queue_bytes=max_queue_bytes,
            max_batch=max_batch,
        )
        self._sender = Sender(
            self._queue,
            self._transport,
            self.stats,
            self.append_latency,
            url=self.url,
            stream=self.stream,
            source=self.source,
            epoch=self.epoch,
            max_message_bytes=max_message_bytes,
            start_after=relayed.after if relayed is not None else 0,
            on_sent=relayed.on_sent if relayed is not None else None,
        )
        if relayed is not None:
            self._queue.resume(relayed.after)
        self._inline = self._transport.inline_append is not None
        """On an in-process bus (memory://), ``publish()`` stores each message itself
        (`Sender.send_inline`): waking the sender thread for it would cost the engine's
        process more than the append (``bench/bench_engine_cost.py``)."""
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"kvbus-publisher-{self.stream}", daemon=True
        )
        self._thread.start()
        # The sender's run in the thread's loop: done once it sent SourceStopped.
        self._running = asyncio.run_coroutine_threadsafe(self._sender.run(), self._loop)
        instruments.track_publisher(self)
        _open_publishers.add(self)
        if relayed is not None:
            return  # the epoch's SourceStarted is the relayed process's
        self.publish(
            SourceStarted(
                host=socket.gethostname(),
                pid=os.getpid(),
                kvbus_version=__version__,
                data_parallel_rank=data_parallel_rank,
            ),
            Kind.CONTROL,
        )

    # --- engine side: never blocks (kvbus.bus.publisher_queue) ------------------------------

    def publish(self, payload: bytes | msgspec.Struct, kind: Kind = Kind.KV) -> bool:
        """Queue one message; returns False (and counts it) if it had to be dropped.

        ``payload`` is the engine's encoded bytes, or a msgspec Struct that the sender
        thread encodes the way vLLM does. Safe to call from any thread or event loop.
        """
        size = len(payload) if isinstance(payload, bytes) else STRUCT_BYTES
        queue = self._queue
        with queue.lock:
            accepted = queue.enqueue(payload, kind, size)
        self._hand_over(accepted)
        return accepted

    def forward(self, seq: int, kind: Kind, payload: bytes, ts: float) -> bool:
        """Queue another process's message under its own ``seq`` of this epoch (a relay:
        see ``relayed``); False if it is dropped, or older than a seq already taken."""
        queue = self._queue
        with queue.lock:
            accepted = queue.enqueue(payload, kind, len(payload), seq, ts)
        self._hand_over(accepted)
        return accepted

    def _hand_over(self, accepted: bool) -> None:
        if self._inline:
            if accepted:  # an in-process bus: stored here, no thread woken
                self._sender.send_inline()
        elif self._queue.idle:
            self._queue.wake()

    def announce_loss(self, count: int = 1) -> None:
        """Declare ``count`` messages lost upstream (a bridge whose source skipped
        messages it cannot recover): consumers get ``Resync(reason="dropped")`` before
        the next message, as for messages this publisher dropped. One seq stands for the
        whole loss, so this costs O(1) whatever ``count`` says."""
        self._queue.announce_loss(count)

    def _after_fork_in_child(self) -> None:
        """This process was forked while the Publisher was open. Its sender thread did
        not survive the fork, and its seqs belong to the parent, which sends what it had
        queued: here it is closed, and drops (counts, and logs) whatever is published.
        The loop is left alone: closing it would unregister the parent's wake pipe from
        the epoll instance they share."""
        self._queue.after_fork_in_child()

    @property
    def queue_messages(self) -> int:
        """Messages accepted by ``publish()`` and not yet handed to the transport."""
        return self._queue.messages

    @property
    def queue_bytes(self) -> int:
        return self._queue.bytes

    # --- lifecycle ---------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything published so far was handed to the transport."""
        deadline = time.monotonic() + timeout
        target = self.stats.published
        while time.monotonic() < deadline:
            if self._sender.settled >= target:
                return True
            if self._running.done() or self._queue.forked:
                break
            time.sleep(0.001)
        return False

    async def aflush(self, timeout: float = 10.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout)

    def close(self, timeout: float = 10.0, stopped: bool = False) -> None:
        """Publish ``SourceStopped``, send what is queued (up to ``timeout`` seconds),
        close the transport and stop the sender thread. Idempotent. ``stopped``: the
        epoch already ended (a relay forwarded its process's ``SourceStopped``).

        Ends within about ``timeout`` + 2 s whatever the backend does (a server down or
        stopped, a client that swallows a cancel): what is still unsent after
        ``timeout`` is counted in ``stats.dropped``, the sender is cancelled and given
        `CLOSE_WITHIN` seconds, and so is the transport's close."""
        queue = self._queue
        with queue.lock:
            if queue.closed:
                return
            if not stopped:  # the last message of the epoch: nothing is accepted after it
                stop = SourceStopped(dropped=self.stats.dropped)
                queue.enqueue(stop, Kind.CONTROL, STRUCT_BYTES)
            queue.closed = True
        queue.wake()
        try:
            self._running.result(timeout)
        except (TimeoutError, concurrent.futures.CancelledError):  # the latter: aclose()
            self._running.cancel()
            stopping = asyncio.run_coroutine_threadsafe(self._sender.stop(), self._loop)
            with contextlib.suppress(TimeoutError):
                stopping.result(2 * CLOSE_WITHIN)
            unsent = self.stats.published - self._sender.settled
            with queue.lock:
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
            self._loop.close()  # the wake pipe is closed with the SendQueue, not here

    async def aclose(self, timeout: float = 10.0) -> None:
        """`close` without blocking the event loop. Cancelled (a timeout around it,
        ``asyncio.run`` ending), it gives up on what is still queued at once rather
        than after ``timeout``, and waits up to about 2 s for the close to end."""
        closing = asyncio.ensure_future(asyncio.to_thread(self.close, timeout))
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            self._running.cancel()  # close() stops waiting for the sender: see there
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
