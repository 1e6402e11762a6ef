"""The envelope every message on the bus travels in.

An envelope names who sent the message (``source``), which run of that sender it came
from (``epoch``, new on every publisher start) and its place in that run (``seq``,
contiguous from 1). Those three are what lets a consumer order, deduplicate, detect
gaps and tell a restart from a loss. The payload is carried as opaque bytes (a vLLM
payload is the engine's own bytes), so publishing never decodes or re-encodes it.

``version`` is the envelope schema's major version. Additive changes append optional
fields at the end and keep it; a consumer skips (and counts) a message whose version
is newer than it understands instead of misreading it.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Final, ParamSpec, TypeVar

import msgspec

SCHEMA_VERSION: Final = 1


class Kind(enum.IntEnum):
    KV = 1
    """A vLLM ``KVEventBatch`` payload."""
    METRICS = 2
    """A ``LoadMetrics`` payload."""
    CONTROL = 3
    """A kvbus control payload (``SourceStarted``, ``SourceStopped``)."""
    CONNECTOR = 4
    """A ``ConnectorBatch`` payload: one engine step's KV transfers and connector stats
    (kvbus >= 0.2; older consumers count and skip it as an unknown kind)."""
    ROUTES = 5
    """A ``RouteEvent`` payload: a router replica's request in flight (kvbus >= 0.3)."""


class Envelope(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    version: int
    kind: int
    source: str
    epoch: int
    seq: int
    ts: float
    """Wall-clock time of ``publish()``, seconds since the epoch."""
    payload: bytes
    lost_from: int = 0
    """Gap marker: when non-zero, seqs ``lost_from .. seq-1`` of this epoch were dropped
    by the publisher (queue full, backend down, oversized) and will never exist."""

    @property
    def msg_id(self) -> str:
        """Unique id of this message, the key for server-side deduplication."""
        return f"{self.source}:{self.epoch}:{self.seq}"


class FutureVersionError(ValueError):
    """The envelope was written by a newer kvbus schema than this one understands."""


class _Head(msgspec.Struct, array_like=True, gc=False):
    version: int


_P = ParamSpec("_P")
_R = TypeVar("_R")


def nesting_is_malformed(decode: Callable[_P, _R]) -> Callable[_P, _R]:
    """Make ``decode`` raise ``msgspec.DecodeError`` for msgpack nested deeper than the
    interpreter's stack (a 2 KB message can nest 1,000 levels), not ``RecursionError``,
    which callers that skip bad input would not expect."""

    @functools.wraps(decode)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return decode(*args, **kwargs)
        except RecursionError:
            raise msgspec.DecodeError("MessagePack data is nested too deeply") from None

    return wrapper


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Envelope)
ENVELOPE_DECODER: Final = _decoder
"""The bare decoder under `decode_envelope`, for hot loops that do its checks inline."""
_head_decoder: Final = msgspec.msgpack.Decoder(_Head)


def encode_envelope(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


def decode_envelope(data: bytes) -> Envelope:
    """Decode an envelope; raises ``FutureVersionError`` or ``msgspec.DecodeError``."""
    # Not wrapped in `nesting_is_malformed`: this runs once per message, and the
    # subscriber's hot path cannot afford a second Python call for it.
    try:
        envelope = _decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("MessagePack data is nested too deeply") from None
    except msgspec.DecodeError:
        # A newer schema may not fit this layout: say so rather than "malformed".
        try:
            version = _head_decoder.decode(data).version
        except (msgspec.DecodeError, RecursionError):
            raise msgspec.DecodeError("not a kvbus envelope") from None
        if version > SCHEMA_VERSION:
            raise FutureVersionError(f"envelope schema version {version}") from None
        raise
    if envelope.version > SCHEMA_VERSION:
        raise FutureVersionError(f"envelope schema version {envelope.version}")
    return envelope
