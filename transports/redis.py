"""``redis://[[USER]:PASS@]HOST:PORT[/DB][?maxlen=N&block=MS]``: Redis Streams.

``rediss://`` connects with TLS; credentials, database and redis-py's own query options
(``ssl_cert_reqs``, ``socket_timeout``...) are passed to ``redis.asyncio.from_url``.
Each kvbus stream is the Redis stream ``kvbus:<stream>``, capped with ``XADD MAXLEN ~
maxlen`` (default 100,000 entries; an entry packs one append's messages; 0 keeps
everything). ``block`` is how long one ``XREAD BLOCK`` waits (default 1000 ms).

Delivery: ``append`` returns once Redis executed the pipelined ``XADD``s; durability
is the server's (``appendonly yes`` with ``appendfsync always`` survives a crash). A
retried append may store an entry twice; the subscriber drops the copy. A read resumes
from an entry id; when the entries after it were trimmed meanwhile, a warning names
what was lost and the subscriber reports the missing seqs as a gap. Positions are
``<entry id>/<index in the entry>``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as redis
from kvbus.transports import LATEST, Entry, Position, Record, Transport
from kvbus.transports.packing import make_packs, unpack

log = logging.getLogger("kvbus.transports.redis")

DEFAULT_MAXLEN: Final = 100_000
DEFAULT_BLOCK_MS: Final = 1000
_CHUNK: Final = 512  # entries per XRANGE / XREAD round trip
_FIELD: Final = b"d"
_MAX_SEQ: Final = 2**64 - 1


class RedisTransport(Transport):
    def __init__(self, url: str = "redis://") -> None:
        parts = urlsplit(url)
        options = []
        self.maxlen: int | None = DEFAULT_MAXLEN
        self.block_ms = DEFAULT_BLOCK_MS
        for key, value in parse_qsl(parts.query):
            if key == "maxlen":
                self.maxlen = int(value) or None
            elif key == "block":
                self.block_ms = int(value)
            else:
                options.append((key, value))
        client_url = urlunsplit(parts._replace(query=urlencode(options)))
        if not parts.netloc and not parts.path:
            client_url = f"{parts.scheme}://127.0.0.1:6379"
        self._client: redis.Redis = redis.Redis.from_url(client_url)

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        key = _key(stream)
        pipe = self._client.pipeline(transaction=False)
        for pack in make_packs(records):
            pipe.xadd(key, {_FIELD: pack.data}, maxlen=self.maxlen, approximate=True)
        await pipe.execute()

    async def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        key = _key(stream)
        client: Any = self._client  # redis-py's reply types are unions of every RESP shape
        newest = await client.xrevrange(key, count=1)
        end = newest[0][0] if newest else b"0-0"
        if after == LATEST:
            last, skip = end, -1
        elif after is None or after == "":
            last, skip = b"0-0", -1
        else:
            entry_id, _, index = str(after).rpartition("/")
            last, skip = entry_id.encode(), int(index)
            # The entry the position points into, for the envelopes after the index.
            for entry in _entries(await client.xrange(key, last, last), skip):
                yield entry
            await self._check_trimmed(key, last)
        while True:
            if follow:
                reply = await client.xread({key: last}, count=_CHUNK, block=self.block_ms)
                _raise_if_cancelled()
                batch = reply[0][1] if reply else []
            else:
                batch = await client.xrange(key, b"(" + last, end, count=_CHUNK)
                if not batch:
                    return
            for entry in _entries(batch):
                yield entry
            if batch:
                last = batch[-1][0]

    async def position_at(self, stream: str, wall_time: float) -> Position | None:
        # Entry ids are the server's append time in ms: the last possible id of the
        # millisecond before ``wall_time`` (the server's clock, not ours).
        return f"{max(0, int(wall_time * 1000) - 1)}-{_MAX_SEQ}/0"

    async def _check_trimmed(self, key: str, last: bytes) -> None:
        """Warn when entries after ``last`` were trimmed before this read got them."""
        try:
            info: dict[Any, Any] = await self._client.xinfo_stream(key)
        except redis.ResponseError:  # the key is gone (deleted, expired, other server)
            info = {"max-deleted-entry-id": b"18446744073709551615-0"}
        deleted = info.get("max-deleted-entry-id", b"0-0")
        if _id(deleted) > _id(last):
            first = info.get("first-entry")
            log.warning(
                "kvbus: redis %s history lost: entries after %s trimmed, oldest now %s",
                key,
                last.decode(),
                first[0].decode() if first else "none",
            )

    async def aclose(self) -> None:
        await self._client.aclose()


def _raise_if_cancelled() -> None:
    # redis-py can swallow a cancellation that lands while XREAD BLOCK times out, and
    # the loop would then block forever in the next XREAD.
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


def _key(stream: str) -> str:
    return f"kvbus:{stream}"


def _id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _entries(batch: list[Any], skip: int = -1) -> list[Entry]:
    out = []
    for entry_id, fields in batch:
        name = entry_id.decode()
        for index, data in enumerate(unpack(fields.get(_FIELD, b""))):
            if index > skip:
                out.append(Entry(f"{name}/{index}", data))
    return out
