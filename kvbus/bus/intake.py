"""A transport's entries into the sequencer: the checks every envelope must pass before
its message may count (size, schema, plausibility, the sender the transport
authenticated, a payload that decodes: `EnvelopeChecks`) and the hot loop that feeds a
page of the live read through them (`PageIngest`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from kvbus.bus.message import Body, Message, _UndecodedBatch
from kvbus.bus.sequencer import Outcome, Sequencer, SubscriptionStats
from kvbus.logs import LimitedLog, shown
from kvbus.transports import Entry, Position
from kvbus.wire.envelope import (
    ENVELOPE_DECODER,
    SCHEMA_VERSION,
    Envelope,
    FutureVersionError,
    Kind,
    decode_envelope,
)
from kvbus.wire.events import (
    KV_BATCH_SHAPE,
    LossNotice,
    check_kv_batch,
    decode_connector,
    decode_control,
    decode_metrics,
    decode_packed_kv_batch,
    decode_routes,
)

MAX_SOURCE_LENGTH: Final = 200
NS_PER_SEQ: Final = 100
"""A seq is plausible only if a publisher sending one message per 100 ns since its epoch
began (10M/s, far beyond any real one) could have reached it."""
SLICE: Final = 64
"""Entries of a page ingested at a time: few enough that the batches a slice decodes for a
consumer that reads every body (`PageIngest._eager`) are still in the CPU's cache when it
reads them (256 cost it 15-20% of its batches/s; the other consumers see no difference:
BENCHMARKS.md, "Issue 30: the subscriber's C path")."""
_MALFORMED: Final = object()
_KINDS: Final = {kind.value: kind for kind in Kind}


class EnvelopeChecks:
    """Which stored entries a subscription considers, and the message each becomes.

    Bad input is counted in ``stats``, logged through ``limited_log`` (at most once a
    second per kind) and skipped; nothing here raises on it."""

    def __init__(
        self,
        stats: SubscriptionStats,
        stream: str,
        sources: frozenset[str] | None,
        *,
        max_message_bytes: int,
        max_clock_skew: float,
        limited_log: LimitedLog,
    ) -> None:
        self.stats = stats
        self.stream = stream
        self.sources = sources
        self.max_message_bytes = max_message_bytes
        self.max_skew_ns = int(max_clock_skew * 1e9)
        self.limited_log = limited_log
        self.undecoded = _UndecodedBatch(stats, stream, limited_log)
        """The body of every KV message delivered undecoded (see `_UndecodedBatch`)."""
        self.delivered_undecoded = 0

    def horizon(self) -> int:
        """The latest epoch (ns) an honest publisher's envelope can carry now."""
        return time.time_ns() + self.max_skew_ns

    def open(self, entry: Entry, horizon: int, *, count: bool) -> Envelope | None:
        """The entry's envelope if it is one we should consider, else None (counted and
        logged when ``count``: a history search sees entries the live read counted)."""
        warn = self.limited_log.warning
        if len(entry.data) > self.max_message_bytes:
            if count:
                self.stats.oversized += 1
                warn(
                    "oversized",
                    "kvbus: skipped %d-byte message at %s:%s (max_message_bytes=%d)",
                    len(entry.data),
                    self.stream,
                    shown(entry.position),
                    self.max_message_bytes,
                )
            return None
        try:
            envelope = decode_envelope(entry.data)
        except FutureVersionError as error:
            if count:
                self.stats.future_version += 1
                warn(
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
                warn(
                    "malformed",
                    "kvbus: skipped malformed message at %s:%s: %s",
                    self.stream,
                    shown(entry.position),
                    shown(str(error)),
                )
            return None
        if self.sources is not None and envelope.source not in self.sources:
            return None
        problem = self.implausible(envelope, horizon)
        if problem is None and entry.sender is not None and entry.sender != envelope.source:
            problem = f"forged: sent as {shown(entry.sender)}"
        if problem is not None:
            if count:
                if problem.startswith("forged"):
                    self.stats.forged += 1
                else:
                    self.stats.implausible += 1
                warn(
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

    @staticmethod
    def implausible(envelope: Envelope, horizon: int) -> str | None:
        """Why no honest publisher could have sent this envelope, if none could
        (``horizon``: `horizon`, read once per page)."""
        if not 0 < len(envelope.source) <= MAX_SOURCE_LENGTH:
            return f"malformed: source of {len(envelope.source)} characters"
        if envelope.seq < 1 or not 0 <= envelope.lost_from <= envelope.seq:
            return "malformed: seq or lost_from out of range"
        if envelope.epoch > horizon:
            return "implausible: epoch ahead of this clock by more than max_clock_skew"
        if envelope.seq > (horizon - envelope.epoch) // NS_PER_SEQ + 1:
            return "implausible: seq beyond what the source could have sent since its epoch"
        return None

    def open_message(self, envelope: Envelope, position: Position) -> Message | Outcome:
        """The message to deliver for ``envelope`` (for `Sequencer`), or why none is."""
        body = self.decode_body(envelope, position)
        if body is self.undecoded:
            self.delivered_undecoded += 1
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
            _KINDS[envelope.kind],  # a known kind: decode_body checked it
            envelope.ts,
            body,
            envelope.payload,
            position,
        )

    def decode_body(self, envelope: Envelope, position: Position) -> Any:
        """The decoded payload; None for a kind this kvbus does not know (skipped: a
        newer publisher's), `_MALFORMED` for a payload that does not decode."""
        try:
            if envelope.kind == Kind.KV:
                check_kv_batch(envelope.payload)
                return self.undecoded
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
            self.limited_log.warning(
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
        self.limited_log.warning(
            "unknown_kind",
            "kvbus: skipped message of unknown kind %d from %s:%s:%s",
            envelope.kind,
            shown(envelope.source),
            envelope.epoch,
            envelope.seq,
        )
        return None


class PageIngest:
    """The live read's pages, a slice at a time, into the sequencer; where the live
    read stands (``read_position``) and how many entries it has brought (``arrivals``)."""

    def __init__(
        self, checks: EnvelopeChecks, sequencer: Sequencer[Message], start: Position | None
    ) -> None:
        self.checks = checks
        self.sequencer = sequencer
        self.read_position = start
        """The position of the last entry ingested (the start before any)."""
        self.arrivals = 0
        # The page being ingested: its entries before ``index`` are done.
        self.page: Sequence[Entry] = ()
        self.index = 0
        self.previous: Position | None = None
        # `_eager`'s decision, and the counts it was taken at.
        self._decode_eagerly = False
        self._handed_then = self._read_then = 0

    def load(self, page: Sequence[Entry], previous: Position | None) -> None:
        """Ingest ``page`` next (``previous``: the position read just before it)."""
        self.page, self.index, self.previous = page, 0, previous

    @property
    def unread(self) -> int:
        """Entries of the current page not ingested yet."""
        return len(self.page) - self.index

    def first_unread(self) -> Entry | None:
        return self.page[self.index] if self.index < len(self.page) else None

    def _eager(self) -> bool:
        """Whether to decode this slice's KV bodies as they are checked (one msgspec pass
        instead of a check now and a decode when the consumer reads ``body``).

        Nothing of the last slice waits in ready: if the consumer read the body of every
        message delivered undecoded since the last decision, it reads them all; while
        none has been delivered undecoded since, the decision stands. (Since the last
        decision, not since the start: a consumer that let one body go unread, as a
        warm-up read does, still gets the rest decoded at once.)"""
        handed, read = self.checks.delivered_undecoded, self.checks.undecoded.read
        if handed != self._handed_then:
            self._decode_eagerly = read - self._read_then == handed - self._handed_then
            self._handed_then, self._read_then = handed, read
        return self._decode_eagerly

    def ingest(self) -> None:
        """Ingest the next slice of the current page (a slice: so that what waits in
        the sequencer's ``ready`` stays small however large the transport's pages are).

        Most entries are a source's next KV message with no gap open: those take the
        inlined path below (every check of `EnvelopeChecks.open` and `Sequencer.receive`
        that can apply to it, in one expression, and no holding back), and anything it
        doubts goes through `EnvelopeChecks.open` and `Sequencer.receive`. Both deliver
        alike (tests/test_subscribe_fast_path.py).
        """
        page, start = self.page, self.index
        stop = min(len(page), start + SLICE)
        previous = self.previous
        order = self.arrivals
        checks, sequencer = self.checks, self.sequencer
        horizon = checks.horizon()
        states, sources = sequencer.states, checks.sources
        max_bytes, undecoded = checks.max_message_bytes, checks.undecoded
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
            sequencer.ready.append,
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
                    and envelope.seq <= (horizon - envelope.epoch) // NS_PER_SEQ + 1
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
            opened = checks.open(entry, horizon, count=True)
            if opened is not None:
                sequencer.receive(opened, position, order, previous, time.monotonic())
            order += 1
            previous = position
        checks.stats.delivered += delivered
        if not eager:
            checks.delivered_undecoded += delivered
        self.arrivals = order
        sequencer.read_live(stop - start)
        self.index = stop
        self.previous = self.read_position = previous
