"""Packing several records into one stored entry, shared by the networked backends.

A publisher hands its transport up to ``max_batch`` envelopes per append. Storing them
as one NATS message, one Redis stream entry or one ZeroMQ frame costs the server and
the client library one operation instead of hundreds; that is what lets a Python
client reach the throughput of the engine (see BENCHMARKS.md). Batching never delays
a message: a pack holds only what was already queued when the sender woke.

A pack is a msgpack array of the envelopes' bytes. Anything stored that is not a pack
(an envelope written by other means, or garbage) reads back as one entry with its
bytes untouched, so the subscriber counts and skips it like any bad message.

Backends whose positions are integers give the n-th envelope of the pack stored at
offset ``o`` the position ``o << 16 | n`` (see `position`), so a cursor can point
inside a pack. That needs every index below ``1 << 16``: a stored array of more than
`MAX_RECORDS` envelopes (which no kvbus publisher makes, but anyone allowed to publish
can store) would give its last envelopes the positions of the next entry's, and a
reader resuming after it would skip that entry. `unpack` therefore reads such an array
as one bad entry, like any other thing stored that is not a pack.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final, NamedTuple

import msgspec
from kvbus.transports import Record, RecordTooLarge

MAX_RECORDS: Final = 1 << 16
"""Most envelopes in one pack (the index must fit the low 16 bits of a position): a
stored array of more reads back as one bad entry."""
DEFAULT_RECORDS: Final = 512
"""Envelopes a `kvbus.Publisher` hands one append by default (its ``max_batch``): the
most a pack usually holds."""
_OVERHEAD: Final = 5  # msgpack bin header per envelope, worst case
_ARRAY_HEADER: Final = 5
_ARRAY32: Final = b"\xdd"
"""msgpack's array header with a 4-byte count: the only one that can exceed MAX_RECORDS
(array16 counts to 65,535)."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[bytes])


class Pack(NamedTuple):
    source: str
    msg_id: str
    """The first record's ``source:epoch:seq`` plus ``+count``: a retried append repacks
    the same records the same way, so server-side dedup recognises it."""
    data: bytes
    length: int
    """How many envelopes it holds."""


def make_packs(
    records: Sequence[Record], max_bytes: int | None = None, *, hard_limit: bool = True
) -> list[Pack]:
    """Consecutive records of one source, packed into entries of at most ``max_bytes``.

    A record that alone exceeds it raises `RecordTooLarge` (before anything is sent)
    with ``hard_limit`` (the backend refuses larger entries), else gets a pack of its own.
    """
    packs: list[Pack] = []
    start = 0
    size = _ARRAY_HEADER
    for i, record in enumerate(records):
        cost = len(record.data) + _OVERHEAD
        if max_bytes is not None and cost + _ARRAY_HEADER > max_bytes and hard_limit:
            raise RecordTooLarge(record.msg_id, len(record.data), max_bytes)
        full = i - start >= MAX_RECORDS or (max_bytes is not None and size + cost > max_bytes)
        if i > start and (full or record.source != records[start].source):
            packs.append(_pack(records[start:i]))
            start, size = i, _ARRAY_HEADER
        size += cost
    if start < len(records):
        packs.append(_pack(records[start:]))
    return packs


def _pack(records: Sequence[Record]) -> Pack:
    first = records[0]
    data = _encoder.encode([r.data for r in records])
    return Pack(first.source, f"{first.msg_id}+{len(records)}", data, len(records))


def unpack(data: bytes) -> list[bytes]:
    """The envelopes in a stored entry: the entry itself if it is not a pack, or if it
    claims more than `MAX_RECORDS` envelopes (their positions would overflow into the
    next entry's; the subscriber counts the entry as malformed), told from its header
    before anything is decoded."""
    if data[:1] == _ARRAY32 and int.from_bytes(data[1:5], "big") > MAX_RECORDS:
        return [data]
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, ValueError):
        return [data]


def position(offset: int, index: int) -> int:
    """The integer position of envelope ``index`` (below `MAX_RECORDS`, as `unpack`
    guarantees) in the pack stored at ``offset``."""
    return offset << 16 | index


def split_position(pos: int) -> tuple[int, int]:
    """``(offset, index)`` of an integer position made by `position`."""
    return pos >> 16, pos & 0xFFFF


def entries_after(offset: int, data: bytes, skip_through: int = -1) -> Iterator[tuple[int, bytes]]:
    """``(position, envelope)`` for each envelope of the pack at ``offset`` whose index is
    above ``skip_through`` (a cursor pointing inside the pack)."""
    for index, envelope in enumerate(unpack(data)):
        if index > skip_through:
            yield offset << 16 | index, envelope
