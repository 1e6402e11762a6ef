"""A subscription's use of the snapshots a compactor stored (see kvbus.wire.snapshot): start
from them (each source's state, then the stream after them), and deliver a source's
snapshot instead of declaring its missing seqs lost when the snapshot covers them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from kvbus.bus.intake import EnvelopeChecks
from kvbus.bus.message import Cursor, Message
from kvbus.bus.sequencer import Sequencer, SourceState
from kvbus.logs import LimitedLog
from kvbus.transports import Transport
from kvbus.wire.envelope import Envelope, Kind
from kvbus.wire.events import KVEventBatch
from kvbus.wire.snapshot import CURSOR_NAME, Snapshot, decode_snapshot

log = logging.getLogger("kvbus.bus.subscription")

DecodeBatch = Callable[[bytes], tuple[KVEventBatch, int]]


class StoredSnapshots:
    """Reads the stored snapshots for one subscription, and hands the sound ones that
    concern it to its sequencer (`start`, `substitute`).

    Each read is kept for ``reuse_for`` seconds: a gap is one message away for anyone
    who can publish, and all snapshots together can hold every engine's cache, so
    expiring gaps must not read them all again each."""

    def __init__(
        self,
        transport: Transport,
        checks: EnvelopeChecks,
        sequencer: Sequencer[Message],
        *,
        decode_batch: DecodeBatch,
        reuse_for: float,
        limited_log: LimitedLog,
    ) -> None:
        self.transport = transport
        self.checks = checks
        self.stats = checks.stats
        self.stream = checks.stream
        self.sequencer = sequencer
        self.decode_batch = decode_batch
        self.reuse_for = reuse_for
        self.limited_log = limited_log
        self._recent: dict[str, bytes] | None = None
        self._read_at = 0.0

    async def start(self) -> Cursor | None:
        """Each source's snapshot to the sequencer first; returns the compactor's cursor,
        where the stream is to be read on from (None: no compactor has run, or its
        cursor is malformed; then the whole retained history)."""
        stored = dict(await self._read())
        cursor_data = stored.pop(CURSOR_NAME, None)
        if cursor_data is None:
            return None
        try:
            cursor = Cursor.from_bytes(cursor_data)
        except (msgspec.DecodeError, ValueError):
            self.stats.malformed += 1
            return None
        # Only a snapshot stored under its own source's name (as the compactor names them):
        # two claiming one source would both be delivered, the second replacing the state.
        opened = ((name, self._open(data)) for name, data in stored.items())
        snapshots = [s for name, s in opened if s is not None and s.source == name]
        for snapshot, batch in zip(snapshots, await self._batches(snapshots), strict=True):
            if batch is not None:
                self.sequencer.start_at(
                    snapshot.source,
                    snapshot.epoch,
                    snapshot.seq,
                    snapshot.position,
                    _snapshot_message(snapshot, batch),
                )
        return cursor

    async def substitute(self, states: list[SourceState]) -> None:
        """A source about to be declared JOINED or GAP whose stored snapshot covers the
        missing seqs: Resync with nothing lost, its snapshot, then what follows it.

        Only these sources' snapshots are opened, and the stored ones are read at most
        once per ``reuse_for`` seconds."""
        if not states:
            return
        sequencer = self.sequencer
        stored = await self._recent_or_read()
        covering: list[tuple[SourceState, Snapshot]] = []
        for state in states:
            data = stored.get(state.name)
            snapshot = None if data is None else self._open(data)
            if snapshot is not None and sequencer.snapshot_covers(
                state, snapshot.source, snapshot.epoch, snapshot.seq
            ):
                covering.append((state, snapshot))
        batches = await self._batches([snapshot for _, snapshot in covering])
        for (state, snapshot), batch in zip(covering, batches, strict=True):
            if batch is not None:
                message = _snapshot_message(snapshot, batch)
                sequencer.substitute(state, snapshot.seq, snapshot.position, message)

    async def _read(self) -> dict[str, bytes]:
        """Every stored snapshot (by name: the compactor names each after its source),
        read now; kept for ``reuse_for`` seconds for `_recent_or_read`."""
        self.stats.snapshot_reads += 1
        try:
            stored = await self.transport.get_snapshots(self.stream)
        except Exception as error:
            self.stats.transport_errors += 1
            log.warning("kvbus: reading the snapshots of %s failed: %r", self.stream, error)
            stored = {}
        self._recent, self._read_at = stored, time.monotonic()
        # Not held longer: they can be large, and a later gap wants newer ones.
        asyncio.get_running_loop().call_later(self.reuse_for, self._forget, stored)
        return stored

    def _forget(self, stored: dict[str, bytes]) -> None:
        if self._recent is stored:
            self._recent = None

    async def _recent_or_read(self) -> dict[str, bytes]:
        """The stored snapshots as read at most ``reuse_for`` seconds ago."""
        recent = self._recent
        if recent is not None and time.monotonic() - self._read_at < self.reuse_for:
            return recent
        return await self._read()

    def _open(self, data: bytes) -> Snapshot | None:
        """A stored snapshot, if it is sound (else counted, skipped); its payload, the
        costly part, is checked by whoever delivers it (`_batches`)."""
        try:
            snapshot = decode_snapshot(data)
        except (msgspec.DecodeError, ValueError):
            self._malformed()
            return None
        probe = Envelope(1, Kind.KV, snapshot.source, snapshot.epoch, snapshot.seq, 0.0, b"")
        if self.checks.implausible(probe, self.checks.horizon()) is not None:
            self.stats.implausible += 1
            return None
        if self.checks.sources is not None and snapshot.source not in self.checks.sources:
            return None
        return snapshot

    def _malformed(self) -> None:
        self.stats.malformed += 1
        self.limited_log.warning(
            "snapshot", "kvbus: skipped a malformed snapshot of %s", self.stream
        )

    async def _batches(self, snapshots: list[Snapshot]) -> list[KVEventBatch | None]:
        """The snapshots' batches, decoded in a thread (one can hold a whole cache: the
        event loop goes on meanwhile); None for a malformed one (counted)."""
        if not snapshots:
            return []
        payloads = [s.payload for s in snapshots]
        batches = await asyncio.to_thread(_decode_batches, self.decode_batch, payloads)
        for _ in range(batches.count(None)):
            self._malformed()
        return batches


def _decode_batches(decode: DecodeBatch, payloads: list[bytes]) -> list[KVEventBatch | None]:
    """Each payload's batch, or None where it does not decode."""
    batches: list[KVEventBatch | None] = []
    for payload in payloads:
        try:
            batches.append(decode(payload)[0])
        except (msgspec.DecodeError, ValueError):
            batches.append(None)
    return batches


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
