"""``memory://[NAME][?maxlen=N]``: an in-process bus, for tests and single-process use.

Every transport opened with the same NAME in one process shares the same streams,
whatever thread or event loop uses it (the publisher's sender runs in its own thread).
Each stream keeps its newest ``maxlen`` entries (default 100,000); a reader that falls
further behind than that resumes at the oldest retained entry, and the subscriber
reports what was trimmed as an unrecoverable gap.

Delivery: an append is durable for the life of the process; reads never skip a
retained entry.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from urllib.parse import parse_qs, urlsplit

from kvbus.transports import LATEST, Entry, Position, Record, Transport, entries_of

from kvbus.config import redact_url

DEFAULT_MAXLEN = 100_000


class _Stream:
    """A bounded log shared across threads; positions count appends from 1."""

    def __init__(self, maxlen: int) -> None:
        self.lock = threading.Lock()
        self.entries: deque[Entry] = deque(maxlen=maxlen)
        self.times: deque[float] = deque(maxlen=maxlen)
        """when each retained entry was appended (wall clock), for `position_at`"""
        self.last_position = 0
        self.snapshots: dict[str, bytes] = {}
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def append(self, records: Sequence[Record]) -> None:
        with self.lock:
            now = time.time()
            for record in records:
                self.last_position += 1
                self.entries.append(Entry(self.last_position, record.data))
                self.times.append(now)
            waiters, self.waiters = self.waiters, []
        for loop, future in waiters:
            # A reader whose loop has closed needs no wake-up; the error must not reach
            # the appender (a publisher's caller, on memory://: see `inline_append`).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, future)

    def after(self, position: int) -> list[Entry]:
        """Retained entries after ``position`` (all retained ones if it was trimmed)."""
        with self.lock:
            if not self.entries or position >= self.last_position:
                return []
            first = int(self.entries[0].position)
            start = max(0, position + 1 - first)
            count = len(self.entries)
            # deque indexing walks from the nearer end: cheap for a live tail near the
            # end, quadratic for a long history read, which islice does in one pass.
            if start > count // 2:
                return [self.entries[i] for i in range(start, count)]
            return list(itertools.islice(self.entries, start, None))

    def position_at(self, wall_time: float) -> int:
        """The position just before the first entry appended at or after ``wall_time``."""
        with self.lock:
            # Appends are in time order, bar a clock stepping back: near enough.
            first = bisect.bisect_left(self.times, wall_time)
            if first >= len(self.entries):
                return self.last_position
            return int(self.entries[first].position) - 1

    def wait_after(self, position: int) -> asyncio.Future[None] | None:
        """A future resolved on the next append, or None if there is already news."""
        loop = asyncio.get_running_loop()
        with self.lock:
            if self.last_position > position:
                return None
            future: asyncio.Future[None] = loop.create_future()
            self.waiters.append((loop, future))
            return future


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_buses: dict[str, dict[str, _Stream]] = {}
_buses_lock = threading.Lock()


class MemoryTransport(Transport):
    def __init__(self, url: str = "memory://") -> None:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        self.maxlen = int(query.get("maxlen", [DEFAULT_MAXLEN])[0])
        if self.maxlen < 1:
            raise ValueError(f"maxlen must be >= 1 in {redact_url(url)}")
        with _buses_lock:
            self._streams = _buses.setdefault(parts.netloc or "default", {})

    def _stream(self, name: str) -> _Stream:
        with _buses_lock:
            stream = self._streams.get(name)
            if stream is None:
                stream = self._streams[name] = _Stream(self.maxlen)
            return stream

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        self._append_inline(stream, records)

    @property
    def inline_append(self) -> Callable[[str, Sequence[Record]], None] | None:
        # A subclass that overrides `append` (to stall or refuse it, in tests) is
        # appended to through that, never around it.
        if type(self).append is not MemoryTransport.append:
            return None
        return self._append_inline

    def _append_inline(self, stream: str, records: Sequence[Record]) -> None:
        self._stream(stream).append(records)

    async def put_snapshot(self, stream: str, name: str, data: bytes) -> None:
        log = self._stream(stream)
        with log.lock:
            log.snapshots[name] = data

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        log = self._stream(stream)
        with log.lock:
            return dict(log.snapshots)

    async def position_at(self, stream: str, wall_time: float) -> Position | None:
        return self._stream(stream).position_at(wall_time)

    def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        # This class's pages, not a subclass's: those may be built on this very read.
        return entries_of(MemoryTransport.read_pages(self, stream, after, follow=follow))

    async def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        log = self._stream(stream)
        if after == LATEST:
            position = log.last_position
        else:
            position = int(after or 0)
        end = log.last_position
        while True:
            page = log.after(position)
            if not follow and page and int(page[-1].position) > end:
                page = [entry for entry in page if int(entry.position) <= end]
            if page:
                position = int(page[-1].position)
                yield page
            if not follow:
                return
            future = log.wait_after(position)
            if future is not None:
                await future
