"""What a subscription hands out and where it resumes: `Message` (one delivered message,
its KV batch decoded only when first read), `SourceCursor` and `Cursor`."""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

from kvbus.bus.sequencer import Resync, SubscriptionStats
from kvbus.logs import LimitedLog, shown
from kvbus.wire.envelope import Kind
from kvbus.wire.events import (
    ConnectorBatch,
    ControlEvent,
    KVEventBatch,
    LoadMetrics,
    RouteEvent,
    decode_kv_batch,
    decode_packed_kv_batch,
)

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

    __slots__ = ("limited_log", "packed_read", "read", "stats", "stream")

    def __init__(self, stats: SubscriptionStats, stream: str, limited_log: LimitedLog) -> None:
        self.stats = stats
        self.stream = stream
        self.limited_log = limited_log
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
            self.limited_log.warning(
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
        the msgpack array sent (`kvbus.wire.events.PackedBlockStored`): ``.ts``, ``.events``
        and ``.data_parallel_rank`` as in ``body``, for a consumer that reads blocks but
        not tokens (`kvbus.routing.index.PrefixIndex.apply`, ``kvbus top``): no int object is
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


Item: TypeAlias = Message | Resync
