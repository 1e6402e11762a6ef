"""``redis://[[USER]:PASS@]HOST:PORT[/DB][?maxlen=N&block=MS&wait=N]``: Redis Streams.

``rediss://`` connects with TLS; credentials, database and redis-py's own query options
(``ssl_cert_reqs``, ``socket_timeout``...) are passed to ``redis.asyncio.from_url``.
Each kvbus stream is the Redis stream ``kvbus:<stream>``, capped with ``XADD MAXLEN ~
maxlen`` (default 100,000 entries; an entry packs one append's messages; 0 keeps
everything). ``block`` is how long one ``XREAD BLOCK`` waits (default 1000 ms). Every call
has a timeout: ``socket_timeout`` (default 5 s) and ``socket_connect_timeout`` (2 s).

Delivery: ``append`` returns once Redis executed the pipelined ``XADD``s; durability
is the server's (``appendonly yes`` with ``appendfsync always`` survives a crash). A
retried append may store an entry twice; the subscriber drops the copy. A read resumes
from an entry id; when the entries after it were trimmed meanwhile, a warning names
what was lost and the subscriber reports the missing seqs as a gap. Positions are
``<entry id>/<index in the entry>``.

Anyone who can write the key can add an entry with an explicit id far in the future
(``XADD key 18446744073709551615-18446744073709551615``), after which every ``XADD *``
fails. Readers skip entries whose id is more than an hour ahead of this clock, and a
publisher that hits the error deletes them and resets the stream's last id, then
retries. Keep writers out with ACLs (see the README's trust model).

Replicas: ``redis+sentinel://[[USER]:PASS@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``
(``rediss+sentinel://`` for TLS) names Sentinels (default port 26379) rather than a
server; kvbus uses the primary they name for SERVICE and asks them again whenever a
connection fails, so it follows a failover (redis-py's ``Sentinel``;
``sentinel_password`` is the Sentinels' own). Every listed Sentinel is asked, and a
primary is used (and sent the password) only when ``sentinel_quorum`` of them name the
same address, healthy (default: a majority of those listed): one Sentinel that lies, or
one that an attacker answers for, cannot send kvbus's credentials and appends to a
server of its choosing. While they disagree (briefly, during a failover) a connection
fails and is retried; each disagreement is logged (once a second at most) with what
each Sentinel said, and counted in ``RedisTransport.sentinel_disagreements``.
Replication is asynchronous: an ``XADD``
the primary acknowledged and had not yet sent to the replica that is promoted is gone
after the failover, and consumers get the lost seqs as a gap. ``wait=N`` makes an append
wait (``WAIT N``, up to ``wait_timeout`` ms, default 1000) until N replicas have it, and
fail, to be retried, when fewer did: an acknowledged append then survives the failover
to any of them, at the cost of appends failing while fewer than N replicas are up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as redis
from kvbus.transports import LATEST, Entry, Position, Record, Transport, entries_of
from kvbus.transports.packing import DEFAULT_RECORDS, make_packs, unpack
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel

from kvbus.logs import LimitedLog
from kvbus.shutdown import raise_if_cancelling

log = logging.getLogger("kvbus.transports.redis")
_limited = LimitedLog(log)

DEFAULT_MAXLEN: Final = 100_000
DEFAULT_BLOCK_MS: Final = 1000
_CHUNK: Final = 512  # entries per XRANGE / XREAD round trip, at most
_PAGE_ENVELOPES: Final = 4096
"""Envelopes wanted per round trip: entries hold packs of 1 to 65,536 envelopes, and a
page much larger than this is cold in the CPU's caches by the time it is consumed."""
_FIELD: Final = b"d"
_MAX_SEQ: Final = 2**64 - 1
_FUTURE_MS: Final = 3600 * 1000  # an entry id further ahead of this clock is forged
_DEFAULT_TIMEOUTS: Final = (("socket_timeout", "5"), ("socket_connect_timeout", "2"))
_DEFAULT_WAIT_MS: Final = 1000
_SENTINEL_PORT: Final = 26379


class RedisTransport(Transport):
    def __init__(self, url: str = "redis://") -> None:
        parts = urlsplit(url)
        options = []
        self.maxlen: int | None = DEFAULT_MAXLEN
        self.block_ms = DEFAULT_BLOCK_MS
        self.wait_replicas = 0
        self.wait_ms = _DEFAULT_WAIT_MS
        given = parse_qsl(parts.query)
        names = {key for key, _ in given}
        for key, value in [*given, *(d for d in _DEFAULT_TIMEOUTS if d[0] not in names)]:
            if key == "maxlen":
                self.maxlen = int(value) or None
            elif key == "block":
                self.block_ms = int(value)
            elif key == "wait":
                self.wait_replicas = int(value)
            elif key == "wait_timeout":
                self.wait_ms = int(value)
            else:
                options.append((key, value))
        self._sentinel: _QuorumSentinel | None = None
        if parts.scheme.endswith("+sentinel"):
            self._sentinel, self._client = _sentinel_client(parts, options)
        else:
            client_url = urlunsplit(parts._replace(query=urlencode(options)))
            if not parts.netloc and not parts.path:
                client_url = f"{parts.scheme}://127.0.0.1:6379"
            self._client = redis.Redis.from_url(client_url)
        # Entries as the server sends them, ``[id, [field, value, ...]]``: redis-py's
        # callbacks build a tuple and a dict for each (a third of a one-envelope entry's
        # read), to be taken apart again at once.
        for command in ("XRANGE", "XREVRANGE", "XREAD"):
            self._client.set_response_callback(command, _as_sent)

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        key = _key(stream)
        pipe = self._client.pipeline(transaction=False)
        for pack in make_packs(records):
            pipe.xadd(key, {_FIELD: pack.data}, maxlen=self.maxlen, approximate=True)
        if self.wait_replicas:
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)
        try:
            replies = await pipe.execute()
        except redis.ResponseError as error:
            if "last possible ID" in str(error) or "top item" in str(error):
                await self._drop_future_entries(key)
            raise  # the publisher retries
        if self.wait_replicas and replies[-1] < self.wait_replicas:
            raise ConnectionError(
                f"redis: {replies[-1]} of {self.wait_replicas} replicas had the append "
                f"after {self.wait_ms} ms"
            )

    async def _drop_future_entries(self, key: str) -> None:
        """Delete entries whose ids are ahead of the clock and set the stream's last id
        back to its newest real entry, so that ``XADD *`` works again."""
        client: Any = self._client
        horizon = f"{int(time.time() * 1000) + _FUTURE_MS}-0"
        forged = [entry_id for entry_id, _ in await client.xrevrange(key, "+", horizon)]
        if forged:
            await client.xdel(key, *forged)
        newest = await client.xrevrange(key, count=1)
        await client.execute_command("XSETID", key, newest[0][0] if newest else "0-1")
        log.error(
            "kvbus: redis %s had %d entries with ids ahead of the clock (an XADD with an "
            "explicit id: restrict writes with ACLs); deleted them and reset the last id",
            key,
            len(forged),
        )

    def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        # This class's pages, not a subclass's: those may be built on this very read.
        return entries_of(RedisTransport.read_pages(self, stream, after, follow=follow))

    async def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
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
            page = _entries(await client.xrange(key, last, last), skip)
            if page:
                yield page
            await self._check_trimmed(key, last)
        count = 8  # entries in the first round trip; then as many as held _PAGE_ENVELOPES
        while True:
            if follow:
                reply = await client.xread({key: last}, count=count, block=self.block_ms)
                # redis-py can swallow a cancel that lands mid-command (kvbus.shutdown):
                # a closing reader must not read on (and block in the next XREAD).
                raise_if_cancelling()
                batch = _read_entries(reply)
            else:
                batch = await client.xrange(key, b"(" + last, end, count=count)
                raise_if_cancelling()
                if not batch:
                    return
            horizon = time.time() * 1000 + _FUTURE_MS
            real = batch  # ids increase: a forged one (far ahead) can only be last ones
            if batch and _id(batch[-1][0])[0] > horizon:
                real = [e for e in batch if _id(e[0])[0] <= horizon]
            if real:
                last = real[-1][0]
                page = _entries(real)
                # As many entries next time as held about _PAGE_ENVELOPES this time.
                count = max(1, min(_CHUNK, len(real) * _PAGE_ENVELOPES // max(1, len(page))))
                if page:
                    yield page
            elif batch:  # only a forged entry ahead: do not spin on it
                await asyncio.sleep(self.block_ms / 1000)
                if not follow:
                    return

    async def position_at(self, stream: str, wall_time: float) -> Position | None:
        # Entry ids are the server's append time in ms: the last possible id of the
        # millisecond before ``wall_time`` (the server's clock, not ours).
        return f"{max(0, int(wall_time * 1000) - 1)}-{_MAX_SEQ}/0"

    async def put_snapshot(self, stream: str, name: str, data: bytes) -> None:
        await self._client.hset(f"{_key(stream)}:snapshots", name, data)

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        client: Any = self._client
        stored = await client.hgetall(f"{_key(stream)}:snapshots")
        return {name.decode(): data for name, data in stored.items()}

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

    @property
    def sentinel_disagreements(self) -> int:
        """Times the Sentinels asked for the primary named no address ``sentinel_quorum``
        of them agreed on (0 without Sentinels)."""
        return self._sentinel.disagreements if self._sentinel is not None else 0

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()


class _QuorumSentinel(Sentinel):
    """redis-py's ``Sentinel``, but a primary's address counts only when ``quorum`` of
    the Sentinels name it: redis-py takes the first Sentinel that answers with a healthy
    primary, so a rogue Sentinel listed first (or a host that answers for one) would be
    sent the server password and every append."""

    def __init__(self, sentinels: list[tuple[str, int]], quorum: int, **options: Any) -> None:
        super().__init__(sentinels, **options)  # type: ignore[no-untyped-call]
        self.quorum = quorum
        self.disagreements = 0

    def check_master_state(self, state: dict[str, Any], service_name: str) -> bool:
        """redis-py's check, and none while the Sentinel is failing the primary over:
        until the failover ends ``SENTINEL MASTER`` names the old primary, and one back
        from a restart answers as a primary until the Sentinel demotes it, when its
        resync from the new one wipes what it took (appends acknowledged, then lost)."""
        if "failover_in_progress" in str(state.get("flags", "")).split(","):
            return False
        return bool(super().check_master_state(state, service_name))

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        answers = await asyncio.gather(
            *(self._primary_named_by(sentinel, service_name) for sentinel in self.sentinels),
            return_exceptions=True,
        )
        votes = Counter(a for a in answers if isinstance(a, tuple))
        if votes:
            address, count = votes.most_common(1)[0]
            if count >= self.quorum:
                return address
        self.disagreements += 1
        said = ", ".join(
            f"{_address_of(sentinel)}: {_said(answer)}"
            for sentinel, answer in zip(self.sentinels, answers, strict=True)
        )
        _limited.warning(
            "sentinel-quorum",
            "kvbus: no primary for %r named by %d of %d Sentinels (%s); retrying",
            service_name,
            self.quorum,
            len(self.sentinels),
            said,
        )
        raise MasterNotFoundError(
            f"no primary for {service_name!r} named by {self.quorum} of "
            f"{len(self.sentinels)} Sentinels ({said})"
        )

    async def _primary_named_by(self, sentinel: Any, service_name: str) -> tuple[str, int] | None:
        """The address one Sentinel names as the healthy primary of ``service_name``,
        None if it names none (errors are raised: a Sentinel down has no vote)."""
        state = await sentinel.sentinel_master(service_name)
        if not self.check_master_state(state, service_name):
            return None
        return str(state["ip"]), int(state["port"])


def _address_of(sentinel: Any) -> str:
    kwargs = sentinel.connection_pool.connection_kwargs
    return f"{kwargs.get('host')}:{kwargs.get('port')}"


def _said(answer: object) -> str:
    if isinstance(answer, tuple):
        return f"{answer[0]}:{answer[1]}"
    if answer is None:
        return "no healthy primary"
    return type(answer).__name__  # an error's text may echo what the peer sent


def _sentinel_client(
    parts: SplitResult, options: list[tuple[str, str]]
) -> tuple[_QuorumSentinel, redis.Redis]:
    """redis-py's ``Sentinel`` for the hosts of a ``redis+sentinel://`` URL and a client of
    the primary they name for the service in its path."""
    from redis.asyncio.connection import SSLConnection, parse_url

    credentials, _, hosts = parts.netloc.rpartition("@")
    service, _, db = parts.path.strip("/").partition("/")
    if not hosts or not service:
        raise ValueError("redis+sentinel:// needs HOST:PORT[,HOST:PORT...]/SERVICE")
    sentinels = [urlsplit(f"//{host}") for host in hosts.split(",")]
    sentinel_password = dict(options).get("sentinel_password")
    quorum = int(dict(options).get("sentinel_quorum", len(sentinels) // 2 + 1))
    if not 1 <= quorum <= len(sentinels):
        raise ValueError(f"sentinel_quorum={quorum}: 1 to the {len(sentinels)} Sentinels listed")
    options = [(k, v) for k, v in options if k not in ("sentinel_password", "sentinel_quorum")]
    # The server options, read as redis.from_url reads them.
    scheme = parts.scheme.removesuffix("+sentinel")
    at = f"{credentials}@" if credentials else ""
    url = urlunsplit((scheme, f"{at}sentinel", f"/{db}", urlencode(options), ""))
    server: dict[str, Any] = dict(parse_url(url))
    server.pop("host")
    # SentinelConnectionPool picks its own connection class (TLS with ssl=True).
    server["ssl"] = server.pop("connection_class", None) is SSLConnection
    sentinel_options = {k: v for k, v in server.items() if k.startswith("socket_")}
    if sentinel_password:
        sentinel_options["password"] = sentinel_password
    sentinel = _QuorumSentinel(
        [(s.hostname or "127.0.0.1", s.port or _SENTINEL_PORT) for s in sentinels],
        quorum,
        sentinel_kwargs=sentinel_options,
        **server,
    )
    return sentinel, sentinel.master_for(service)


def _key(stream: str) -> str:
    return f"kvbus:{stream}"


def _id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


# "/0", "/1", ...: as many as a publisher's pack holds by default; joining an entry id to
# one of these costs a third of formatting the index (~65 ns an envelope).
_SUFFIXES: Final = [f"/{i}" for i in range(DEFAULT_RECORDS)]


def _as_sent(response: Any, **options: Any) -> Any:
    return response


def _read_entries(reply: Any) -> list[Any]:
    """The entries of an ``XREAD`` of one key: ``{key: entries}`` in RESP3 (redis-py's
    default protocol), ``[[key, entries]]`` in RESP2, empty when it timed out."""
    if not reply:
        return []
    return next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]


def _data(fields: list[bytes]) -> bytes:
    """The ``d`` field's value among an entry's ``[field, value, ...]`` (b"" if none:
    an entry not written by kvbus)."""
    if len(fields) == 2 and fields[0] == _FIELD:  # what kvbus writes
        return fields[1]
    return dict(zip(fields[::2], fields[1::2], strict=False)).get(_FIELD, b"")


def _entries(batch: list[Any], skip: int = -1) -> list[Entry]:
    out: list[Entry] = []
    first = max(0, skip + 1)  # a position's index is the caller's: any int
    for entry_id, fields in batch:
        envelopes = unpack(_data(fields))
        if len(envelopes) == 1 and not first:  # a publisher's append at production rates
            out.append(Entry(entry_id.decode() + "/0", envelopes[0]))
            continue
        suffixes = _SUFFIXES
        if len(envelopes) > len(suffixes):
            suffixes = [f"/{i}" for i in range(len(envelopes))]
        positions = map(entry_id.decode().__add__, suffixes[first : len(envelopes)])
        out += map(Entry, positions, envelopes[first:])
    return out
