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
import datetime
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final
from urllib.parse import quote, unquote

import nats
import nats.errors
import nats.js.errors
from kvbus.transports import LATEST, Entry, Position, Record, Transport, entries_of
from kvbus.transports.nats_admin import JETSTREAM_RECHECK as JETSTREAM_RECHECK
from kvbus.transports.nats_admin import JetStreamUnavailable as JetStreamUnavailable
from kvbus.transports.nats_admin import StreamAdmin
from kvbus.transports.nats_options import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from kvbus.transports.nats_options import parse_url
from kvbus.transports.nats_reader import quietly, read_pages
from kvbus.transports.packing import make_packs, position, split_position
from nats.aio.client import Client
from nats.js import JetStreamContext, api

from kvbus.config import redact_text

log = logging.getLogger("kvbus.transports.nats")

_HEADER_ROOM: Final = 512  # room left in max_payload for the headers of one message
_WHOLE_PACK: Final = 0xFFFF  # an index past any pack's last message


def _subject_token(source: str) -> str:
    return quote(source, safe="").replace(".", "%2E").replace("*", "%2A").replace(">", "%3E")


class NatsTransport(Transport):
    def __init__(self, url: str = "nats://") -> None:
        options = parse_url(url)
        self.servers = options.servers
        self._display = options.display
        self.timeout = options.timeout
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._streams = StreamAdmin(
            self._connect, options.display, options.limits, options.update_stream
        )
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

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        await self._streams.stream(stream, wait=True)
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
            await self._streams.forget_if_deleted(stream)
            raise

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
        name = await self._streams.stream(stream, wait=follow)
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
        assert self._nc is not None
        pages = read_pages(
            self._nc, js, name, stream, start, skip, end, follow, lambda: self._reconnects
        )
        async for page in pages:
            yield page

    async def _snapshot_store(self, stream: str) -> Any:
        js = await self._connect()
        bucket = f"KVBUS_SNAP_{stream}"
        try:
            return await js.object_store(bucket)
        except nats.js.errors.NotFoundError:
            return await js.create_object_store(bucket)
        except nats.js.errors.ServiceUnavailableError as error:
            await self._streams.without_jetstream(js, error, wait=False)
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
        name = await self._streams.stream(stream)
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
            await quietly(sub.unsubscribe())
        if first <= max(state.first_seq, 1):
            return None  # all of the retained history is that recent
        return position(first - 1, _WHOLE_PACK)

    async def aclose(self) -> None:
        if self._nc is not None:
            nc, self._nc, self._js = self._nc, None, None
            # close(), not drain(): every append already waited for its acks, and a
            # drain waits for subscriptions' queues that nobody empties any more.
            await quietly(nc.close())
