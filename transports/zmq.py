"""``zmq://[HOST:PORT][,HOST:PORT...][?ring=N&ring_bytes=B&hwm=N&timeout=S&snapshots=1]``.

ZeroMQ, no server.

The publishing process binds HOST:PORT (default ``127.0.0.1:5590``; ``*`` binds every
interface) with a PUB socket for the live stream, and PORT+1 with a ROUTER that replays
the newest ``ring`` envelopes (default 100,000, and at most ``ring_bytes``, default 64
MiB) per stream from memory. Subscribers
connect to one or several publishers (``zmq://h1:5590,h2:5590``) and get, per endpoint:
the replay of what they asked for, then the live stream, with no hole between the two.

What this fixes in vLLM's own ZMQ pattern:

* replay goes through a DEALER (vLLM's REQ socket wedges when a reply is lost), every
  reply names its stream and request, and ends with an explicit end marker;
* a request older than the ring is answered with a "history lost" marker before the
  oldest retained entry, never by silently starting later (the subscriber then reports
  the missing seqs as a gap);
* every live frame carries its ring offset, so a hole in the live stream (high-water
  mark reached, reconnect, publisher restart) is seen and filled from the ring;
* high-water marks are set, the default bind is loopback, and the replay socket refuses
  to drop replies (``ROUTER_MANDATORY``): a slow replayer is paused, not truncated.

What the publishing process holds is bounded in bytes whatever its peers do: packs
waiting for the sending thread are at most 16 MiB (older ones skip the live stream and
are read from the ring), packs are
at most 64 KiB (bar a single larger envelope), so a subscriber that never reads costs at
most ``hwm`` packs (default 256: 16 MiB) before the live stream drops for it (it then
refills from the ring); a replay request is checked before it is parsed and is at most
1 KiB; each peer has at most one replay running (a new request replaces it: a
subscriber waits for one answer at a time), and at most 64 run at once, the oldest
giving way.

With ``snapshots=1`` the publishing process also folds the kv batches it publishes (see
`kvbus.snapshot.PublishedFolds`) and serves each source's snapshot to
``subscribe(snapshot=True)``: zmq has no server to keep them, and no compactor can see
what was published before it started. It costs the publisher's sender thread about 30
µs per 16-block batch (BENCHMARKS.md), so it is off by default. A snapshot request is
unauthenticated, so it costs the publishing process nothing in the size of its folds:
the endpoint serves the snapshots it took last, outside its lock, and takes them again
only when the folds changed by as many blocks as they hold, or when the ring no longer
holds what follows their cursor (`kvbus.snapshot.PublishedFolds.due`), so taking them
is paid for by the publishing, not by the requests. A peer may ask for snapshots 4
times at once, then once a second (more is refused unanswered, counted in
``refused_requests``); what it is sent is queued on its connection, at most ``hwm``
frames.

Several publishers in one process (the KV and metrics streams of one engine) share one
bound endpoint. Delivery: an append is stored in the publishing process's ring and
lives as long as that process; positions are ``offset << 16 | index`` per endpoint
(joined with commas when several endpoints are read).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Final, NamedTuple
from urllib.parse import parse_qs, urlsplit

import msgspec
import zmq
import zmq.asyncio
from kvbus.transports import LATEST, Entry, Position, Record, Transport
from kvbus.transports.packing import Pack, entries_after, make_packs, position, split_position

from kvbus.config import redact_url
from kvbus.logs import LimitedLog
from kvbus.snapshot import CURSOR_NAME, PublishedFolds

log = logging.getLogger("kvbus.transports.zmq")
_limited = LimitedLog(log)

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 5590
DEFAULT_RING: Final = 100_000
DEFAULT_RING_BYTES: Final = 64 * 1024 * 1024
DEFAULT_HWM: Final = 256
DEFAULT_TIMEOUT: Final = 2.0
PACK_BYTES: Final = 64 * 1024
_REPLAY_CHUNK: Final = 256  # packs sent per replay before serving others
_MAX_REPLAYS: Final = 64
_OUTBOX_BYTES: Final = 16 * 1024 * 1024  # appended, not yet sent live
_MAX_REQUEST_BYTES: Final = 1024
_MAX_OFFSET_DIGITS: Final = 20  # 2**64 - 1
_SNAPSHOT_BURST: Final = 4  # snapshot requests one peer may make at once,
_SNAPSHOT_REFILL_S: Final = 1.0  # and one more per this many seconds
_MAX_PEERS_METERED: Final = 4096  # peers whose snapshot requests are remembered

# Replay protocol (DEALER -> ROUTER): [request_id, stream, after], after being b"" (all),
# b"$" (nothing, just the end marker) or an ASCII ring offset. Replies: [request_id,
# kind, stream, offset(8), data?] with kind DATA, LOST (history before offset is gone)
# or END (offset = newest offset served, empty if the ring is empty).
_DATA, _LOST, _END, _SNAPSHOT = b"D", b"L", b"E", b"S"
_SNAPSHOTS: Final = b"snapshots"  # a request for the snapshots instead of a position


class _Endpoint(NamedTuple):
    host: str
    port: int

    def bind(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"

    def connect(self, port: int) -> str:
        host = DEFAULT_HOST if self.host in ("*", "0.0.0.0") else self.host
        return f"tcp://{host}:{port}"


def _offset_bytes(offset: int | None) -> bytes:
    return b"" if offset is None else offset.to_bytes(8, "big")


def _offset(frame: bytes) -> int | None:
    return int.from_bytes(frame, "big") if frame else None


# --- publishing side -------------------------------------------------------------------


class _Ring:
    """The newest packs of one stream; offsets are consecutive, starting at the time in
    ms so that a restarted publisher's offsets do not repeat its predecessor's."""

    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.packs: collections.deque[tuple[int, bytes, int]] = collections.deque()
        self.records = 0
        self.bytes = 0
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.next_offset = int(time.time() * 1000)

    def add(self, pack: Pack) -> int:
        offset = self.next_offset
        self.next_offset += 1
        self.packs.append((offset, pack.data, pack.length))
        self.records += pack.length
        self.bytes += len(pack.data)
        while (self.records > self.max_records or self.bytes > self.max_bytes) and len(
            self.packs
        ) > 1:
            _, data, length = self.packs.popleft()
            self.records -= length
            self.bytes -= len(data)
        return offset

    @property
    def first(self) -> int:
        return self.packs[0][0] if self.packs else self.next_offset

    @property
    def last(self) -> int | None:
        return self.packs[-1][0] if self.packs else None

    def chunk(self, start: int, count: int) -> list[tuple[int, bytes, int]]:
        begin = start - self.first
        return list(itertools.islice(self.packs, begin, begin + count))


class _Replay:
    __slots__ = ("identity", "next_offset", "request", "stream")

    def __init__(self, identity: bytes, request: bytes, stream: bytes, next_offset: int) -> None:
        self.identity, self.request, self.stream = identity, request, stream
        self.next_offset = next_offset


class _TakenSnapshots(NamedTuple):
    """The snapshots of one stream as last taken, served until they are due again."""

    work: int  # `PublishedFolds.work` when taken
    offset: int | None  # ring offset of their cursor: due again once the ring drops it
    replies: list[tuple[bytes, bytes]]  # (name, data)


class _RequestBudget:
    """How many snapshot requests each peer may still make: ``burst`` at once, one
    more each ``refill`` seconds (a token bucket per peer identity), for the newest
    ``peers`` peers (one forgotten asks afresh: each request costs O(1) anyway)."""

    def __init__(self, burst: int, refill: float, peers: int) -> None:
        self._burst, self._refill, self._peers = burst, refill, peers
        self._left: collections.OrderedDict[bytes, tuple[float, float]] = collections.OrderedDict()

    def take(self, peer: bytes) -> bool:
        now = time.monotonic()
        tokens, at = self._left.pop(peer, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - at) / self._refill)
        allowed = tokens >= 1
        self._left[peer] = (tokens - 1 if allowed else tokens, now)
        if len(self._left) > self._peers:
            self._left.popitem(last=False)
        return allowed


class _Server:
    """PUB + replay ROUTER of one bound endpoint, served by one thread of its own.

    ``append`` may be called from any thread: it stores packs in the ring under a lock
    and wakes the server thread, which owns the sockets (ZeroMQ sockets are not thread
    safe).
    """

    def __init__(
        self, endpoint: _Endpoint, ring: int, ring_bytes: int, hwm: int, snapshots: bool
    ) -> None:
        self.endpoint = endpoint
        self._folds: dict[bytes, PublishedFolds] | None = {} if snapshots else None
        self.users = 0
        self._ring_records = ring
        self._ring_bytes = ring_bytes
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._router = context.socket(zmq.ROUTER)
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 1000)
            self._router.setsockopt(zmq.SNDHWM, hwm)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)  # drops the peer
            self._router.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint.bind(endpoint.port))
            self._router.bind(endpoint.bind(endpoint.port + 1))
        except zmq.ZMQError:
            self._pub.close(0)
            self._router.close(0)
            raise
        self._lock = threading.Lock()
        self._rings: dict[bytes, _Ring] = {}
        self._outbox: collections.deque[tuple[bytes, int, bytes]] = collections.deque()
        self._outbox_bytes = 0
        self.skipped_live = 0
        """Packs never sent live because the sending thread fell behind (subscribers
        see the hole in the ring offsets and read them from the ring)."""
        self._replays: dict[bytes, _Replay] = {}  # by peer, oldest first
        self.refused_requests = 0
        self._taken: dict[bytes, _TakenSnapshots] = {}  # by topic
        self._snapshot_budget = _RequestBudget(
            _SNAPSHOT_BURST, _SNAPSHOT_REFILL_S, _MAX_PEERS_METERED
        )
        self.snapshots_taken = 0
        """Times this endpoint took a stream's snapshots (see `_snapshot_replies`)."""
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(
            target=self._serve, name=f"kvbus-zmq-{endpoint.port}", daemon=True
        )
        self._thread.start()

    def append(self, stream: str, records: Sequence[Record]) -> None:
        topic = _topic(stream)
        packs = make_packs(records, PACK_BYTES, hard_limit=False)
        with self._lock:
            ring = self._rings.get(topic)
            if ring is None:
                ring = self._rings[topic] = _Ring(self._ring_records, self._ring_bytes)
            first = 0  # the pack's first record
            for pack in packs:
                offset = ring.add(pack)
                self._outbox.append((topic, offset, pack.data))
                self._outbox_bytes += len(pack.data)
                if self._folds is not None:
                    folds = self._folds.setdefault(topic, PublishedFolds())
                    for index in range(pack.length):
                        folds.add(position(offset, index), records[first + index].data)
                first += pack.length
            while self._outbox_bytes > _OUTBOX_BYTES and len(self._outbox) > 1:
                self._outbox_bytes -= len(self._outbox.popleft()[2])
                self.skipped_live += 1
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake-up is already pending
            self._wake_w.send(b"\0")

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join(5)
        self._wake_r.close()
        self._wake_w.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        paused = False
        try:
            while True:
                # Poll without sleeping while replays can progress; a paused replay (the
                # client's queue is full) is retried every few ms.
                timeout = (5 if paused else 0) if self._replays else None
                events = dict(poller.poll(timeout))
                if self._wake_r.fileno() in events:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                with self._lock:
                    sending = list(self._outbox)
                    self._outbox.clear()
                    self._outbox_bytes = 0
                for topic, offset, data in sending:
                    self._pub.send_multipart([topic, offset.to_bytes(8, "big"), data], copy=False)
                del sending
                if self._stopping:
                    return
                if self._router in events:
                    self._take_requests()
                paused = self._step_replays()
        except Exception:  # pragma: no cover - logged, the endpoint is then dead
            log.exception("kvbus: zmq endpoint %s failed", self.endpoint)
        finally:
            self._pub.close()
            self._router.close()

    def _take_requests(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            problem = _bad_request(frames)
            if problem:
                self.refused_requests += 1
                _limited.warning("request", "kvbus: zmq refused a replay request: %s", problem)
                continue
            identity, request, stream, after = frames
            if after == _SNAPSHOTS:
                self._send_snapshots(identity, request, stream)
            else:
                self._start_replay(identity, request, stream, after)

    def _send_snapshots(self, identity: bytes, request: bytes, stream: bytes) -> None:
        if not self._snapshot_budget.take(identity):
            self.refused_requests += 1
            _limited.warning("snapshots", "kvbus: zmq refused a peer's snapshot request")
            return
        replay = _Replay(identity, request, stream, 0)
        try:
            for name, data in self._snapshot_replies(_topic(stream)):
                self._reply(replay, _SNAPSHOT, name, data)
            self._reply(replay, _END, b"")
        except (zmq.Again, zmq.ZMQError):
            pass  # the peer is gone or does not read: it will ask again

    def _snapshot_replies(self, topic: bytes) -> list[tuple[bytes, bytes]]:
        """The stream's snapshots as last taken, taken again when due: then from a copy
        of the folds made under the lock, encoded outside it (the engine's appends wait
        for the lock, never for the encoding)."""
        taken = self._taken.get(topic)
        with self._lock:
            folds = self._folds.get(topic) if self._folds is not None else None
            if folds is None:
                return []
            ring = self._rings.get(topic)
            if (
                taken is not None
                and not folds.due(taken.work)
                and (taken.offset is None or ring is None or taken.offset >= ring.first)
            ):
                return taken.replies
            frozen = folds.copy()
        found = frozen.snapshots()
        at = frozen.position
        offset = split_position(at)[0] if isinstance(at, int) else None
        replies = [(name.encode(), data) for name, data in found.items()]
        self._taken[topic] = _TakenSnapshots(frozen.work, offset, replies)
        self.snapshots_taken += 1
        return replies

    def _start_replay(self, identity: bytes, request: bytes, stream: bytes, after: bytes) -> None:
        topic = _topic(stream)
        with self._lock:
            ring = self._rings.get(topic)
            first = ring.first if ring else None
            last = ring.last if ring else None
        replay = _Replay(identity, request, stream, first or 0)
        # A peer waits for one answer at a time: its new request replaces the old one.
        self._replays.pop(identity, None)
        try:
            if last is None or after == LATEST.encode():
                self._reply(replay, _END, _offset_bytes(last))
                return
            if after:
                wanted = int(after) + 1
                if first is not None and first <= wanted <= last + 1:
                    replay.next_offset = wanted
                else:  # trimmed, or from another ring (the publisher restarted)
                    self._reply(replay, _LOST, _offset_bytes(first))
        except (zmq.Again, zmq.ZMQError):
            return  # the peer is gone or does not read: it will ask again
        if len(self._replays) >= _MAX_REPLAYS:
            oldest = next(iter(self._replays))
            del self._replays[oldest]
            _limited.warning(
                "replays", "kvbus: zmq %d replays running: dropped the oldest", _MAX_REPLAYS
            )
        self._replays[identity] = replay

    def _step_replays(self) -> bool:
        """Send the next chunk of every replay; True if one had to pause."""
        paused = False
        for replay in list(self._replays.values()):
            with self._lock:
                ring = self._rings[_topic(replay.stream)]
                if replay.next_offset < ring.first:  # trimmed while replaying
                    lost_at = ring.first
                else:
                    lost_at = None
                    chunk = ring.chunk(replay.next_offset, _REPLAY_CHUNK)
                    last = ring.last
            try:
                if lost_at is not None:
                    self._reply(replay, _LOST, _offset_bytes(lost_at))
                    replay.next_offset = lost_at
                    continue
                for offset, data, _ in chunk:
                    self._reply(replay, _DATA, offset.to_bytes(8, "big"), data)
                    replay.next_offset = offset + 1
                if last is None or replay.next_offset > last:
                    self._reply(replay, _END, _offset_bytes(last))
                    self._replays.pop(replay.identity, None)
            except zmq.Again:
                paused = True
            except zmq.ZMQError as error:
                if error.errno != errno.EHOSTUNREACH:
                    raise
                self._replays.pop(replay.identity, None)  # the client went away
        return paused

    def _reply(self, replay: _Replay, kind: bytes, offset: bytes, data: bytes = b"") -> None:
        frames = [replay.identity, replay.request, kind, replay.stream, offset, data]
        self._router.send_multipart(frames, zmq.NOBLOCK, copy=False)


def _bad_request(frames: list[bytes]) -> str | None:
    """Why ``frames`` is not a replay request this server answers, if it is not; checked
    before anything is parsed (a 5,000-digit number costs int() quadratic time)."""
    if len(frames) != 4:
        return f"{len(frames)} frames"
    _, request, stream, after = frames
    if not 0 < len(request) <= 32 or not 0 < len(stream) <= 64:
        return "request id or stream name of a bad size"
    if (
        after
        and after not in (LATEST.encode(), _SNAPSHOTS)
        and not (len(after) <= _MAX_OFFSET_DIGITS and after.isdigit() and int(after) < 2**64)
    ):
        return f"position {after[:24]!r}"
    return None


def _topic(stream: str | bytes) -> bytes:
    # The NUL ends the topic: ZeroMQ subscriptions match prefixes, and "kv" must not
    # receive "kv_metrics".
    return (stream.encode() if isinstance(stream, str) else stream) + b"\0"


_servers: dict[_Endpoint, _Server] = {}
_servers_lock = threading.Lock()


def _acquire_server(
    endpoint: _Endpoint, ring: int, ring_bytes: int, hwm: int, snapshots: bool
) -> _Server:
    with _servers_lock:
        server = _servers.get(endpoint)
        if server is None:
            server = _servers[endpoint] = _Server(endpoint, ring, ring_bytes, hwm, snapshots)
        server.users += 1
        return server


def _release_server(server: _Server) -> None:
    with _servers_lock:
        server.users -= 1
        if server.users > 0:
            return
        del _servers[server.endpoint]
    server.stop()


# --- subscribing side ------------------------------------------------------------------


class _Reader:
    """Replay-then-live reading of one stream from one endpoint."""

    _requests = itertools.count(1)

    def __init__(self, endpoint: _Endpoint, stream: str, hwm: int, timeout: float) -> None:
        self.endpoint = endpoint
        self.stream = stream
        self.topic = _topic(stream)
        self.hwm = hwm
        self.timeout = timeout
        self.last: int | None = None
        """Newest ring offset delivered (None: accept whatever comes first)."""

    @staticmethod
    def _context() -> zmq.asyncio.Context:
        return zmq.asyncio.Context.shadow(zmq.Context.instance())

    def _dealer(self) -> zmq.asyncio.Socket:
        """A socket to the endpoint's replay ROUTER."""
        dealer = self._context().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint.connect(self.endpoint.port + 1))
        return dealer

    async def snapshots(self) -> dict[str, bytes]:
        """The snapshots the publishing process serves ({} if it is not up)."""
        dealer = self._dealer()
        request = str(next(self._requests)).encode()
        found: dict[str, bytes] = {}
        try:
            await dealer.send_multipart([request, self.stream.encode(), _SNAPSHOTS])
            while True:
                async with asyncio.timeout(self.timeout):
                    reply = await dealer.recv_multipart()
                if len(reply) != 5 or reply[0] != request:
                    continue
                if reply[1] == _END:
                    return found
                found[reply[3].decode(errors="replace")] = reply[4]
        except TimeoutError:
            return {}
        finally:
            dealer.close(0)

    async def entries(
        self, after: Position | None, follow: bool
    ) -> AsyncIterator[tuple[int, bytes]]:
        sub = None
        if follow:  # subscribe before asking for history, so nothing falls in between
            sub = self._context().socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self.hwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(self.endpoint.connect(self.endpoint.port))
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        dealer = self._dealer()
        try:
            if after == LATEST:
                request, skip = LATEST.encode(), -1
            elif after is None or after == "":
                request, skip = b"", -1
            else:
                offset, skip = split_position(int(after))
                request = str(offset - 1).encode()
            async for item in self._replay(dealer, request, skip, follow):
                yield item
            if sub is None:
                return
            while True:
                if not await sub.poll(self.timeout * 1000):
                    # Idle: ask whether the tail was missed (packs published before our
                    # subscription reached the publisher, after the replay's snapshot).
                    behind = b"" if self.last is None else str(self.last).encode()
                    async for item in self._replay(dealer, behind, -1, False):
                        yield item
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kvbus: zmq skipped a malformed frame (%d parts)", len(frames))
                    continue
                _, offset_frame, data = frames
                offset = int.from_bytes(offset_frame, "big")
                if self.last is not None and offset != self.last + 1:
                    if offset <= self.last:
                        continue  # already replayed
                    # A hole (high-water mark, reconnect, new publisher): fill it.
                    async for item in self._replay(dealer, str(self.last).encode(), -1, False):
                        yield item
                    if self.last is not None and offset <= self.last:
                        continue
                self.last = offset
                for item in entries_after(offset, data):
                    yield item
        finally:
            dealer.close(0)
            if sub is not None:
                sub.close(0)

    async def _replay(
        self, dealer: zmq.asyncio.Socket, after: bytes, skip: int, patient: bool
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Packs after ring offset ``after`` (skipping envelopes up to index ``skip`` of
        the first pack asked for); ``patient`` asks again forever when the publisher
        does not answer (it may not be up yet), otherwise gives up."""
        stream = self.stream.encode()
        partial = int(after) + 1 if after.isdigit() else None
        while True:
            request = str(next(self._requests)).encode()
            await dealer.send_multipart([request, stream, after])
            while True:
                try:
                    async with asyncio.timeout(self.timeout):
                        reply = await dealer.recv_multipart()
                except TimeoutError:
                    break
                if len(reply) != 5:
                    log.warning("kvbus: zmq skipped a malformed replay reply")
                    continue
                reply_to, kind, _, offset_frame, data = reply
                if reply_to != request:
                    continue  # a late answer to an abandoned request
                offset = _offset(offset_frame)
                if kind == _END:
                    if offset is not None:
                        self.last = offset
                    return
                if kind == _LOST:
                    log.warning(
                        "kvbus: zmq %s:%s history lost before ring offset %s (asked after %s)",
                        self.endpoint.host,
                        self.endpoint.port,
                        offset,
                        after.decode() or "start",
                    )
                    continue
                assert offset is not None
                for item in entries_after(offset, data, skip if offset == partial else -1):
                    yield item
                self.last = offset
                after = str(offset).encode()
            if not patient:
                log.warning(
                    "kvbus: zmq %s:%s did not answer a replay request within %ss",
                    self.endpoint.host,
                    self.endpoint.port,
                    self.timeout,
                )
                return


class ZmqTransport(Transport):
    def __init__(self, url: str = "zmq://") -> None:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        self.endpoints = [_parse_endpoint(e) for e in (parts.netloc or "").split(",")]
        self.ring = int(query.get("ring", [DEFAULT_RING])[0])
        self.ring_bytes = int(query.get("ring_bytes", [DEFAULT_RING_BYTES])[0])
        self.hwm = int(query.get("hwm", [DEFAULT_HWM])[0])
        self.timeout = float(query.get("timeout", [DEFAULT_TIMEOUT])[0])
        self.snapshots = query.get("snapshots", ["0"])[0] in ("1", "true", "yes")
        if self.ring < 1 or self.ring_bytes < 1 or self.hwm < 0 or self.timeout <= 0:
            shown = redact_url(url)
            raise ValueError(f"ring, ring_bytes, hwm and timeout must be positive in {shown}")
        self._server: _Server | None = None

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        if self._server is None:
            if len(self.endpoints) != 1:
                raise ValueError("a zmq:// publisher binds exactly one HOST:PORT")
            self._server = _acquire_server(
                self.endpoints[0], self.ring, self.ring_bytes, self.hwm, self.snapshots
            )
        self._server.append(stream, records)

    async def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        readers = [_Reader(e, stream, self.hwm, self.timeout) for e in self.endpoints]
        if len(readers) == 1:
            async for position, data in readers[0].entries(after, follow):
                yield Entry(position, data)
            return
        async for entry in _merge(readers, after, follow):
            yield entry

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        """From the publishing process, which folds what it publishes when its URL says
        ``snapshots=1``; with several endpoints, their cursors joined."""
        readers = [_Reader(e, stream, self.hwm, self.timeout) for e in self.endpoints]
        answers = await asyncio.gather(*(r.snapshots() for r in readers))
        if len(answers) == 1:
            return answers[0]
        merged: dict[str, bytes] = {}
        positions: list[str] = []
        sources: dict[str, object] = {}
        for answer in answers:
            cursor = msgspec.json.decode(answer.pop(CURSOR_NAME, b"{}"))
            position = cursor.get("position") if isinstance(cursor, dict) else None
            positions.append("" if position is None else str(position))
            if isinstance(cursor, dict) and isinstance(cursor.get("sources"), dict):
                sources.update(cursor["sources"])
            merged.update(answer)
        merged[CURSOR_NAME] = msgspec.json.encode(
            {"position": ",".join(positions), "sources": sources}
        )
        return merged

    async def aclose(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(_release_server, server)


async def _merge(
    readers: list[_Reader], after: Position | None, follow: bool
) -> AsyncIterator[Entry]:
    """Entries of several endpoints as they arrive; a position is the comma-joined
    positions of every endpoint, so a cursor resumes each one where it was."""
    if after is None or after == LATEST:
        afters: list[Position | None] = [after] * len(readers)
    else:
        afters = [int(p) if p else None for p in str(after).split(",")]
        if len(afters) != len(readers):
            raise ValueError(f"position {after!r} is not one of {len(readers)} zmq endpoints")
    vector = ["" if a is None or a == LATEST else str(a) for a in afters]
    queue: asyncio.Queue[tuple[int, int, bytes] | BaseException | None] = asyncio.Queue(1024)

    async def pump(i: int) -> None:
        try:
            async for position, data in readers[i].entries(afters[i], follow):
                await queue.put((i, position, data))
            await queue.put(None)
        except Exception as error:
            await queue.put(error)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(readers))]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            i, position, data = item
            vector[i] = str(position)
            yield Entry(",".join(vector), data)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _parse_endpoint(text: str) -> _Endpoint:
    host, _, port = text.rpartition(":")
    if not _:
        host, port = text, ""
    return _Endpoint(host or DEFAULT_HOST, int(port) if port else DEFAULT_PORT)
