"""``kvbus compact``: fold the kv stream and store its snapshots (see `kvbus.snapshot`).

A source's fold holds at most ``max_copies`` copies of a block and ``max_blocks`` copies
in all (`kvbus.snapshot.DEFAULT_MAX_COPIES`, `kvbus.snapshot.DEFAULT_MAX_BLOCKS`): a
source that claims more gets no snapshot until it clears its cache or starts a new epoch
(counted in ``Compactor.overflowed_sources``, logged at most once a second); stores past
the copy cap are counted in ``Compactor.capped_copies``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from kvbus.config import resolve_stream, resolve_url
from kvbus.events import AllBlocksCleared, KVEventBatch, SourceStarted, encode
from kvbus.logs import LimitedLog, shown
from kvbus.snapshot import (
    CURSOR_NAME,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_MAX_COPIES,
    Snapshot,
    SourceFold,
    encode_snapshot,
)
from kvbus.subscribe import Cursor, Message, Resync, ResyncReason, subscribe
from kvbus.transports import Transport, open_transport

log = logging.getLogger("kvbus.compact")
_limited = LimitedLog(log)

DEFAULT_INTERVAL: Final = 10.0


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
        self.interval = interval
        self.max_copies = max_copies
        self.max_blocks = max_blocks
        self._transport = transport or open_transport(self.url)
        self.folds: dict[str, SourceFold] = {}
        self._inexact: set[str] = set()  # folds a gap made wrong, until the next epoch
        self._changed: set[str] = set()
        self.written = 0
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

    async def run(self, *, follow: bool = True) -> None:
        """Fold the stream (from the stored snapshots, if any) and store snapshots every
        ``interval`` seconds and at the end; with ``follow=False``, until the end of
        the stream."""
        if type(self._transport).put_snapshot is Transport.put_snapshot:
            scheme = self.url.partition(":")[0]
            served = " (a zmq:// publisher serves its own)" if scheme == "zmq" else ""
            raise NotImplementedError(f"{scheme}:// keeps no snapshots{served}")
        self._capped_before = self.capped_copies
        self.folds.clear()  # the snapshots the subscription starts from rebuild them
        sub = subscribe(
            self.stream, self.url, snapshot=True, follow=follow, transport=self._transport
        )
        next_write = time.monotonic() + self.interval
        try:
            async for item in sub:
                self.apply(item)
                if time.monotonic() >= next_write:
                    await self.write(sub.cursor)
                    next_write = time.monotonic() + self.interval
            await self.write(sub.cursor)
        finally:
            await sub.aclose()

    async def write(self, cursor: Cursor) -> None:
        """Store the snapshots of the sources that changed, then the cursor."""
        changed, self._changed = self._changed, set()
        for source in sorted(changed):
            at = cursor.sources.get(source)
            if source in self._inexact or at is None or self.folds[source].overflowed:
                continue
            batch = KVEventBatch(time.time(), self.folds[source].events())
            snapshot = Snapshot(source, at.epoch, at.seq, at.position, time.time(), encode(batch))
            await self._transport.put_snapshot(self.stream, source, encode_snapshot(snapshot))
            self.written += 1
        await self._transport.put_snapshot(self.stream, CURSOR_NAME, cursor.to_bytes())


async def compact(url: str | None, stream: str | None, interval: float, follow: bool) -> int:
    """``kvbus compact``: run a compactor until interrupted (or the stream's end)."""
    compactor = Compactor(url, stream, interval)
    try:
        await compactor.run(follow=follow)
    except NotImplementedError as error:
        log.error("kvbus compact: %s", error)
        return 2
    except asyncio.CancelledError:
        pass
    print(f"kvbus compact: {compactor.written} snapshots written")
    return 0


__all__ = ["Compactor", "compact"]
