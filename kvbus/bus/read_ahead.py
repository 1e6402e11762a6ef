"""A subscription's live read: a task that reads the transport's pages ahead of the
consumer, retrying on errors, into an inbox bounded in entries and in bytes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

from kvbus.bus.retry import retry_forever
from kvbus.bus.sequencer import SubscriptionStats
from kvbus.config import redact_url
from kvbus.shutdown import cancel_sticks
from kvbus.transports import BackendUnusable, Entry, Position, Transport

log = logging.getLogger("kvbus.bus.subscription")

_END: Final = object()
INBOX_HIGH: Final = 1024
"""Entries read ahead at which the reader waits for the consumer..."""
INBOX_LOW: Final = 256
"""...until it is down to this many (and to ``INBOX_LOW_BYTES``)."""
INBOX_HIGH_BYTES: Final = 64 * 1024 * 1024
INBOX_LOW_BYTES: Final = 16 * 1024 * 1024

Page = tuple[Sequence[Entry], Position | None]
"""Entries read, with the position read just before them."""


class ReadAhead:
    """The reader task and its inbox. Pages are kept in a deque with two events rather
    than an asyncio.Queue: a replay moves hundreds of thousands of entries per second."""

    def __init__(
        self,
        transport: Transport,
        stream: str,
        url: str,
        stats: SubscriptionStats,
        *,
        follow: bool,
    ) -> None:
        self.transport = transport
        self.stream = stream
        self.url = url
        self.stats = stats
        self.follow = follow
        self.inbox: deque[Any] = deque()
        """Pages read and not taken yet (each with its size), then the end or the
        `BackendUnusable` that ended the read."""
        self.entries = 0
        """Entries in ``inbox``."""
        self.size = 0
        """Their bytes."""
        self._filled = asyncio.Event()
        self._drained = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None
        """The task reading, once started."""

    def start(self, after: Position | None) -> None:
        """Read the stream from after ``after`` (None: its start)."""
        self.reader = reader = cancel_sticks(self._read(after), name=f"kvbus-reader-{self.stream}")
        # A reader that ends without queueing the end (an error it did not retry) wakes
        # the consumer, who raises it (`wait`) instead of waiting for ever.
        reader.add_done_callback(lambda _task: self._filled.set())

    async def wait(self, deadline: float | None) -> None:
        """Until the inbox gets something, or the monotonic clock reaches ``deadline``."""
        assert self.reader is not None
        if self.reader.done():
            raise _reader_failure(self.reader)
        self._filled.clear()
        try:
            if deadline is None:
                await self._filled.wait()
            else:
                # asyncio.timeout, not wait_for: in 3.11 a wait_for timing out as its
                # task is cancelled can swallow the cancellation.
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._filled.wait()
        except TimeoutError:
            pass  # the caller sees the deadline passed

    async def take(self) -> Page | None:
        """The next page of the inbox (not empty), or None at the end of the stream;
        raises the `BackendUnusable` that ended the read."""
        item = self.inbox.popleft()
        if isinstance(item, BackendUnusable):
            raise item
        if item is _END:
            return None
        page, previous, size = item
        self.entries -= len(page)
        self.size -= size
        drained = self.entries <= INBOX_LOW and self.size <= INBOX_LOW_BYTES
        if drained and not self._drained.is_set():
            self._drained.set()
            # Let the reader ask for its next page now: the backend prepares it while
            # this one is ingested, not after.
            await asyncio.sleep(0)
        return page, previous

    def first_entry(self) -> Entry | None:
        """The oldest entry in the inbox, if any."""
        return next((e[0][0] for e in self.inbox if e is not _END and e[0]), None)

    async def aclose(self) -> None:
        reader = self.reader
        if reader is not None:
            # Its cancel sticks (kvbus.shutdown): it ends even when the backend's client
            # swallows the cancel mid-command (redis-py and nats-py can), as it does
            # when asyncio.run cancels a subscription never closed. Waited for with
            # asyncio.wait, which leaves a cancellation of this call to its caller.
            reader.cancel()
            await asyncio.wait([reader])
            if not reader.cancelled() and reader.exception() is not None:
                log.debug("kvbus: reader of %s ended with %r", self.stream, reader.exception())

    async def _read(self, previous: Position | None) -> None:
        """Feed the inbox from the transport, resuming after the last entry on errors."""

        def count() -> None:
            self.stats.transport_errors += 1

        retrying = retry_forever(f"reading {redact_url(self.url)}", count, log, self.url)
        try:
            await self._read_retrying(retrying, previous)
        except BackendUnusable as error:  # retrying cannot help: the consumer is told
            self.inbox.append(error)
        else:
            self.inbox.append(_END)
        self._filled.set()

    async def _read_retrying(self, retrying: Any, previous: Position | None) -> None:
        async for attempt in retrying:
            with attempt:
                pages = self.transport.read_pages(self.stream, previous, follow=self.follow)
                async for page in pages:
                    for piece, size in _pieces(page):
                        self.inbox.append((piece, previous, size))
                        self.entries += len(piece)
                        self.size += size
                        self._filled.set()
                        previous = piece[-1].position
                        if self.entries >= INBOX_HIGH or self.size >= INBOX_HIGH_BYTES:
                            # Let the consumer catch up: read ahead at most this much.
                            self._drained.clear()
                            await self._drained.wait()


def _reader_failure(reader: asyncio.Task[None]) -> BaseException:
    """What ended a subscription's reader that queued no end: its error, raised to the
    consumer (who may subscribe again from its cursor) rather than a silent hang."""
    error = None if reader.cancelled() else reader.exception()
    if error is not None:
        return error
    return ConnectionError("kvbus: the subscription's reader was cancelled from outside")


def _pieces(page: Sequence[Entry]) -> list[tuple[Sequence[Entry], int]]:
    """``page`` with its size in bytes, cut into pieces of about ``INBOX_LOW_BYTES`` if
    it is larger (an in-process transport hands over its whole history as one page),
    so that the read-ahead bound holds in bytes too."""
    sizes = [len(entry.data) for entry in page]
    size = sum(sizes)
    if size <= INBOX_LOW_BYTES:
        return [(page, size)]
    pieces: list[tuple[Sequence[Entry], int]] = []
    start = piece_size = 0
    for index, entry_size in enumerate(sizes):
        if index > start and piece_size + entry_size > INBOX_LOW_BYTES:
            pieces.append((page[start:index], piece_size))
            start = index
            piece_size = 0
        piece_size += entry_size
    pieces.append((page[start:], piece_size))
    return pieces
