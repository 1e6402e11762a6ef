"""``nats://[USER:PASS@]HOST:PORT[,HOST:PORT...][?OPTIONS]``: NATS JetStream.

``tls://`` connects with TLS, and credentials in the URL are used the way nats-py uses
them. Each kvbus stream is a JetStream stream ``KVBUS_<stream>`` on the subjects
``kvbus.<stream>.<source>`` (a ``.``, ``*`` or ``>`` in a source is %-escaped). It is
created on first use with file storage and these query options' limits:

=================== ============================================================
``max_age``         seconds a message is kept (default: forever)
``max_bytes``       bytes kept (default: unlimited)
``max_msgs``        stored entries kept (an entry packs one append's messages)
``replicas``        JetStream replicas (default 1)
``storage``         ``file`` (default) or ``memory``
``duplicate_window`` seconds the server remembers message ids (default 120)
``timeout``         seconds to wait for acks and API replies (default 5)
``update_stream``   ``1``: change an existing stream's limits to these (default 0)
=================== ============================================================

Retention belongs to whoever creates the stream (the first client to use it: give
publishers and readers the same URL) or runs with ``update_stream=1``: a client whose
limits differ from an existing stream's changes nothing and logs the difference once,
so a reader opened with ``?max_msgs=2`` cannot delete what others still need. kvbus
asks nothing more of the server; NATS permissions are what stop a hostile client (deny
``$JS.API.STREAM.UPDATE.KVBUS_*``, ``...DELETE`` and ``...PURGE`` to all but operators).

Delivery: ``append`` returns once JetStream acknowledged every record (stored per the
stream's storage and the server's ``sync_interval``; use ``sync_interval: always`` to
survive a machine crash, not only a server crash). Each stored entry carries
``Nats-Msg-Id`` = ``source:epoch:seq+count`` of its records and a keyed hash of that and
the subject, so a retried append within the duplicate window is dropped by the server,
and nobody else can send a message id ahead of the publisher to have its packs dropped.

Trust: the subject names the publishing source, and a reader rejects an envelope that
claims another (`Entry.sender`), so subject permissions (``publish:
kvbus.kv.engine-a``) are what authenticates a publisher. All packs of an append are in flight
together (``publish_async``), never one round trip per message. Reads use an ephemeral
pull consumer (in server memory, no acks) from a stream sequence, one pull request of at
most 1,024 messages and 8 MiB in flight, so a reader that falls behind holds back the
server instead of overflowing its client; each message's delivery count is checked, and
a skipped delivery recreates the consumer after the last message read. Reads reconnect
forever through nats-py's own reconnection; the server sends a heartbeat to an idle
pull request every 0.5 s, and a consumer silent for two of them (gone with its server)
is replaced as soon as the stream answers. Positions are ``stream_seq << 16 | index``.

JetStream must be enabled on the server (``nats-server -js``, or a ``jetstream {}``
block in its config). On a server without it, every JetStream request goes unanswered
("no responders"); the transport confirms that by asking for the account's JetStream
info and then says what to do, once per process and server, at ERROR: ``nats://HOST:PORT
has no JetStream: start nats-server with -js (or enable jetstream in its config)``. An
append or a following read then waits, asking again every `JETSTREAM_RECHECK` seconds,
and goes on by itself once JetStream answers; a read that does not follow, a position or
snapshot request raises `JetStreamUnavailable` with that message.

Clusters: name several servers (``nats://h1:4222,h2:4222,h3:4222?replicas=3``); nats-py
connects to one, learns the others from the cluster and moves on when its server dies.
With ``replicas=3`` an append is acknowledged once a majority of the replicas stored it,
so the loss of any one server loses nothing acknowledged. When the stream leader's server
dies, JetStream takes seconds to elect another (5-8 s in tests/test_cluster.py); until
then nothing answers for the stream: appends fail at once with "no responders" and the
publisher retries (its queue holds what is published meanwhile, and message ids make a
retry of a stored pack harmless), and a read whose consumer died with a server is
restarted from its position once the stream answers again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final
from urllib.parse import parse_qs, quote, unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
from kvbus.transports import LATEST, BackendUnusable, Entry, Position, Record, Transport, entries_of
from kvbus.transports.packing import entries_after, make_packs, position, split_position
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

from kvbus.config import redact_text, redact_url

log = logging.getLogger("kvbus.transports.nats")

DEFAULT_TIMEOUT: Final = 5.0
_HEADER_ROOM: Final = 512  # room left in max_payload for the headers of one message
_WHOLE_PACK: Final = 0xFFFF  # an index past any pack's last message
_PROBE_TIMEOUT: Final = 0.5  # seconds a leaderless stream's info request is waited for
_IDLE_CHECK: Final = 1.0  # seconds between a finite read's looks at the stream's end
_HEARTBEAT: Final = 0.5  # seconds between the server's heartbeats to an idle pull request
_PULL_BATCH: Final = 1024  # messages one pull request asks for
_PULL_BYTES: Final = 8 << 20  # bytes one pull request asks for (at least 2 max_payloads)
_PULL_EXPIRES: Final = 30.0  # seconds the server holds a pull request that found nothing
_CONSUMER_IDLE: Final = 120.0  # seconds without a pull request before a consumer is removed
JETSTREAM_RECHECK: Final = 2.0
"""Seconds between an append's or a following read's asks whether a server found without
JetStream has it now (restarted with ``-js``): one small request each."""


_LIMIT_OPTIONS: Final[dict[str, tuple[str, Callable[[str], Any]]]] = {
    # URL option: (its StreamConfig field, how its text is read)
    "max_age": ("max_age", float),
    "max_bytes": ("max_bytes", int),
    "max_msgs": ("max_msgs", int),
    "replicas": ("num_replicas", int),
    "duplicate_window": ("duplicate_window", float),
    "storage": ("storage", api.StorageType),
}
_OPTION_OF_FIELD: Final = {field: option for option, (field, _) in _LIMIT_OPTIONS.items()}
_no_jetstream_warned: set[str] = set()
"""Servers (as URLs show them, credentials hidden) already said to have no JetStream:
however many transports and retries a process has, it says so once per server."""
_limits_kept_warned: set[tuple[str, str, str, str]] = set()
"""The limit mismatches already logged: a process that opens many transports says each
once. Keyed by what the URLs configure, not by anything from the network."""


def _take_option(
    query: dict[str, str], option: str, convert: Callable[[str], Any], url: str
) -> Any:
    """``query``'s ``option`` (removed from it) converted, or None when absent; a value
    that does not convert is a ValueError naming it, the URL's credentials hidden."""
    if option not in query:
        return None
    text = query.pop(option)
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"bad nats:// option {option}={text!r} in {redact_url(url)}") from None


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError(text)


def _describe_limits(limits: dict[str, Any]) -> str:
    """``max_msgs=2, storage=file``: limits by StreamConfig field, as a URL names them."""
    return ", ".join(
        f"{_OPTION_OF_FIELD.get(field, field)}={getattr(value, 'value', value)}"
        for field, value in sorted(limits.items())
    )


class JetStreamUnavailable(BackendUnusable):
    """The NATS server answers, but nothing serves JetStream's API: it runs without
    ``-js`` (or this account has no JetStream). The message says what to do; retrying
    helps only once an operator has enabled it."""


def _no_responders(error: Exception) -> bool:
    """A JetStream API request nobody answered (nats-py turns the server's 503 "no
    responders" status into a bare ServiceUnavailableError; an answer from JetStream
    itself carries a code)."""
    return isinstance(error, nats.js.errors.ServiceUnavailableError) and error.code is None


def _subject_token(source: str) -> str:
    return quote(source, safe="").replace(".", "%2E").replace("*", "%2A").replace(">", "%3E")


class NatsTransport(Transport):
    def __init__(self, url: str = "nats://") -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        netloc = parts.netloc or "127.0.0.1:4222"
        credentials, _, hosts = netloc.rpartition("@")
        prefix = f"{parts.scheme}://{credentials + '@' if credentials else ''}"
        self.servers = [prefix + host for host in hosts.split(",")]
        self._display = redact_url(f"{parts.scheme}://{netloc}")
        timeout = _take_option(query, "timeout", float, url)
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._update_stream = bool(_take_option(query, "update_stream", _flag, url))
        self._limits: dict[str, Any] = {}
        """The URL's limits by StreamConfig field: a new stream's, or an existing one's
        with ``update_stream``."""
        for option, (field, convert) in _LIMIT_OPTIONS.items():
            value = _take_option(query, option, convert, url)
            if value is not None:
                self._limits[field] = value
        if query:
            raise ValueError(f"unknown nats:// options {sorted(query)} in {redact_url(url)}")
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._ready: set[str] = set()
        self._last_error = ""
        self._id_key = os.urandom(16)  # makes this publisher's message ids unguessable
        self._reconnects = 0
        self._connection_lost: asyncio.Future[None] | None = None
        """Resolved when the connection drops: the acks in flight will never come."""

    async def _connect(self) -> JetStreamContext:
        if self._js is None:
            # nats-py retries a first connect for ever (max_reconnect_attempts=-1):
            # bound it, so the caller counts a failure and retries.
            async with asyncio.timeout(self.timeout):
                self._nc = await self._open()
            self._js = self._nc.jetstream(timeout=self.timeout)
        return self._js

    async def _open(self) -> Client:
        return await nats.connect(
            self.servers,
            name="kvbus",
            max_reconnect_attempts=-1,  # reconnect forever
            reconnect_time_wait=0.5,
            connect_timeout=2,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )

    async def _on_error(self, error: Exception) -> None:
        # nats-py reports every failed reconnect attempt; say each new kind once.
        if repr(error) != self._last_error:
            self._last_error = repr(error)
            log.warning("kvbus: nats %s: %s", self._display, redact_text(repr(error), self.servers))

    async def _on_disconnected(self) -> None:
        lost, self._connection_lost = self._connection_lost, None
        if lost is not None and not lost.done():
            lost.set_result(None)
        if self._nc is not None and not (self._nc.is_closed or self._nc.is_draining):
            log.warning("kvbus: nats disconnected from %s; reconnecting", self._display)

    async def _on_reconnected(self) -> None:
        self._reconnects += 1  # reads send a new pull request: the last may be lost
        log.warning("kvbus: nats reconnected")

    async def _stream(self, stream: str, *, wait: bool = False) -> str:
        """The JetStream stream's name, created with the URL's limits (an existing one
        changed to them only with ``update_stream``) once. On a server without
        JetStream: `JetStreamUnavailable`, or with ``wait`` a wait until it has it."""
        name = f"KVBUS_{stream}"
        if stream in self._ready:
            return name
        js = await self._connect()
        while True:
            try:
                info = await js.stream_info(name)
            except nats.js.errors.ServiceUnavailableError as error:
                await self._without_jetstream(js, error, wait)
                continue  # JetStream answers now
            except nats.js.errors.NotFoundError:
                info = None
            break
        if info is not None:
            await self._check_limits(js, name, info.config)
        else:
            config = {"storage": api.StorageType.FILE, **self._limits}
            try:
                await js.add_stream(name=name, subjects=[f"kvbus.{stream}.>"], **config)
            except nats.js.errors.BadRequestError as refused:
                # Created meanwhile by another client, with its own limits; or refused
                # (a limit the server cannot meet), which leaves no stream to use.
                try:
                    existing = (await js.stream_info(name)).config
                except nats.js.errors.NotFoundError:
                    raise refused from None
                await self._check_limits(js, name, existing)
        self._ready.add(stream)
        return name

    async def _without_jetstream(
        self, js: JetStreamContext, error: nats.js.errors.ServiceUnavailableError, wait: bool
    ) -> None:
        """After ``error`` from a JetStream API request: raise it unless JetStream is
        missing altogether (`_jetstream_missing`); if it is, say so once per process and
        raise `JetStreamUnavailable`, or with ``wait`` return once it answers."""
        if not (_no_responders(error) and await self._jetstream_missing(js)):
            raise error
        message = (
            f"{self._display} has no JetStream: start nats-server with -js "
            "(or enable jetstream in its config)"
        )
        if self._display not in _no_jetstream_warned:
            _no_jetstream_warned.add(self._display)
            log.error("kvbus: %s", message)
        if not wait:
            raise JetStreamUnavailable(message) from None
        while True:  # polled: nothing announces that a server has JetStream now
            await asyncio.sleep(JETSTREAM_RECHECK)
            if not await self._jetstream_missing(js):
                break
        log.warning("kvbus: %s has JetStream now", self._display)

    @staticmethod
    async def _jetstream_missing(js: JetStreamContext) -> bool:
        """Whether no JetStream serves this connection's account: nobody answers the
        account info request either (a JetStream server always answers that one
        itself, even while a stream has no leader). Other errors are raised."""
        try:
            await js.account_info()
        except nats.js.errors.ServiceUnavailableError as error:
            if _no_responders(error):
                return True
            raise
        return False

    async def _check_limits(
        self, js: JetStreamContext, name: str, existing: api.StreamConfig
    ) -> None:
        """An existing stream's limits against the URL's: changed to them with
        ``update_stream``, else kept, the difference logged once."""
        wanted = {k: v for k, v in self._limits.items() if getattr(existing, k, None) != v}
        if not wanted:
            return
        if self._update_stream:
            await js.update_stream(existing.evolve(**wanted))
            log.warning(
                "kvbus: nats stream %s on %s: limits changed to %s (update_stream=1)",
                name,
                self._display,
                _describe_limits(wanted),
            )
            return
        kept = _describe_limits({k: getattr(existing, k, None) for k in wanted})
        asked = _describe_limits(wanted)
        if (self._display, name, asked, kept) in _limits_kept_warned:
            return
        _limits_kept_warned.add((self._display, name, asked, kept))
        log.warning(
            "kvbus: nats stream %s on %s keeps its limits %s, not the URL's %s "
            "(a stream's limits are set when it is created; add update_stream=1 to change them)",
            name,
            self._display,
            kept,
            asked,
        )

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        await self._stream(stream, wait=True)
        js = await self._connect()
        assert self._nc is not None
        packs = make_packs(records, self._nc.max_payload - _HEADER_ROOM)
        acks = []
        for pack in packs:
            subject = f"kvbus.{stream}.{_subject_token(pack.source)}"
            acks.append(
                await js.publish_async(
                    subject, pack.data, headers={"Nats-Msg-Id": self._msg_id(subject, pack.msg_id)}
                )
            )
        if self._connection_lost is None:
            self._connection_lost = asyncio.get_running_loop().create_future()
        acked = asyncio.ensure_future(asyncio.gather(*acks))
        # A server killed with these in flight never acks them: fail as soon as the
        # connection drops, not after the ack timeout, so the caller retries (dedup
        # makes that safe) and nats-py sends the retry the moment it has reconnected.
        waiting: list[asyncio.Future[Any]] = [acked, self._connection_lost]
        done, _ = await asyncio.wait(waiting, timeout=self.timeout, return_when="FIRST_COMPLETED")
        if acked not in done:
            acked.cancel()
            await asyncio.gather(acked, return_exceptions=True)
            lost = "the connection dropped" if done else f"none in {self.timeout}s"
            raise ConnectionError(f"nats: {len(acks)} acks pending, {lost}")
        try:
            acked.result()
        except nats.js.errors.NoStreamResponseError:
            await self._forget_if_deleted(stream)
            raise

    async def _forget_if_deleted(self, stream: str) -> None:
        """After a publish no stream answered, create the stream again on the next
        append if it was deleted.

        In a cluster, nothing answers for seconds while a new leader is elected after
        the stream leader's server died, and asking for the stream's info then waits out
        the whole timeout: so ask briefly, and forget the stream only when JetStream says
        it does not exist. A publisher retries; its packs go through once a leader is.
        """
        js = await self._connect()
        try:
            await self._probe(js, f"KVBUS_{stream}")
        except nats.js.errors.NotFoundError:
            self._ready.discard(stream)

    @staticmethod
    async def _probe(js: JetStreamContext, name: str) -> api.StreamState | None:
        """The stream's state, or None when no leader answers now (a cluster electing
        one): after a short wait, not the whole timeout."""
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT):
                return (await js.stream_info(name)).state
        except (
            TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError,
        ) as error:
            log.debug("kvbus: nats stream %s has no leader now: %r", name, error)
            return None

    def _msg_id(self, subject: str, msg_id: str) -> str:
        """The same for every retry of a pack by this transport, unguessable by others."""
        digest = hashlib.blake2s(f"{subject} {msg_id}".encode(), key=self._id_key, digest_size=8)
        return f"{msg_id}:{digest.hexdigest()}"

    def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        return entries_of(NatsTransport.read_pages(self, stream, after, follow=follow))

    async def read_pages(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        name = await self._stream(stream, wait=follow)
        js = await self._connect()
        state = (await js.stream_info(name)).state
        end = state.last_seq
        skip = -1
        if after == LATEST:
            start = end + 1
        elif after is None or after == "":
            start = None
        else:
            start, skip = split_position(int(after))
        if not follow and end < (start or state.first_seq or 1):
            return
        async for page in self._read_pages(js, name, stream, start, skip, end, follow):
            yield page

    async def _snapshot_store(self, stream: str) -> Any:
        js = await self._connect()
        bucket = f"KVBUS_SNAP_{stream}"
        try:
            return await js.object_store(bucket)
        except nats.js.errors.NotFoundError:
            return await js.create_object_store(bucket)
        except nats.js.errors.ServiceUnavailableError as error:
            await self._without_jetstream(js, error, wait=False)
            raise  # JetStream answered meanwhile: the caller tries again

    async def put_snapshot(self, stream: str, name: str, data: bytes) -> None:
        store = await self._snapshot_store(stream)
        await store.put(_subject_token(name), data)

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        store = await self._snapshot_store(stream)
        try:
            infos = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return {}
        found = {}
        for info in infos:
            found[unquote(info.name)] = (await store.get(info.name)).data or b""
        return found

    async def position_at(self, stream: str, wall_time: float) -> Position | None:
        """From the first stored message at or after ``wall_time`` (the server's
        clock), found by a consumer that starts there."""
        name = await self._stream(stream)
        js = await self._connect()
        state = (await js.stream_info(name)).state
        start = datetime.datetime.fromtimestamp(wall_time, datetime.timezone.utc)
        sub = await js.subscribe(
            f"kvbus.{stream}.>",
            stream=name,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_TIME,
                opt_start_time=start,
            ),
        )
        try:
            first = (await sub.next_msg(timeout=self.timeout)).metadata.sequence.stream
        except nats.errors.TimeoutError:
            first = state.last_seq + 1  # nothing since: start with the next one
        finally:
            await _quietly(sub.unsubscribe())
        if first <= max(state.first_seq, 1):
            return None  # all of the retained history is that recent
        return position(first - 1, _WHOLE_PACK)

    async def _read_pages(
        self,
        js: JetStreamContext,
        name: str,
        stream: str,
        start: int | None,
        skip: int,
        end: int,
        follow: bool,
    ) -> AsyncIterator[list[Entry]]:
        """The stream's messages from ``start`` in order, through an ephemeral pull
        consumer: one pull request at a time, so at most one request's messages wait in
        this client (a push consumer keeps sending to a reader that fell behind until
        nats-py's pending limit drops messages). Each message's delivery count is
        checked; a skipped one (lost in a reconnect) recreates the consumer after the
        last message read, so nothing is skipped silently."""
        nc = self._nc
        assert nc is not None
        wake = asyncio.Event()
        request_bytes = max(_PULL_BYTES, 2 * nc.max_payload)
        request = _pull_request(request_bytes)

        async def open_inbox() -> tuple[Subscription, collections.deque[Msg]]:
            """A new inbox for each consumer: what a replaced consumer still sends
            (messages, its "Consumer Deleted" status) goes to its own, unread."""
            arrived: collections.deque[Msg] = collections.deque()

            async def receive(msg: Msg) -> None:
                arrived.append(msg)
                wake.set()

            sub = await nc.subscribe(
                nc.new_inbox(),
                cb=receive,
                pending_msgs_limit=4 * _PULL_BATCH,
                pending_bytes_limit=8 * request_bytes,
            )
            return sub, arrived

        sub, arrived = await open_inbox()
        consumer: str | None = None
        delivered = 0  # the consumer's delivery count of the last message taken
        pulling = False  # a pull request is in flight
        taken = 0  # messages it brought so far
        reconnects = self._reconnects
        seen = (start or 1) - 1
        prefix = f"kvbus.{stream}."
        loop = asyncio.get_running_loop()
        heard = loop.time()  # when the consumer last sent anything, heartbeats included
        checked = heard  # when a read without follow last looked at the stream's end
        patience = 2 * _HEARTBEAT  # how long to wait for the consumer before looking
        try:
            while True:
                if consumer is None:
                    if delivered or pulling:  # replacing one
                        await _quietly(sub.unsubscribe())
                        sub, arrived = await open_inbox()
                    consumer = await self._pull_consumer(
                        js, name, stream, seen + 1 if seen or start is not None else None
                    )
                    delivered, pulling, heard = 0, False, loop.time()
                if not pulling or reconnects != self._reconnects:
                    # The request in flight ended, or may have died with a connection.
                    reconnects = self._reconnects
                    await nc.publish(
                        f"$JS.API.CONSUMER.MSG.NEXT.{name}.{consumer}",
                        request,
                        reply=sub.subject,
                    )
                    pulling, taken = True, 0
                if not arrived:
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(patience):
                            await wake.wait()
                    now = loop.time()
                    if not arrived and now - heard > 2 * _HEARTBEAT:
                        # Two heartbeats missed: the consumer died with its server (or
                        # the stream's leader), or the request with a connection. Read
                        # on with a new consumer as soon as the stream answers again
                        # (a cluster electing a leader: asked every ~0.1-0.5 s).
                        if await self._probe(js, name) is None:
                            patience = 0.1
                        else:
                            log.info("kvbus: nats consumer of %s silent; a new one", name)
                            consumer, patience = None, 2 * _HEARTBEAT
                    elif not follow and now - checked > _IDLE_CHECK:
                        # Messages up to the end may have been deleted meanwhile.
                        checked = now
                        state = await self._probe(js, name)
                        if state is not None and (seen >= end or state.first_seq > end):
                            return
                    continue
                heard = loop.time()
                page: list[Entry] = []
                while arrived:
                    msg = arrived.popleft()
                    if msg.headers and (status := msg.headers.get("Status")):
                        if status == "100":
                            continue  # a heartbeat: the consumer and the request live
                        if status == "503" or "Deleted" in msg.headers.get("Description", ""):
                            # Nobody serves the consumer: it died with its server, or
                            # was removed after a long pause of this reader.
                            log.info("kvbus: nats consumer of %s gone (%s)", name, status)
                            consumer = None
                            break
                        if status == "409" and taken == 0:
                            if "MaxBytes" in msg.headers.get("Description", ""):
                                # The next message is larger than a request may bring.
                                request_bytes *= 2
                                request = _pull_request(request_bytes)
                        pulling = False  # 404, 408, 409: the request ended
                        continue
                    sequence, consumer_sequence = _sequences(msg)
                    if consumer_sequence != delivered + 1:
                        log.info(
                            "kvbus: nats read of %s skipped deliveries; resuming after %d",
                            name,
                            seen,
                        )
                        await _quietly(js.delete_consumer(name, consumer))
                        consumer = None
                        break
                    delivered += 1
                    taken += 1
                    pulling = taken < _PULL_BATCH
                    if start is not None and sequence > seen + 1 and seen == start - 1:
                        log.warning(
                            "kvbus: nats %s history lost: asked from %d, oldest retained %d",
                            name,
                            start,
                            sequence,
                        )
                    # The subject's token is the source its publisher was allowed to
                    # send as.
                    sender = unquote(msg.subject[len(prefix) :])
                    for position, data in entries_after(
                        sequence, msg.data, skip if sequence == start else -1
                    ):
                        page.append(Entry(position, data, sender))
                    seen = sequence
                    if not follow and seen >= end:
                        break
                if page:
                    yield page
                if not follow and seen >= end:
                    return
        finally:
            await _quietly(sub.unsubscribe())
            if consumer is not None:
                await _quietly(js.delete_consumer(name, consumer))

    async def _pull_consumer(
        self, js: JetStreamContext, name: str, stream: str, start: int | None
    ) -> str:
        """A new ephemeral pull consumer of the whole stream from ``start`` (None: the
        oldest message), held in the server's memory: the reader keeps its position."""
        consumer = f"kvbus-{os.urandom(8).hex()}"
        await js.add_consumer(
            name,
            config=api.ConsumerConfig(
                name=consumer,
                deliver_policy=api.DeliverPolicy.ALL
                if start is None
                else api.DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start,
                ack_policy=api.AckPolicy.NONE,
                filter_subject=f"kvbus.{stream}.>",
                inactive_threshold=_CONSUMER_IDLE,
                num_replicas=1,
                mem_storage=True,
            ),
        )
        return consumer

    async def aclose(self) -> None:
        if self._nc is not None:
            nc, self._nc, self._js = self._nc, None, None
            # close(), not drain(): every append already waited for its acks, and a
            # drain waits for subscriptions' queues that nobody empties any more.
            await _quietly(nc.close())


def _pull_request(max_bytes: int) -> bytes:
    """A pull request's body: up to a batch of messages or ``max_bytes``, held by the
    server while nothing is stored, with heartbeats meanwhile."""
    return json.dumps(
        {
            "batch": _PULL_BATCH,
            "max_bytes": max_bytes,
            "expires": int(_PULL_EXPIRES * 1e9),
            "idle_heartbeat": int(_HEARTBEAT * 1e9),
        }
    ).encode()


def _sequences(msg: Msg) -> tuple[int, int]:
    """A JetStream delivery's (stream sequence, consumer sequence), read from its reply
    subject: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>...``
    (9 tokens), or with a domain and an account hash after ``ACK`` (11 or more). nats-py's
    ``msg.metadata`` builds a datetime and three dataclasses: 2.7 µs against 0.4, a
    fifth of a message's read. Any other subject takes nats-py's way (and its error)."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:
            return int(tokens[5]), int(tokens[6])
        if len(tokens) >= 11:
            return int(tokens[7]), int(tokens[8])
    metadata = msg.metadata
    return metadata.sequence.stream, metadata.sequence.consumer


async def _quietly(call: Any) -> None:
    try:
        async with asyncio.timeout(2):
            await call
    except Exception as error:
        log.debug("kvbus: nats cleanup: %r", error)
