"""Transports: where envelopes are stored and read back.

A transport is deliberately small (see `Transport`): append encoded envelopes, read
them back from a position (history, then optionally the live tail), close. Ordering
by source and seq, deduplication, gap repair and resync are done once, in
`kvbus.subscribe`, for every backend.

Backends are imported when their URL scheme is first used, so ``import kvbus`` pulls
in no client library.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, TypeAlias
from urllib.parse import urlsplit

import msgspec

from kvbus.config import redact_url

Position: TypeAlias = int | str
"""Where an entry sits in a stream; opaque to everything but its transport."""

LATEST: Final = "$"
"""A position meaning "after the newest entry stored when the read starts"."""


class Record(msgspec.Struct, frozen=True, gc=False):
    """One message to append."""

    source: str
    msg_id: str
    """``source:epoch:seq``: backends with server-side dedup key on it."""
    data: bytes
    """The encoded envelope."""


class Entry(msgspec.Struct, frozen=True, gc=False):
    """One stored message, as read back."""

    position: int | str
    data: bytes
    sender: str | None = None
    """The source the backend authenticated as this entry's publisher (NATS: from the
    subject, which subject permissions restrict), or None when it cannot tell. The
    subscriber rejects an envelope in it that claims another source."""


class BackendUnusable(ConnectionError):
    """The backend answers but cannot serve kvbus as it is set up (NATS without
    JetStream); the message says what to change. Not retried (`kvbus.bus.retry`): a read
    that does not follow raises it to its consumer; an append or a following read waits
    for the backend to be usable instead of raising it."""


class RecordTooLarge(ValueError):
    """A record exceeds what the backend accepts in one message (NATS ``max_payload``).

    Raised by ``append`` before anything of the call is stored; the publisher drops
    that record, announces it as lost and appends the rest.
    """

    def __init__(self, msg_id: str, size: int, limit: int) -> None:
        super().__init__(f"message {msg_id} of {size} bytes exceeds the backend's {limit}")
        self.msg_id = msg_id


class Transport(abc.ABC):
    """The interface every backend implements.

    Delivery contract: ``append`` returns once the backend has accepted the records
    (each backend's docstring says how durable that is) and raises if it could not,
    in which case the caller retries; a retried append may store a record twice (the
    subscriber drops the duplicate). ``read`` yields entries in the stream's order.
    Entries may be missing from a read (trimmed history, a lossy live path); the
    subscriber detects that from the per-source seqs and asks ``read`` again for
    history, so a backend never has to hide a loss, only to never invent one.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "read" in vars(cls) and "read_pages" not in vars(cls):
            # A subclass that overrides only `read` (to filter or count entries) is
            # read through it, not through pages its base class makes without it.
            cls.read_pages = Transport.read_pages  # type: ignore[method-assign]

    @abc.abstractmethod
    async def append(self, stream: str, records: Sequence[Record]) -> None:
        """Store ``records`` in order at the end of ``stream``."""

    @abc.abstractmethod
    def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        """Entries after position ``after`` (``None``: from the oldest retained one;
        ``LATEST``: from the first one appended after the read starts). With
        ``follow`` the iterator then waits for new entries forever; without it, it ends
        at the newest entry stored when the read started."""

    def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        """`read`'s entries in lists, as the backend fetched them (never empty): a
        reader that wants hundreds of thousands of entries a second pays one async step
        per page instead of one per entry. By default each list holds one entry."""
        return _one_per_page(self.read(stream, after, follow=follow))

    @property
    def inline_append(self) -> Callable[[str, Sequence[Record]], None] | None:
        """An append a publisher may call on its own thread instead of awaiting
        `append`, for a backend whose append neither waits on I/O nor fails (an
        in-process log): the engine's thread then stores each message itself, and no
        sender thread is woken for it. None (the default) for backends that do I/O."""
        return None

    async def position_at(self, stream: str, wall_time: float) -> Position | None:
        """A position ``read`` can start after to yield every entry appended at or
        after ``wall_time`` (seconds since the epoch; a few earlier ones may come too),
        or None when this backend cannot tell (then read from the oldest entry). A
        consumer that only wants the recent past (the latest load of each engine) reads
        that, not the whole retained history."""
        return None

    async def put_snapshot(self, stream: str, name: str, data: bytes) -> None:
        """Store ``data`` as the snapshot ``name`` of ``stream``, replacing the last one
        (see `kvbus.wire.snapshot`); a backend that keeps none raises NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} keeps no snapshots")

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        """Every stored snapshot of ``stream`` by name; {} when none are kept."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 - optional for backends with no resources
        """Release connections; the transport is not used afterwards."""


async def _one_per_page(entries: AsyncIterator[Entry]) -> AsyncIterator[Sequence[Entry]]:
    async for entry in entries:
        yield (entry,)


async def entries_of(pages: AsyncIterator[Sequence[Entry]]) -> AsyncIterator[Entry]:
    """The entries of ``pages`` one by one: `Transport.read` for a backend that
    implements `Transport.read_pages`."""
    async for page in pages:
        for entry in page:
            yield entry


TransportFactory: TypeAlias = Callable[[str], Transport]

_BACKENDS: dict[str, str | TransportFactory] = {
    "memory": "kvbus.transports.memory:MemoryTransport",
    "zmq": "kvbus.transports.zmq:ZmqTransport",
    "nats": "kvbus.transports.nats:NatsTransport",
    "tls": "kvbus.transports.nats:NatsTransport",
    "redis": "kvbus.transports.redis:RedisTransport",
    "rediss": "kvbus.transports.redis:RedisTransport",
    "redis+sentinel": "kvbus.transports.redis:RedisTransport",
    "rediss+sentinel": "kvbus.transports.redis:RedisTransport",
}


def register(scheme: str, factory: str | TransportFactory) -> None:
    """Make ``scheme://`` URLs open ``factory(url)``; a string is ``"module:attr"``,
    imported on first use."""
    _BACKENDS[scheme] = factory


def open_transport(url: str) -> Transport:
    """A transport for ``url``, importing its backend now if this is the first use."""
    scheme = urlsplit(url).scheme
    try:
        factory = _BACKENDS[scheme]
    except KeyError:
        known = ", ".join(sorted(_BACKENDS))
        raise ValueError(f"no kvbus transport for {redact_url(url)} (schemes: {known})") from None
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        _BACKENDS[scheme] = factory
    return factory(url)
