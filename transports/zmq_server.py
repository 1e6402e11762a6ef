"""The publishing side of zmq://: the bound endpoint (`Server`), its rings of recent
packs per stream, the replays and snapshots it serves, and the endpoints shared by the
publishers of one process."""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Final, NamedTuple

import zmq
from kvbus.transports import LATEST, Record
from kvbus.transports.packing import Pack, make_packs, position, split_position
from kvbus.transports.zmq_protocol import (
    DATA,
    END,
    LOST,
    SNAPSHOT,
    SNAPSHOTS,
    Endpoint,
    offset_bytes,
    topic_of,
)

from kvbus.logs import LimitedLog
from kvbus.wire.snapshot import PublishedFolds

log = logging.getLogger("kvbus.transports.zmq")
_limited = LimitedLog(log)

PACK_BYTES: Final = 64 * 1024
_REPLAY_CHUNK: Final = 256  # packs sent per replay before serving others
_MAX_REPLAYS: Final = 64
_OUTBOX_BYTES: Final = 16 * 1024 * 1024  # appended, not yet sent live
_MAX_REQUEST_BYTES: Final = 1024
_MAX_OFFSET_DIGITS: Final = 20  # 2**64 - 1
_SNAPSHOT_BURST: Final = 4  # snapshot requests one peer may make at once,
_SNAPSHOT_REFILL_S: Final = 1.0  # and one more per this many seconds
_MAX_PEERS_METERED: Final = 4096  # peers whose snapshot requests are remembered


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


class Server:
    """PUB + replay ROUTER of one bound endpoint, served by one thread of its own.

    ``append`` may be called from any thread: it stores packs in the ring under a lock
    and wakes the server thread, which owns the sockets (ZeroMQ sockets are not thread
    safe).
    """

    def __init__(
        self, endpoint: Endpoint, ring: int, ring_bytes: int, hwm: int, snapshots: bool
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
        topic = topic_of(stream)
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
            if after == SNAPSHOTS:
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
            for name, data in self._snapshot_replies(topic_of(stream)):
                self._reply(replay, SNAPSHOT, name, data)
            self._reply(replay, END, b"")
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
        topic = topic_of(stream)
        with self._lock:
            ring = self._rings.get(topic)
            first = ring.first if ring else None
            last = ring.last if ring else None
        replay = _Replay(identity, request, stream, first or 0)
        # A peer waits for one answer at a time: its new request replaces the old one.
        self._replays.pop(identity, None)
        try:
            if last is None or after == LATEST.encode():
                self._reply(replay, END, offset_bytes(last))
                return
            if after:
                wanted = int(after) + 1
                if first is not None and first <= wanted <= last + 1:
                    replay.next_offset = wanted
                else:  # trimmed, or from another ring (the publisher restarted)
                    self._reply(replay, LOST, offset_bytes(first))
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
                ring = self._rings[topic_of(replay.stream)]
                if replay.next_offset < ring.first:  # trimmed while replaying
                    lost_at = ring.first
                else:
                    lost_at = None
                    chunk = ring.chunk(replay.next_offset, _REPLAY_CHUNK)
                    last = ring.last
            try:
                if lost_at is not None:
                    self._reply(replay, LOST, offset_bytes(lost_at))
                    replay.next_offset = lost_at
                    continue
                for offset, data, _ in chunk:
                    self._reply(replay, DATA, offset.to_bytes(8, "big"), data)
                    replay.next_offset = offset + 1
                if last is None or replay.next_offset > last:
                    self._reply(replay, END, offset_bytes(last))
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
        and after not in (LATEST.encode(), SNAPSHOTS)
        and not (len(after) <= _MAX_OFFSET_DIGITS and after.isdigit() and int(after) < 2**64)
    ):
        return f"position {after[:24]!r}"
    return None


servers: dict[Endpoint, Server] = {}
"""This process's bound endpoints, each shared by the publishers that append to it."""
_servers_lock = threading.Lock()


def acquire_server(
    endpoint: Endpoint, ring: int, ring_bytes: int, hwm: int, snapshots: bool
) -> Server:
    with _servers_lock:
        server = servers.get(endpoint)
        if server is None:
            server = servers[endpoint] = Server(endpoint, ring, ring_bytes, hwm, snapshots)
        server.users += 1
        return server


def release_server(server: Server) -> None:
    with _servers_lock:
        server.users -= 1
        if server.users > 0:
            return
        del servers[server.endpoint]
    server.stop()
