"""`subscribe()`: ordered, deduplicated delivery with gap repair, over any transport.

The transport yields envelopes in its own stream order. For each source this module
delivers that source's messages in seq order, exactly once, and turns everything that
would silently corrupt a consumer's state into an explicit `Resync`:

* a seq that is skipped is held back while the transport's history is searched for
  the missing ones; if they are not there within ``gap_timeout`` they are declared
  lost (``Resync(reason=GAP)``), and delivery continues after them;
* a message with a gap marker (``lost_from``) tells that the publisher dropped those
  seqs: no waiting, ``Resync(reason=DROPPED)``; so does a ``LossNotice``, whose own
  seq is among them;
* a new epoch means the source restarted: ``Resync(reason=NEW_EPOCH)`` comes before
  the new epoch's first message; messages of older epochs are dropped as stale.

These rules are decided in `kvbus.bus.sequencer` (a pure state machine, tested alone);
`Subscription` drives it: it reads the transport ahead of the consumer
(`kvbus.bus.read_ahead`), has each entry checked and fed to it (`kvbus.bus.intake`), carries out
the history searches and snapshot substitutions (`kvbus.bus.stored_snapshots`) the sequencer
asks for, and hands out what it answers with (`kvbus.bus.message`).

A consumer resets its state for ``Resync.source`` and carries on. ``Subscription.cursor``
says what has been yielded so far; pass it back as ``cursor=`` after a restart to
resume with nothing lost and nothing yielded twice.

Bad input (oversized, undecodable, nested too deep, newer schema, unknown kind or
event type) is counted in ``Subscription.stats``, logged (at most once a second per
kind) and skipped; the iteration never fails on it. A payload that fails to decode in
the middle of a source's sequence is a ``Resync(reason=MALFORMED)`` for that source, since
its effect on the consumer's state is lost. Whatever numbers a message carries, it costs
O(1) time and memory:

* an envelope whose epoch is ahead of this machine's clock by more than
  ``max_clock_skew``, or whose seq is more than a publisher could have reached since its
  epoch began (10 million messages a second), is rejected as implausible;
* missing seqs are a range, never a set; a source holding more than 65,536 messages
  back declares its gap lost at once, and when the messages held back for all gaps
  exceed ``max_held_bytes`` (default 64 MiB) the oldest gaps are declared lost early
  (``SubscriptionStats.gaps_declared_early``), each with its Resync;
* gaps are searched for in history once each, in one pass for all the sources whose
  gaps are new: from the earliest gapped source's position up to the newest message
  held back for them, ending as soon as nothing is missing. A subscription reads at
  most one history entry for such searches per entry it read live, beyond an allowance
  of 65,536, and starts only when it may read 4,096 at least
  (``SubscriptionStats.repair_entries``; a search cut short or skipped for it counts in
  ``repairs_limited``, and its gaps are declared lost when they expire);
* at most ``max_sources`` sources are tracked, whether or not they hold messages back:
  beyond that the least recently active one is forgotten, in O(1) amortized (one
  holding messages back first has its gap declared lost; one that comes back gets a
  ``Resync(reason=JOINED)``);
* with ``snapshot=True``, expiring gaps read the stored snapshots at most once a
  second, and check only the snapshots of the sources involved, off the event loop;
* a Resync is logged at INFO at most once a second per reason, with the count of those
  left unlogged (all are counted in ``SubscriptionStats.resyncs``);
* an envelope that claims a source other than the one the transport authenticated
  (`Entry.sender`: the NATS subject) is rejected as forged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable
from typing import Any, Final, Literal

import msgspec

from kvbus.bus import instruments
from kvbus.bus.intake import MAX_SOURCE_LENGTH as MAX_SOURCE_LENGTH
from kvbus.bus.intake import EnvelopeChecks, PageIngest
from kvbus.bus.message import Body as Body
from kvbus.bus.message import Cursor, Message, SourceCursor
from kvbus.bus.message import Item as Item
from kvbus.bus.read_ahead import ReadAhead
from kvbus.bus.sequencer import (
    REPAIR_ALLOWANCE,
    HistorySearch,
    Resync,
    ResyncReason,
    Sequencer,
    SourceState,
    SubscriptionStats,
)
from kvbus.bus.stored_snapshots import StoredSnapshots
from kvbus.config import resolve_stream, resolve_url
from kvbus.logs import LimitedLog
from kvbus.shutdown import close_within
from kvbus.transports import LATEST, Position, Transport, open_transport
from kvbus.wire.envelope import ENVELOPE_DECODER
from kvbus.wire.events import decode_kv_batch

log = logging.getLogger("kvbus.bus.subscription")
_limited = LimitedLog(log)
"""Every bad-input and resync line of a subscription, read when it starts (a test may
put another in its place)."""

DEFAULT_GAP_TIMEOUT: Final = 0.5
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
DEFAULT_MAX_SOURCES: Final = 10_000
DEFAULT_MAX_CLOCK_SKEW: Final = 60.0
DEFAULT_MAX_HELD_BYTES: Final = 64 * 1024 * 1024
_REPAIR_ALLOWANCE: Final = REPAIR_ALLOWANCE
"""`kvbus.bus.sequencer.REPAIR_ALLOWANCE`, read when a subscription starts."""
_SNAPSHOTS_REUSED_FOR: Final = 1.0
"""Seconds the stored snapshots read for an expiring gap serve later ones (snapshot
mode): reading them all again per gap would cost O(all snapshots) per hostile message.
Read when a subscription starts, as is ``decode_kv_batch`` for the snapshots' batches."""


class Subscription:
    """Async iterator of `Message` and `Resync`; see the module docstring."""

    def __init__(
        self,
        stream: str | None = None,
        url: str | None = None,
        sources: Collection[str] | None = None,
        cursor: Cursor | bytes | str | Literal["latest"] | None = None,
        *,
        follow: bool = True,
        gap_timeout: float = DEFAULT_GAP_TIMEOUT,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_sources: int = DEFAULT_MAX_SOURCES,
        max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        snapshot: bool = False,
        transport: Transport | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.stream = resolve_stream(stream)
        self.sources = frozenset(sources) if sources is not None else None
        self.stats = SubscriptionStats()
        self._transport = transport or open_transport(self.url)
        # What was yielded last per source: a message stands for its SourceCursor.
        self._yielded: dict[str, SourceCursor | Message] = {}
        # Which entries count, and the message each becomes.
        self._checks = EnvelopeChecks(
            self.stats,
            self.stream,
            self.sources,
            max_message_bytes=max_message_bytes,
            max_clock_skew=max_clock_skew,
            limited_log=_limited,
        )
        self._undecoded = self._checks.undecoded
        # The ordering rules; this class feeds it what the transport brings.
        self._sequencer: Sequencer[Message] = Sequencer(
            self._checks.open_message,
            self.stats,
            gap_timeout=gap_timeout,
            max_sources=max_sources,
            max_held_bytes=max_held_bytes,
            repair_allowance=_REPAIR_ALLOWANCE,
            on_forget=self._forget,
            stream=self.stream,
            limited_log=_limited,
        )
        # Items to yield, each with its entry's arrival order and the position read just
        # before it (None for items not from the live read), for `cursor`.
        self._ready = self._sequencer.ready
        self._snapshots = (
            StoredSnapshots(
                self._transport,
                self._checks,
                self._sequencer,
                decode_batch=decode_kv_batch,
                reuse_for=_SNAPSHOTS_REUSED_FOR,
                limited_log=_limited,
            )
            if snapshot
            else None
        )
        if cursor == "latest":
            self._start: Position | None = LATEST
        elif cursor is None:
            self._start = None
        else:
            if not isinstance(cursor, Cursor):
                cursor = Cursor.from_bytes(cursor)
            self._start = cursor.position
            for name, c in cursor.sources.items():
                self._sequencer.track(name, c.epoch, c.seq, c.position, -1)
                self._yielded[name] = c
        # The page being ingested, and where the live read stands.
        self._ingest = PageIngest(self._checks, self._sequencer, self._start)
        self._read_ahead = ReadAhead(
            self._transport, self.stream, self.url, self.stats, follow=follow
        )
        self._ended = False
        instruments.track_subscription(self)

    # --- iteration ---------------------------------------------------------------------

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Item:
        if not self._ready:
            await self._fill()
        item = self._ready.popleft()[0]
        if isinstance(item, Message):
            if item.source in self._sequencer.states:  # not forgotten (max_sources) meanwhile
                self._yielded[item.source] = item
        else:
            self._note_resync(item)
        return item

    async def _fill(self) -> None:
        """Ingest what the reader brought until something is ready to yield."""
        ingest, read_ahead, sequencer = self._ingest, self._read_ahead, self._sequencer
        if read_ahead.reader is None:
            if self._snapshots is not None and self._start is None:
                # Each source's snapshot first, then the stream from the compactor's cursor.
                start = await self._snapshots.start()
                if start is not None:
                    self._start = ingest.read_position = start.position
            read_ahead.start(self._start)
        while not self._ready:
            if ingest.index < len(ingest.page):
                ingest.ingest()
                continue
            if self._ended:
                raise StopAsyncIteration
            if sequencer.repair_due and not read_ahead.inbox:
                # Caught up with what has arrived: one history pass for every new gap.
                await self._search(sequencer.repair_due)
                continue
            deadline = sequencer.next_deadline()
            if deadline is not None and deadline <= time.monotonic():
                await self._expire_gaps(force=False)
                continue
            if not read_ahead.inbox:
                await read_ahead.wait(deadline)  # then the deadline check above
                continue
            page = await read_ahead.take()
            if page is None:  # the end of the stream (follow=False)
                await self._expire_gaps(force=True)
                self._ended = True
                continue
            ingest.load(*page)

    @property
    def backlog(self) -> int:
        """Messages read from the transport and not yet delivered."""
        held = self._sequencer.held_messages()
        unread = self._ingest.unread
        return self._read_ahead.entries + unread + len(self._ready) + held

    @property
    def lag_seconds(self) -> float:
        """Age of the oldest message read from the transport and not yet delivered: how
        far behind the live edge the consumer is (0 when it keeps up). Computed when
        asked, so that delivery pays nothing for it."""
        oldest: float | None = None
        for item, _, _ in self._ready:
            if isinstance(item, Message):
                oldest = item.ts
                break
        if oldest is None:
            first = self._ingest.first_unread()
            if first is None:
                first = self._read_ahead.first_entry()
            if first is not None:
                try:
                    oldest = ENVELOPE_DECODER.decode(first.data).ts
                except (msgspec.DecodeError, RecursionError):
                    return 0.0
        return max(0.0, time.time() - oldest) if oldest is not None else 0.0

    @property
    def cursor(self) -> Cursor:
        """Everything yielded so far; resuming from it yields what comes next."""
        pending = [(o, p) for _, o, p in self._ready if o is not None]
        pending += self._sequencer.held_arrivals()
        read_position = self._ingest.read_position
        position = min(pending, key=lambda x: x[0])[1] if pending else read_position
        sources = {
            name: SourceCursor(c.epoch, c.seq, c.position) for name, c in self._yielded.items()
        }
        return Cursor(position, sources)

    @property
    def _reader(self) -> asyncio.Task[None] | None:
        """The task reading the transport, once started (tests check it ends)."""
        return self._read_ahead.reader

    async def aclose(self) -> None:
        await self._read_ahead.aclose()
        # Bounded: a close that waits on a stopped server or a cut network never ends.
        await close_within(self._transport.aclose(), f"transport of stream {self.stream}")

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # --- ordering ----------------------------------------------------------------------

    async def _search(self, states: Iterable[SourceState]) -> None:
        """Carry out the history search the sequencer asks for ``states``' gaps, if any
        (one pass for all of them; see `Sequencer.search_history`)."""
        sequencer = self._sequencer
        search = sequencer.search_history(list(states), self._ingest.read_position)
        if search is not None:
            try:
                await self._read_history(search)
            except Exception as error:
                self.stats.transport_errors += 1
                log.warning("kvbus: history read of %s failed: %r", self.stream, error)
            sequencer.history_searched(search)

    async def _read_history(self, search: HistorySearch) -> None:
        receive = self._sequencer.receive_history
        async for page in self._transport.read_pages(self.stream, search.after, follow=False):
            horizon = self._checks.horizon()
            for entry in page:
                envelope = self._checks.open(entry, horizon, count=False)
                if not receive(search, envelope, entry.position):
                    return

    async def _expire_gaps(self, *, force: bool) -> None:
        """Gaps whose deadline passed get a history search if theirs has not looked for
        every seq now missing, then a Resync. Only the gaps due: the oldest first."""
        sequencer = self._sequencer
        expired = sequencer.expiring(time.monotonic(), force=force)
        await self._search(sequencer.unsearched(expired))
        if self._snapshots is not None:
            await self._snapshots.substitute([s for s in expired if s.held])
        for state in expired:
            sequencer.declare_lost(state)

    def _forget(self, source: str) -> None:
        """``source`` is no longer tracked (``max_sources``): nor is what it yielded."""
        self._yielded.pop(source, None)

    def _note_resync(self, item: Resync) -> None:
        if item.source not in self._sequencer.states:
            return  # forgotten (max_sources) since it was queued
        last = self._yielded.get(item.source)
        same_epoch = last is not None and last.epoch == item.epoch
        seq = item.lost[1] if item.lost else (last.seq if last and same_epoch else 0)
        position = last.position if last else None
        self._yielded[item.source] = SourceCursor(item.epoch, seq, position)


def subscribe(
    stream: str | None = None,
    url: str | None = None,
    sources: Collection[str] | None = None,
    cursor: Cursor | bytes | str | None = None,
    **options: Any,
) -> Subscription:
    """Subscribe to ``stream`` (default ``$KVBUS_STREAM`` or ``kv``) on ``url`` (default
    ``$KVBUS_URL`` or ``memory://``).

    ``sources`` limits delivery to those publishers. ``cursor``: ``None`` starts at the
    oldest message the transport retains, ``"latest"`` at the next one published, a
    `Cursor` (or its bytes) where a previous subscription left off. Other options:
    ``follow`` (default True; False ends at the end of history), ``gap_timeout``
    (seconds to wait for missing seqs before declaring them lost; 0 declares them lost
    at once without searching history, for streams of state records such as metrics,
    where only the newest counts),
    ``max_message_bytes``, ``max_sources``, ``max_clock_skew``, ``max_held_bytes``
    (default 64 MiB: messages held back for gaps, beyond which the oldest gaps are
    declared lost early), ``transport``, and
    ``snapshot``: with no ``cursor``, start from the snapshots a `kvbus.ops.compact.Compactor`
    stored (each source's state as one batch of events, then the stream after them), and
    when a source would be declared JOINED or GAP while its stored snapshot covers what is
    missing, yield a Resync with nothing lost and that snapshot instead.

    Use as ``async for item in kvbus.subscribe(...)``: each item is a `Message` or a
    `Resync`.
    """
    return Subscription(stream, url, sources, cursor, **options)


__all__ = [
    "Cursor",
    "Message",
    "Resync",
    "ResyncReason",
    "SourceCursor",
    "Subscription",
    "SubscriptionStats",
    "subscribe",
]
