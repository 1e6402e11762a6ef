"""``kvbus compact``: fold the kv stream and store its snapshots (see `kvbus.wire.snapshot`).

A source's fold holds at most ``max_copies`` copies of a block and ``max_blocks`` copies
in all (`kvbus.wire.snapshot.DEFAULT_MAX_COPIES`, `kvbus.wire.snapshot.DEFAULT_MAX_BLOCKS`): a
source that claims more gets no snapshot until it clears its cache or starts a new epoch
(counted in ``Compactor.overflowed_sources``, logged at most once a second); stores past
the copy cap are counted in ``Compactor.capped_copies``.

Snapshots are written every ``interval`` seconds by a timer of their own, whether items
arrive or not (a stream that goes quiet has its last changes stored on time, not when its
next item comes), and only what changed since the previous write. A write that fails (the
server down) is counted in ``Compactor.write_errors`` and retried at the next interval.
On close or cancel the changes not yet written are written once more, for at most
`LAST_WRITE_WITHIN` seconds: ``kvbus compact`` still ends within a second of SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from kvbus.bus.follow import Follower
from kvbus.bus.subscription import Cursor, Message, Resync, ResyncReason
from kvbus.config import resolve_stream, resolve_url
from kvbus.logs import LimitedLog, shown
from kvbus.shutdown import cancel_sticks, raise_if_cancelling
from kvbus.transports import Transport, open_transport
from kvbus.wire.events import AllBlocksCleared, KVEventBatch, SourceStarted, encode
from kvbus.wire.snapshot import (
    CURSOR_NAME,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_MAX_COPIES,
    Snapshot,
    SourceFold,
    encode_snapshot,
)

log = logging.getLogger("kvbus.ops.compact")
_limited = LimitedLog(log)

DEFAULT_INTERVAL: Final = 10.0
LAST_WRITE_WITHIN: Final = 0.5
"""Seconds a cancelled compactor gives its last write (a server stopped or cut would
hold it for ever): half of `kvbus.cli.SHUTDOWN_GRACE`, leaving the rest to closing."""


class Compactor:
    """Folds the kv stream of ``url`` and stores its snapshots every ``interval`` s."""

    def __init__(
        self,
        url: str | None = None,
        stream: str | None = None,
        interval: float = DEFAULT_INTERVAL,
        transport: Transport | None = None,
        *,
        max_copies: int = DEFAULT_MAX_COPIES,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        self.url = resolve_url(url)
        self.stream = resolve_stream(stream)
        if not interval > 0:
            raise ValueError(f"the interval must be positive, not {interval!r}")
        self.interval = interval
        self.max_copies = max_copies
        self.max_blocks = max_blocks
        self._transport = transport or open_transport(self.url)
        self.folds: dict[str, SourceFold] = {}
        self._inexact: set[str] = set()  # folds a gap made wrong, until the next epoch
        self._changed: set[str] = set()  # sources whose snapshot is not written yet
        self._cursor_moved = False  # items applied since the cursor was last written
        self._writing = asyncio.Lock()  # held by a write: no item is applied meanwhile
        self.written = 0
        self.write_errors = 0
        """Writes that failed (the server down, cut): retried at the next interval."""
        self.overflowed_sources = 0
        """Times a source claimed more than ``max_blocks`` copies (no snapshot for it
        until it clears its cache or starts a new epoch)."""
        self._capped_before = 0  # capped_copies of folds replaced since

    @property
    def capped_copies(self) -> int:
        """Stores of a block already held ``max_copies`` times, not counted."""
        return self._capped_before + sum(f.capped_copies for f in self.folds.values())

    def _new_fold(self, source: str) -> SourceFold:
        old = self.folds.get(source)
        if old is not None:
            self._capped_before += old.capped_copies
        fold = self.folds[source] = SourceFold(self.max_copies, self.max_blocks)
        return fold

    def apply(self, item: Message | Resync) -> None:
        source = item.source
        self._cursor_moved = True
        if isinstance(item, Resync):
            self._new_fold(source)
            if item.reason is ResyncReason.NEW_EPOCH:
                self._inexact.discard(source)
            else:  # what the lost seqs did is unknown: no snapshot until a clear or epoch
                self._inexact.add(source)
            self._changed.add(source)
            return
        fold = self.folds.get(source) or self._new_fold(source)
        if isinstance(item.body, KVEventBatch):
            overflowed = fold.overflowed
            fold.apply(item.body.events)
            if any(isinstance(e, AllBlocksCleared) for e in item.body.events):
                self._inexact.discard(source)  # an empty cache is known state again
            if fold.overflowed and not overflowed:
                self.overflowed_sources += 1
                _limited.warning(
                    "overflow",
                    "kvbus compact: source %s claims more than %d cached blocks: "
                    "no snapshot for it until it clears its cache or restarts",
                    shown(source),
                    self.max_blocks,
                )
        elif isinstance(item.body, SourceStarted):
            self._new_fold(source)
            self._inexact.discard(source)
        else:
            return
        self._changed.add(source)

    @property
    def changed(self) -> bool:
        """Whether something was applied since the last write."""
        return self._cursor_moved or bool(self._changed)

    async def run(self, *, follow: bool = True) -> None:
        """Fold the stream (from the stored snapshots, if any) and store snapshots every
        ``interval`` seconds, items or not, and at the end (on a cancel too, for at most
        `LAST_WRITE_WITHIN` s); with ``follow=False``, until the end of the stream."""
        if type(self._transport).put_snapshot is Transport.put_snapshot:
            scheme = self.url.partition(":")[0]
            served = " (a zmq:// publisher serves its own)" if scheme == "zmq" else ""
            raise NotImplementedError(f"{scheme}:// keeps no snapshots{served}")
        self._capped_before = self.capped_copies
        self.folds.clear()  # the snapshots the subscription starts from rebuild them
        self._changed.clear()  # and mark their sources changed again
        self._writing = asyncio.Lock()  # of this run's event loop
        # The timer's write takes the cursor, then stores the folds: they must stay as
        # they were until it is done (`pause`). A bad item is an error; so is a failure
        # of the bus. The snapshots are written through the subscription's transport.
        reader = Follower(
            self.stream, self.url, self.apply, snapshot=True, pause=self._writing,
            transport=self._transport,
        )  # fmt: skip
        timer = cancel_sticks(self._write_on_time(reader), name=f"kvbus-compact-{self.stream}")
        try:
            await (reader.follow() if follow else reader.replay())
            async with self._writing:  # no write in flight: the timer is only waiting
                timer.cancel()
                await self._write_changes(reader.cursor)
        except asyncio.CancelledError:
            await self._write_last(timer, reader)
            raise
        finally:
            timer.cancel()
            await reader.aclose()

    async def _write_on_time(self, reader: Follower) -> None:
        """Every ``interval`` seconds, write what changed (the cursor taken with no
        item between its yield and its fold: see `run`)."""
        while True:
            await asyncio.sleep(self.interval)
            async with self._writing:
                try:
                    await self._write_changes(reader.cursor)
                except Exception as error:  # a server down, a refusal: retried next time
                    raise_if_cancelling()  # a client library can turn a cancel into this
                    self.write_errors += 1
                    _limited.warning(
                        "write",
                        "kvbus compact: storing the snapshots of %s failed (%r); retried in %g s",
                        self.stream,
                        error,
                        self.interval,
                    )

    async def _write_last(self, timer: asyncio.Task[None], reader: Follower) -> None:
        """On a cancel: stop the timer and write what changed, within
        `LAST_WRITE_WITHIN` seconds, in a task of its own (this one is being cancelled:
        a client library may refuse to start a command in it). Never raises."""

        async def stop_timer_then_write() -> None:
            timer.cancel()
            await asyncio.wait([timer])  # a write it was making is undone: done again here
            if self.changed:
                await self._write_changes(reader.cursor)

        last = cancel_sticks(stop_timer_then_write(), name=f"kvbus-compact-last-{self.stream}")
        try:
            done, _ = await asyncio.wait([last], timeout=LAST_WRITE_WITHIN)
        except asyncio.CancelledError:  # cancelled again: give the write up now
            done = set()
        if not done:
            last.cancel()
            log.warning(
                "kvbus compact: the last snapshots of %s were not stored within %g s; left",
                self.stream,
                LAST_WRITE_WITHIN,
            )
        elif not last.cancelled() and last.exception() is not None:
            self.write_errors += 1
            log.warning(
                "kvbus compact: storing the last snapshots of %s failed: %r",
                self.stream,
                last.exception(),
            )

    async def _write_changes(self, cursor: Cursor) -> None:
        if self.changed:
            await self.write(cursor)

    async def write(self, cursor: Cursor) -> None:
        """Store the snapshots of the sources that changed, then the cursor. A source
        stays changed until its snapshot is stored: a write cut short by an error or a
        cancel is made again by the next one. The folds must not change meanwhile."""
        self._cursor_moved = False
        try:
            for source in sorted(self._changed):
                at = cursor.sources.get(source)
                fold = self.folds.get(source)
                if source in self._inexact or at is None or fold is None or fold.overflowed:
                    self._changed.discard(source)  # nothing to store until it changes again
                    continue
                batch = KVEventBatch(time.time(), fold.events())
                payload = encode(batch)
                snapshot = Snapshot(source, at.epoch, at.seq, at.position, time.time(), payload)
                await self._transport.put_snapshot(self.stream, source, encode_snapshot(snapshot))
                self._changed.discard(source)
                self.written += 1
            await self._transport.put_snapshot(self.stream, CURSOR_NAME, cursor.to_bytes())
        except BaseException:
            self._cursor_moved = True  # the cursor is not stored: the next write stores it
            raise


async def compact(
    url: str | None,
    stream: str | None,
    interval: float,
    follow: bool,
    *,
    max_copies: int = DEFAULT_MAX_COPIES,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> int:
    """``kvbus compact``: run a compactor until interrupted (or the stream's end), then
    print what it did in one line."""
    compactor = Compactor(url, stream, interval, max_copies=max_copies, max_blocks=max_blocks)
    try:
        await compactor.run(follow=follow)
    except NotImplementedError as error:
        log.error("kvbus compact: %s", error)
        return 2
    except asyncio.CancelledError:
        pass
    print(summary(compactor), flush=True)
    return 0


def summary(compactor: Compactor) -> str:
    """One line: what ``compactor`` stored, and what its caps left out."""
    line = (
        f"kvbus compact: snapshots written: {compactor.written} "
        f"({_count(len(compactor.folds), 'source')} folded); capped: "
        f"{_count(compactor.capped_copies, 'block copy', 'block copies')} over --max-copies, "
        f"{_count(compactor.overflowed_sources, 'source')} over --max-blocks (no snapshot)"
    )
    if compactor.write_errors:
        line += f"; {_count(compactor.write_errors, 'failed write')}"
    return line


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


__all__ = ["LAST_WRITE_WITHIN", "Compactor", "compact", "summary"]
