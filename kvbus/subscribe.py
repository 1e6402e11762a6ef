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

These rules are decided in `kvbus.sequencer` (a pure state machine, tested alone);
`Subscription` drives it: it reads the transport, checks each envelope, carries out the
history searches and snapshot substitutions the sequencer asks for, and hands out what
it answers with.

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
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final, Literal, TypeAlias

import msgspec

from kvbus import metrics
from kvbus.config import redact_url, resolve_stream, resolve_url
from kvbus.envelope import (
    ENVELOPE_DECODER,
    SCHEMA_VERSION,
    Envelope,
    FutureVersionError,
    Kind,
    decode_envelope,
)
from kvbus.events import (
    KV_BATCH_SHAPE,
    ConnectorBatch,
    ControlEvent,
    KVEventBatch,
    LoadMetrics,
    LossNotice,
    RouteEvent,
    check_kv_batch,
    decode_connector,
    decode_control,
    decode_kv_batch,
    decode_metrics,
    decode_packed_kv_batch,
    decode_routes,
)
from kvbus.logs import LimitedLog, shown
from kvbus.retry import retry_forever
from kvbus.sequencer import (
    REPAIR_ALLOWANCE,
    HistorySearch,
    Outcome,
    Resync,
    ResyncReason,
    Sequencer,
    SourceState,
    SubscriptionStats,
)
from kvbus.shutdown import cancel_sticks, close_within
from kvbus.snapshot import CURSOR_NAME, Snapshot, decode_snapshot
from kvbus.transports import LATEST, BackendUnusable, Entry, Position, Transport, open_transport

log = logging.getLogger("kvbus.subscribe")
_limited = LimitedLog(log)

DEFAULT_GAP_TIMEOUT: Final = 0.5
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
DEFAULT_MAX_SOURCES: Final = 10_000
DEFAULT_MAX_CLOCK_SKEW: Final = 60.0
DEFAULT_MAX_HELD_BYTES: Final = 64 * 1024 * 1024
MAX_SOURCE_LENGTH: Final = 200
_REPAIR_ALLOWANCE: Final = REPAIR_ALLOWANCE
"""`kvbus.sequencer.REPAIR_ALLOWANCE`, read when a subscription starts."""
_SNAPSHOTS_REUSED_FOR: Final = 1.0
"""Seconds the stored snapshots read for an expiring gap serve later ones (snapshot
mode): reading them all again per gap would cost O(all snapshots) per hostile message."""
_NS_PER_SEQ: Final = 100
"""A seq is plausible only if a publisher sending one message per 100 ns since its epoch
began (10M/s, far beyond any real one) could have reached it."""


Body: TypeAlias = KVEventBatch | LoadMetrics | ConnectorBatch | RouteEvent | ControlEvent


class _UndecodedBatch:
    """Stands in for the body of a delivered KV message until it is first read.

    Decoding a 16-block batch costs about as much as everything else the subscriber
    does for it, and a consumer that wants only some bodies (one source, the newest
    load...) should not pay it for all. The subscriber has checked that the batch
    decodes (`check_kv_batch`), so reading it cannot fail. One per subscription: it
    counts skipped events into that subscription's stats, and the bodies read, so that
    a consumer that reads them all gets them decoded at once (without the check).
    """

    __slots__ = ("packed_read", "read", "stats", "stream")

    def __init__(self, stats: SubscriptionStats, stream: str) -> None:
        self.stats = stats
        self.stream = stream
        self.read = 0
        """Bodies decoded because a consumer read them."""
        self.packed_read = 0
        """Batches a consumer read packed (`Message.packed`) that the subscriber had not
        decoded packed: from then on its check decodes them so."""

    def decode(self, source: str, epoch: int, seq: int, payload: bytes) -> KVEventBatch:
        """The batch in ``payload`` (raises ``msgspec.DecodeError`` unless checked)."""
        batch, skipped = decode_kv_batch(payload)
        if skipped:
            self.stats.skipped_events += skipped
            _limited.warning(
                "skipped_events",
                "kvbus: skipped %d unknown or malformed events in %s:%s:%s",
                skipped,
                shown(source),
                epoch,
                seq,
            )
        return batch

    def __repr__(self) -> str:
        return "<not decoded yet>"


class Message(msgspec.Struct, frozen=True, gc=False):
    """One delivered message; ``body`` is its decoded payload."""

    source: str
    epoch: int
    seq: int
    kind: Kind
    ts: float
    _body: Body | _UndecodedBatch
    """``body``, or (a KV batch not read yet) what decodes it on first read."""
    payload: bytes
    """The payload exactly as published (for a vLLM batch: the engine's bytes)."""
    position: int | str
    """Where the transport stored it."""
    _packed: Any = None
    """A KV batch's `packed` batch, once decoded (None: not yet; False: not possible)."""

    @property
    def decoded(self) -> bool:
        """Whether ``body`` is decoded yet. A KV batch is decoded when first read; a
        consumer that needs no token ids reads `packed` instead while nobody has."""
        return not isinstance(self._body, _UndecodedBatch)

    @property
    def packed(self) -> Any:
        """A KV batch nobody has decoded yet, with each ``BlockStored``'s token ids still
        the msgpack array sent (`kvbus.events.PackedBlockStored`): ``.ts``, ``.events``
        and ``.data_parallel_rank`` as in ``body``, for a consumer that reads blocks but
        not tokens (`kvbus.index.PrefixIndex.apply`, ``kvbus top``): no int object is
        made per token, about half the cost of ``body``. None where ``body`` is decoded,
        and for anything but the current dialect's known events (then read ``body``).
        Once a consumer reads it, the subscriber decodes each batch so as it checks it,
        at no cost beyond the check."""
        body, packed = self._body, self._packed
        if not isinstance(body, _UndecodedBatch) or packed is False:
            return None
        if packed is None:
            body.packed_read += 1
            packed = decode_packed_kv_batch(self.payload)
            msgspec.structs.force_setattr(self, "_packed", False if packed is None else packed)
        return packed

    @property
    def packed_events(self) -> list[Any] | None:
        """``packed.events`` (see `packed`), or None where ``packed`` is."""
        packed = self.packed
        return None if packed is None else packed.events

    @property
    def body(self) -> Body:
        """The decoded payload (a KV batch is decoded when first read)."""
        body = self._body
        if isinstance(body, _UndecodedBatch):
            body.read += 1
            body = body.decode(self.source, self.epoch, self.seq, self.payload)
            msgspec.structs.force_setattr(self, "_body", body)
        return body


class SourceCursor(msgspec.Struct, array_like=True):
    epoch: int
    seq: int
    position: int | str | None


class Cursor(msgspec.Struct):
    """Resume point: pass to ``subscribe(cursor=...)`` (as is, or its ``to_bytes()``)."""

    position: int | str | None = None
    sources: dict[str, SourceCursor] = {}

    def to_bytes(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes | str) -> Cursor:
        return msgspec.json.decode(data, type=cls)


_SLICE: Final = 256
"""Entries of a page ingested at a time."""
_END: Final = object()
_MALFORMED: Final = object()
_KINDS: Final = {kind.value: kind for kind in Kind}
_INBOX_HIGH: Final = 1024
_INBOX_LOW: Final = 256
_INBOX_HIGH_BYTES: Final = 64 * 1024 * 1024
_INBOX_LOW_BYTES: Final = 16 * 1024 * 1024
Item = Message | Resync


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
        self._follow = follow
        self._max_message_bytes = max_message_bytes
        self._snapshot = snapshot
        self._max_skew_ns = int(max_clock_skew * 1e9)
        self._transport = transport or open_transport(self.url)
        # What was yielded last per source: a message stands for its SourceCursor.
        self._yielded: dict[str, SourceCursor | Message] = {}
        # The ordering rules; this class feeds it what the transport brings.
        self._sequencer: Sequencer[Message] = Sequencer(
            self._open_message,
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
        self._recent_snapshots: dict[str, bytes] | None = None  # see _SNAPSHOTS_REUSED_FOR
        self._snapshots_read_at = 0.0
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
        self._read_position: Position | None = self._start
        self._arrivals = 0
        self._undecoded = _UndecodedBatch(self.stats, self.stream)
        self._delivered_undecoded = 0
        # `_eager`'s decision, and the counts it was taken at.
        self._decode_eagerly = False
        self._handed_then = self._read_then = 0
        # Pages of entries read ahead by the reader task, each with the position read
        # before it. A deque and two events rather than an asyncio.Queue: a replay
        # moves hundreds of thousands of entries per second.
        self._inbox: deque[Any] = deque()
        self._inbox_filled = asyncio.Event()
        self._inbox_drained = asyncio.Event()
        self._inbox_entries = 0
        self._inbox_bytes = 0
        # The page being ingested: its entries before ``_page_index`` are done.
        self._page: Sequence[Entry] = ()
        self._page_index = 0
        self._page_previous: Position | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ended = False
        metrics.track_subscription(self)

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
        if self._reader is None:
            if self._snapshot and self._start is None:
                await self._start_from_snapshots()
            self._reader = cancel_sticks(self._read_live(), name=f"kvbus-reader-{self.stream}")
            # A reader that ends without queueing _END (an error it did not retry) wakes
            # the consumer, who raises it below instead of waiting for ever.
            self._reader.add_done_callback(lambda _task: self._inbox_filled.set())
        while not self._ready:
            if self._page_index < len(self._page):
                self._ingest_page()
                continue
            if self._ended:
                raise StopAsyncIteration
            sequencer = self._sequencer
            if sequencer.repair_due and not self._inbox:
                # Caught up with what has arrived: one history pass for every new gap.
                await self._search(sequencer.repair_due)
                continue
            deadline = sequencer.next_deadline()
            if deadline is not None and deadline <= time.monotonic():
                await self._expire_gaps(force=False)
                continue
            if not self._inbox:
                if self._reader.done():
                    raise _reader_failure(self._reader)
                self._inbox_filled.clear()
                try:
                    if deadline is None:
                        await self._inbox_filled.wait()
                    else:
                        # asyncio.timeout, not wait_for: in 3.11 a wait_for timing out
                        # as its task is cancelled can swallow the cancellation.
                        timeout = max(0.0, deadline - time.monotonic())
                        async with asyncio.timeout(timeout):
                            await self._inbox_filled.wait()
                except TimeoutError:
                    pass  # the deadline check above expires the gap
                continue
            item = self._inbox.popleft()
            if isinstance(item, BackendUnusable):
                raise item
            if item is _END:
                await self._expire_gaps(force=True)
                self._ended = True
                continue
            page, self._page_previous, size = item
            self._page, self._page_index = page, 0
            self._inbox_entries -= len(page)
            self._inbox_bytes -= size
            drained = self._inbox_entries <= _INBOX_LOW and self._inbox_bytes <= _INBOX_LOW_BYTES
            if drained and not self._inbox_drained.is_set():
                self._inbox_drained.set()
                # Let the reader ask for its next page now: the backend prepares it
                # while this one is ingested, not after.
                await asyncio.sleep(0)

    @property
    def backlog(self) -> int:
        """Messages read from the transport and not yet delivered."""
        held = self._sequencer.held_messages()
        unread = len(self._page) - self._page_index
        return self._inbox_entries + unread + len(self._ready) + held

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
            if self._page_index < len(self._page):
                first: Entry | None = self._page[self._page_index]
            else:
                first = next((e[0][0] for e in self._inbox if e is not _END and e[0]), None)
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
        position = min(pending, key=lambda x: x[0])[1] if pending else self._read_position
        sources = {
            name: SourceCursor(c.epoch, c.seq, c.position) for name, c in self._yielded.items()
        }
        return Cursor(position, sources)

    async def aclose(self) -> None:
        reader = self._reader
        if reader is not None:
            # Its cancel sticks (kvbus.shutdown): it ends even when the backend's client
            # swallows the cancel mid-command (redis-py and nats-py can), as it does
            # when asyncio.run cancels a subscription never closed. Waited for with
            # asyncio.wait, which leaves a cancellation of this call to its caller.
            reader.cancel()
            await asyncio.wait([reader])
            if not reader.cancelled() and reader.exception() is not None:
                log.debug("kvbus: reader of %s ended with %r", self.stream, reader.exception())
        # Bounded: a close that waits on a stopped server or a cut network never ends.
        await close_within(self._transport.aclose(), f"transport of stream {self.stream}")

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # --- reading -----------------------------------------------------------------------

    async def _read_live(self) -> None:
        """Feed the inbox from the transport, resuming after the last entry on errors."""
        previous = self._start

        def count() -> None:
            self.stats.transport_errors += 1

        retrying = retry_forever(f"reading {redact_url(self.url)}", count, log, self.url)
        try:
            await self._read_retrying(retrying, previous)
        except BackendUnusable as error:  # retrying cannot help: the consumer is told
            self._inbox.append(error)
        else:
            self._inbox.append(_END)
        self._inbox_filled.set()

    async def _read_retrying(self, retrying: Any, previous: Position | None) -> None:
        async for attempt in retrying:
            with attempt:
                pages = self._transport.read_pages(self.stream, previous, follow=self._follow)
                async for page in pages:
                    for piece, size in _pieces(page):
                        self._inbox.append((piece, previous, size))
                        self._inbox_entries += len(piece)
                        self._inbox_bytes += size
                        self._inbox_filled.set()
                        previous = piece[-1].position
                        if (
                            self._inbox_entries >= _INBOX_HIGH
                            or self._inbox_bytes >= _INBOX_HIGH_BYTES
                        ):
                            # Let the consumer catch up: read ahead at most this much.
                            self._inbox_drained.clear()
                            await self._inbox_drained.wait()

    def _eager(self) -> bool:
        """Whether to decode this slice's KV bodies as they are checked (one msgspec pass
        instead of a check now and a decode when the consumer reads ``body``).

        Nothing of the last slice waits in ``_ready``: if the consumer read the body of
        every message delivered undecoded since the last decision, it reads them all;
        while none has been delivered undecoded since, the decision stands. (Since the
        last decision, not since the start: a consumer that let one body go unread, as a
        warm-up read does, still gets the rest decoded at once.)"""
        handed, read = self._delivered_undecoded, self._undecoded.read
        if handed != self._handed_then:
            self._decode_eagerly = read - self._read_then == handed - self._handed_then
            self._handed_then, self._read_then = handed, read
        return self._decode_eagerly

    def _ingest_page(self) -> None:
        """Ingest the next slice of the current page (a slice: so that what waits in
        ``_ready`` stays small however large the transport's pages are).

        Most entries are a source's next KV message with no gap open: those take the
        inlined path below (every check of `_open` and `Sequencer.receive` that can
        apply to it, in one expression, and no holding back), and anything it doubts
        goes through `_open` and `Sequencer.receive`. Both deliver alike
        (tests/test_subscribe_fast_path.py).
        """
        page, start = self._page, self._page_index
        stop = min(len(page), start + _SLICE)
        previous = self._page_previous
        order = self._arrivals
        horizon = self._horizon()
        sequencer = self._sequencer
        states, sources = sequencer.states, self.sources
        max_bytes, undecoded = self._max_message_bytes, self._undecoded
        eager = self._eager()
        body: Body | _UndecodedBatch = undecoded
        # A consumer that reads batches packed gets them packed by the check itself.
        packing = not eager and undecoded.packed_read > 0
        packed: Any = None
        delivered = 0
        # Bound once: this loop runs for every message.
        decode, check, append, kv, advance = (
            ENVELOPE_DECODER.decode,
            KV_BATCH_SHAPE.decode,
            self._ready.append,
            Kind.KV,
            sequencer.advance,
        )
        for entry in page[start:stop]:
            position = entry.position
            data = entry.data
            try:
                envelope = decode(data)
                state = states.get(envelope.source)
                if (
                    state is not None
                    and envelope.seq == state.seq + 1
                    and envelope.epoch == state.epoch  # checked when the state began
                    and not state.held
                    and envelope.kind == kv
                    and not envelope.lost_from
                    and envelope.version <= SCHEMA_VERSION
                    and len(data) <= max_bytes
                    and (entry.sender is None or entry.sender == envelope.source)
                    and (sources is None or envelope.source in sources)
                    and envelope.seq <= (horizon - envelope.epoch) // _NS_PER_SEQ + 1
                ):
                    if eager:
                        body = undecoded.decode(
                            envelope.source, envelope.epoch, envelope.seq, envelope.payload
                        )
                    elif packing:
                        packed = decode_packed_kv_batch(envelope.payload)
                        if packed is None:
                            check(envelope.payload)  # see `check_kv_batch`
                            packed = False
                    else:
                        check(envelope.payload)  # see `check_kv_batch`
                    advance(state, envelope.seq, order, position)
                    message = Message(
                        envelope.source,
                        envelope.epoch,
                        envelope.seq,
                        kv,
                        envelope.ts,
                        body,
                        envelope.payload,
                        position,
                        packed,
                    )
                    append((message, order, previous))
                    delivered += 1
                    order += 1
                    previous = position
                    continue
            except (ValueError, RecursionError):  # msgspec's errors, bad UTF-8
                pass  # counted (or not) below, as if the fast path had not looked
            opened = self._open(entry, horizon, count=True)
            if opened is not None:
                sequencer.receive(opened, position, order, previous, time.monotonic())
            order += 1
            previous = position
        self.stats.delivered += delivered
        if not eager:
            self._delivered_undecoded += delivered
        self._arrivals = order
        sequencer.read_live(stop - start)
        self._page_index = stop
        self._page_previous = self._read_position = previous

    def _horizon(self) -> int:
        """The latest epoch (ns) an honest publisher's envelope can carry now."""
        return time.time_ns() + self._max_skew_ns

    def _open(self, entry: Entry, horizon: int, *, count: bool) -> Envelope | None:
        """The entry's envelope if it is one we should consider, else None (counted and
        logged when ``count``: a history search sees entries the live read counted)."""
        if len(entry.data) > self._max_message_bytes:
            if count:
                self.stats.oversized += 1
                _limited.warning(
                    "oversized",
                    "kvbus: skipped %d-byte message at %s:%s (max_message_bytes=%d)",
                    len(entry.data),
                    self.stream,
                    shown(entry.position),
                    self._max_message_bytes,
                )
            return None
        try:
            envelope = decode_envelope(entry.data)
        except FutureVersionError as error:
            if count:
                self.stats.future_version += 1
                _limited.warning(
                    "future",
                    "kvbus: skipped message at %s:%s: %s is newer than this kvbus "
                    "understands; upgrade kvbus",
                    self.stream,
                    shown(entry.position),
                    error,
                )
            return None
        except (msgspec.DecodeError, ValueError) as error:
            if count:
                self.stats.malformed += 1
                _limited.warning(
                    "malformed",
                    "kvbus: skipped malformed message at %s:%s: %s",
                    self.stream,
                    shown(entry.position),
                    shown(str(error)),
                )
            return None
        if self.sources is not None and envelope.source not in self.sources:
            return None
        problem = self._implausible(envelope, horizon)
        if problem is None and entry.sender is not None and entry.sender != envelope.source:
            problem = f"forged: sent as {shown(entry.sender)}"
        if problem is not None:
            if count:
                if problem.startswith("forged"):
                    self.stats.forged += 1
                else:
                    self.stats.implausible += 1
                _limited.warning(
                    problem.partition(":")[0],
                    "kvbus: rejected message %s epoch %d seq %d at %s:%s: %s",
                    shown(envelope.source),
                    envelope.epoch,
                    envelope.seq,
                    self.stream,
                    shown(entry.position),
                    problem,
                )
            return None
        return envelope

    def _implausible(self, envelope: Envelope, horizon: int) -> str | None:
        """Why no honest publisher could have sent this envelope, if none could
        (``horizon``: `_horizon`, read once per page)."""
        if not 0 < len(envelope.source) <= MAX_SOURCE_LENGTH:
            return f"malformed: source of {len(envelope.source)} characters"
        if envelope.seq < 1 or not 0 <= envelope.lost_from <= envelope.seq:
            return "malformed: seq or lost_from out of range"
        if envelope.epoch > horizon:
            return "implausible: epoch ahead of this clock by more than max_clock_skew"
        if envelope.seq > (horizon - envelope.epoch) // _NS_PER_SEQ + 1:
            return "implausible: seq beyond what the source could have sent since its epoch"
        return None

    # --- ordering ----------------------------------------------------------------------

    async def _search(self, states: Iterable[SourceState]) -> None:
        """Carry out the history search the sequencer asks for ``states``' gaps, if any
        (one pass for all of them; see `Sequencer.search_history`)."""
        sequencer = self._sequencer
        search = sequencer.search_history(list(states), self._read_position)
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
            horizon = self._horizon()
            for entry in page:
                if not receive(search, self._open(entry, horizon, count=False), entry.position):
                    return

    async def _expire_gaps(self, *, force: bool) -> None:
        """Gaps whose deadline passed get a history search if theirs has not looked for
        every seq now missing, then a Resync. Only the gaps due: the oldest first."""
        sequencer = self._sequencer
        expired = sequencer.expiring(time.monotonic(), force=force)
        await self._search(sequencer.unsearched(expired))
        if self._snapshot:
            await self._substitute_snapshots([s for s in expired if s.held])
        for state in expired:
            sequencer.declare_lost(state)

    # --- snapshots (see kvbus.snapshot) -----------------------------------------------

    async def _snapshots(self) -> dict[str, bytes]:
        """Every stored snapshot (by name: the compactor names each after its source),
        read now; kept for `_SNAPSHOTS_REUSED_FOR` seconds for `_recent`."""
        self.stats.snapshot_reads += 1
        try:
            stored = await self._transport.get_snapshots(self.stream)
        except Exception as error:
            self.stats.transport_errors += 1
            log.warning("kvbus: reading the snapshots of %s failed: %r", self.stream, error)
            stored = {}
        self._recent_snapshots, self._snapshots_read_at = stored, time.monotonic()
        # Not held longer: they can be large, and a later gap wants newer ones.
        asyncio.get_running_loop().call_later(_SNAPSHOTS_REUSED_FOR, self._forget_snapshots, stored)
        return stored

    def _forget_snapshots(self, stored: dict[str, bytes]) -> None:
        if self._recent_snapshots is stored:
            self._recent_snapshots = None

    async def _recent(self) -> dict[str, bytes]:
        """The stored snapshots as read at most `_SNAPSHOTS_REUSED_FOR` seconds ago."""
        recent = self._recent_snapshots
        if (
            recent is not None
            and time.monotonic() - self._snapshots_read_at < _SNAPSHOTS_REUSED_FOR
        ):
            return recent
        return await self._snapshots()

    def _open_snapshot(self, data: bytes) -> Snapshot | None:
        """A stored snapshot, if it is sound (else counted, skipped); its payload, the
        costly part, is checked by whoever delivers it (`_snapshot_batch`)."""
        try:
            snapshot = decode_snapshot(data)
        except (msgspec.DecodeError, ValueError):
            self._malformed_snapshot()
            return None
        probe = Envelope(1, Kind.KV, snapshot.source, snapshot.epoch, snapshot.seq, 0.0, b"")
        if self._implausible(probe, self._horizon()) is not None:
            self.stats.implausible += 1
            return None
        if self.sources is not None and snapshot.source not in self.sources:
            return None
        return snapshot

    def _malformed_snapshot(self) -> None:
        self.stats.malformed += 1
        _limited.warning("snapshot", "kvbus: skipped a malformed snapshot of %s", self.stream)

    async def _snapshot_batches(self, snapshots: list[Snapshot]) -> list[KVEventBatch | None]:
        """The snapshots' batches, decoded in a thread (one can hold a whole cache: the
        event loop goes on meanwhile); None for a malformed one (counted)."""
        if not snapshots:
            return []
        batches = await asyncio.to_thread(_decode_batches, [s.payload for s in snapshots])
        for _ in range(batches.count(None)):
            self._malformed_snapshot()
        return batches

    async def _start_from_snapshots(self) -> None:
        """Each source's snapshot first, then the stream from the compactor's cursor."""
        stored = dict(await self._snapshots())
        cursor_data = stored.pop(CURSOR_NAME, None)
        if cursor_data is None:
            return  # no compactor has run: the whole retained history
        try:
            self._start = self._read_position = Cursor.from_bytes(cursor_data).position
        except (msgspec.DecodeError, ValueError):
            self.stats.malformed += 1
            return
        # Only a snapshot stored under its own source's name (as the compactor names them):
        # two claiming one source would both be delivered, the second replacing the state.
        opened = ((name, self._open_snapshot(data)) for name, data in stored.items())
        snapshots = [s for name, s in opened if s is not None and s.source == name]
        for snapshot, batch in zip(snapshots, await self._snapshot_batches(snapshots), strict=True):
            if batch is not None:
                self._sequencer.start_at(
                    snapshot.source,
                    snapshot.epoch,
                    snapshot.seq,
                    snapshot.position,
                    _snapshot_message(snapshot, batch),
                )

    async def _substitute_snapshots(self, states: list[SourceState]) -> None:
        """A source about to be declared JOINED or GAP whose stored snapshot covers the
        missing seqs: Resync with nothing lost, its snapshot, then what follows it.

        Only these sources' snapshots are opened, and the stored ones are read at most
        once per `_SNAPSHOTS_REUSED_FOR`: a gap is one message away for anyone who can
        publish, and all snapshots together can hold every engine's cache."""
        if not states:
            return
        sequencer = self._sequencer
        stored = await self._recent()
        covering: list[tuple[SourceState, Snapshot]] = []
        for state in states:
            data = stored.get(state.name)
            snapshot = None if data is None else self._open_snapshot(data)
            if snapshot is not None and sequencer.snapshot_covers(
                state, snapshot.source, snapshot.epoch, snapshot.seq
            ):
                covering.append((state, snapshot))
        batches = await self._snapshot_batches([snapshot for _, snapshot in covering])
        for (state, snapshot), batch in zip(covering, batches, strict=True):
            if batch is not None:
                message = _snapshot_message(snapshot, batch)
                sequencer.substitute(state, snapshot.seq, snapshot.position, message)

    def _open_message(self, envelope: Envelope, position: Position) -> Message | Outcome:
        """The message to deliver for ``envelope`` (for `Sequencer`), or why none is."""
        body = self._decode_body(envelope, position)
        if body is self._undecoded:
            self._delivered_undecoded += 1
        elif body is None:
            return Outcome.SKIP
        if body is _MALFORMED:
            return Outcome.MALFORMED
        if type(body) is LossNotice:
            return Outcome.LOSS_NOTICE
        return Message(
            envelope.source,
            envelope.epoch,
            envelope.seq,
            _KINDS[envelope.kind],  # a known kind: _decode_body checked it
            envelope.ts,
            body,
            envelope.payload,
            position,
        )

    def _forget(self, source: str) -> None:
        """``source`` is no longer tracked (``max_sources``): nor is what it yielded."""
        self._yielded.pop(source, None)

    def _decode_body(self, envelope: Envelope, position: Position) -> Any:
        """The decoded payload; None for a kind this kvbus does not know (skipped: a
        newer publisher's), `_MALFORMED` for a payload that does not decode."""
        try:
            if envelope.kind == Kind.KV:
                check_kv_batch(envelope.payload)
                return self._undecoded
            if envelope.kind == Kind.METRICS:
                return decode_metrics(envelope.payload)
            if envelope.kind == Kind.CONTROL:
                return decode_control(envelope.payload)
            if envelope.kind == Kind.CONNECTOR:
                return decode_connector(envelope.payload)
            if envelope.kind == Kind.ROUTES:
                return decode_routes(envelope.payload)
        except (msgspec.DecodeError, ValueError) as error:
            self.stats.malformed += 1
            _limited.warning(
                "malformed_payload",
                "kvbus: skipped malformed payload of %s:%s:%s at %s:%s (resync): %s",
                shown(envelope.source),
                envelope.epoch,
                envelope.seq,
                self.stream,
                shown(position),
                shown(str(error)),
            )
            return _MALFORMED
        self.stats.unknown_kind += 1
        _limited.warning(
            "unknown_kind",
            "kvbus: skipped message of unknown kind %d from %s:%s:%s",
            envelope.kind,
            shown(envelope.source),
            envelope.epoch,
            envelope.seq,
        )
        return None

    def _note_resync(self, item: Resync) -> None:
        if item.source not in self._sequencer.states:
            return  # forgotten (max_sources) since it was queued
        last = self._yielded.get(item.source)
        same_epoch = last is not None and last.epoch == item.epoch
        seq = item.lost[1] if item.lost else (last.seq if last and same_epoch else 0)
        position = last.position if last else None
        self._yielded[item.source] = SourceCursor(item.epoch, seq, position)


def _decode_batches(payloads: list[bytes]) -> list[KVEventBatch | None]:
    """Each payload's batch, or None where it does not decode."""
    batches: list[KVEventBatch | None] = []
    for payload in payloads:
        try:
            batches.append(decode_kv_batch(payload)[0])
        except (msgspec.DecodeError, ValueError):
            batches.append(None)
    return batches


def _reader_failure(reader: asyncio.Task[None]) -> BaseException:
    """What ended a subscription's reader that queued no end: its error, raised to the
    consumer (who may subscribe again from its cursor) rather than a silent hang."""
    error = None if reader.cancelled() else reader.exception()
    if error is not None:
        return error
    return ConnectionError("kvbus: the subscription's reader was cancelled from outside")


def _snapshot_message(snapshot: Snapshot, batch: KVEventBatch) -> Message:
    return Message(
        snapshot.source,
        snapshot.epoch,
        snapshot.seq,
        Kind.KV,
        snapshot.ts,
        batch,
        snapshot.payload,
        snapshot.position if snapshot.position is not None else "",
    )


def _pieces(page: Sequence[Entry]) -> list[tuple[Sequence[Entry], int]]:
    """``page`` with its size in bytes, cut into pieces of about ``_INBOX_LOW_BYTES`` if
    it is larger (an in-process transport hands over its whole history as one page),
    so that the read-ahead bound holds in bytes too."""
    sizes = [len(entry.data) for entry in page]
    size = sum(sizes)
    if size <= _INBOX_LOW_BYTES:
        return [(page, size)]
    pieces: list[tuple[Sequence[Entry], int]] = []
    start = piece_size = 0
    for index, entry_size in enumerate(sizes):
        if index > start and piece_size + entry_size > _INBOX_LOW_BYTES:
            pieces.append((page[start:index], piece_size))
            start = index
            piece_size = 0
        piece_size += entry_size
    pieces.append((page[start:], piece_size))
    return pieces


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
    ``snapshot``: with no ``cursor``, start from the snapshots a `kvbus.compact.Compactor`
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
