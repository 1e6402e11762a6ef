"""`RelayPublisher`: the engine's side of a relay. What the engine's process pays per
message is an encode and one non-blocking ``send``; the transport's client (nats-py,
redis-py, ZeroMQ's sockets), its event loop, sender thread and retries run in a relay
process (`kvbus.bus.relay_process`) that this one starts and supervises.

Why: vLLM's EngineCore is one Python loop, and every microsecond of CPU or GIL time
spent in its process (any thread) is taken from scheduling the next step. Measured with
``bench/bench_engine_cost.py`` (`BENCHMARKS.md`): of the hand-offs tried, a Unix
SEQPACKET socket costs the engine's process the least (no thread of its own on this
side, not even ZeroMQ's I/O thread; one system call a message).

The guarantees are the `kvbus.bus.publisher.Publisher`'s, end to end:

- Seqs and the epoch are taken here, so they do not depend on which relay sends them.
  The relay publishes each message under them (`Publisher.forward`).
- Never blocks: a message the socket cannot take at once (the relay is behind, or dead)
  is dropped and counted; its seq is skipped, so the next message the relay sends
  carries the gap marker that announces it.
- A relay that dies is started again at the next publish (at most once a second). It
  learns from a few shared bytes (a memfd both map) the newest seq the dead one sent,
  and the first message it sends announces everything after that as lost: what was in
  flight is never lost silently. ``stats.dropped`` counts what the dead relay had not
  reported sent; one killed inside an append may have sent a part of it (consumers are
  told exactly: their gap is from what they got).
- The engine's process ending, however it ends (a SIGKILL too), closes its end of the
  socket; the relay then ends the epoch with ``SourceStopped``.

Memory is bounded: the socket's buffer, then the relay's own `Publisher` queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Final, TypeAlias
from urllib.parse import urlsplit

import msgspec

from kvbus._version import __version__
from kvbus.bus import instruments
from kvbus.bus.publisher import DEFAULT_MAX_MESSAGE_BYTES, Publisher
from kvbus.bus.publisher_stats import PublisherStats
from kvbus.config import redact_url, resolve_source, resolve_stream, resolve_url
from kvbus.wire.envelope import Kind
from kvbus.wire.events import LossNotice, SourceStarted, SourceStopped, encode

log = logging.getLogger("kvbus.bus.relay")

_open_relays: weakref.WeakSet[RelayPublisher] = weakref.WeakSet()


def _relays_after_fork_in_child() -> None:
    # The child shares the socket and the seqs with the parent: its messages would
    # interleave with the parent's under seqs the parent also takes. It opens its own.
    for relay in list(_open_relays):
        relay._closed = True
        relay._socket = None
        relay._relay_pid = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_relays_after_fork_in_child)

HEADER: Final = struct.Struct("<QBBd")
"""Each frame: seq, kind, flags, ts; then (a part of) the message's payload."""
MORE: Final = 1
"""Flag: more parts of this message follow (messages over `PART_BYTES` are split)."""
END: Final = 2
"""Flag: the epoch's last message (its ``SourceStopped``): the relay closes after it."""
PART_BYTES: Final = 60 * 1024
"""A frame's payload at most: under the socket buffer any kernel grants."""
PROGRESS: Final = struct.Struct("<qq")
"""The shared bytes: the newest seq the relay's transport took, and how many of the
messages handed to this relay it sent (the engine sets both when it starts one)."""
SOCKET_BUFFER: Final = 4 * 1024 * 1024
RESTART_EVERY: Final = 1.0
"""Seconds: a relay is started at most this often."""


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs. It is no child of ours: whoever adopted it reaps
    it, or (a reaper that does not) leaves it a zombie, which counts as ended."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


RELAYED_SCHEMES: Final = frozenset(
    {"zmq", "nats", "tls", "redis", "rediss", "redis+sentinel", "rediss+sentinel"}
)
"""Transports whose client a relay can own: all but memory://, whose consumers share
the publishing process."""


def can_relay(url: str) -> bool:
    """Whether messages to ``url`` can go through a relay here (a networked transport,
    on Linux: memfd and SEQPACKET sockets)."""
    return urlsplit(url).scheme in RELAYED_SCHEMES and hasattr(os, "memfd_create")


EnginePublisher: TypeAlias = "Publisher | RelayPublisher"
"""What `engine_publisher` opens: either one has ``publish``, ``flush``, ``close`` and
``stats``."""


def relay_wanted(url: str | None) -> bool:
    """Whether an engine's publisher for ``url`` goes through a relay: ``url`` is None
    (the bus of ``KVBUS_URL``, as vLLM's plugin, stat logger and connector open it),
    ``KVBUS_RELAY`` is not ``0``, and that bus can be relayed (`can_relay`). A caller
    that passes its own URL (`kvbus sim`: many engines in one process) publishes in
    process."""
    relay = os.environ.get("KVBUS_RELAY", "1").strip().lower() not in ("0", "false", "no")
    return url is None and relay and can_relay(resolve_url(None))


def engine_publisher(
    url: str | None = None,
    *,
    stream: str | None = None,
    source: str | None = None,
    data_parallel_rank: int | None = None,
) -> EnginePublisher:
    """The publisher a vLLM process's kvbus component (the stat logger, the KV
    connector's records) opens: a `RelayPublisher` where `relay_wanted`, so the
    transport's client runs outside that process; otherwise a `Publisher`."""
    if relay_wanted(url):
        return RelayPublisher(stream=stream, source=source, data_parallel_rank=data_parallel_rank)
    return Publisher(url, stream=stream, source=source, data_parallel_rank=data_parallel_rank)


class RelayPublisher:
    """Publishes ``source``'s messages to ``stream`` through a relay process; the same
    interface as `kvbus.bus.publisher.Publisher` (``publish``, ``announce_loss``,
    ``flush``, ``close``, ``stats``). Linux only (a memfd and SEQPACKET sockets).

    The URL goes to the relay in its environment, never on its command line (where
    any user of the machine could read the credentials it may hold)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        stream: str | None = None,
        source: str | None = None,
        data_parallel_rank: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.url = resolve_url(url)
        self.stream = resolve_stream(stream)
        self.source = resolve_source(source)
        self.epoch = time.time_ns()
        self._stats = PublisherStats()
        self._sent_before = 0
        """Messages the relays that ended had sent."""
        self.append_latency = instruments.LatencyHistogram()
        """Empty here: appends are timed in the relay process."""
        self.max_message_bytes = max_message_bytes
        self._starts = 0
        self._lock = threading.Lock()
        self._next_seq = 1
        self._closed = False
        self._progress_fd = os.memfd_create("kvbus-relay-progress", os.MFD_CLOEXEC)
        os.ftruncate(self._progress_fd, mmap.PAGESIZE)
        self._progress = mmap.mmap(self._progress_fd, PROGRESS.size)
        self._socket: socket.socket | None = None
        self._relay_pid: int | None = None
        self._restart_at = 0.0
        self._started_at = 0.0
        _open_relays.add(self)
        instruments.track_publisher(self)
        self._handed = 0
        """Messages handed to the running relay's socket."""
        self._handed_seq = 0
        """The newest seq handed to a relay."""
        self._start()
        started = SourceStarted(
            host=socket.gethostname(), pid=os.getpid(), kvbus_version=__version__,
            data_parallel_rank=data_parallel_rank,
        )  # fmt: skip
        self.publish(started, Kind.CONTROL)

    # --- engine side: never blocks -----------------------------------------------------

    def publish(self, payload: bytes | msgspec.Struct, kind: Kind = Kind.KV) -> bool:
        """Send one message to the relay; False (counted in ``stats.dropped``) if it had
        to be dropped. ``payload``: encoded bytes, or a Struct encoded here the way
        vLLM's own publisher does. Safe from any thread."""
        data = payload if isinstance(payload, bytes) else encode(payload)
        with self._lock:
            if self._closed:
                self._stats.dropped += 1
                return False
            return self._send(self._take_seq(), kind, data, 0)

    def announce_loss(self, count: int = 1) -> None:
        """Declare ``count`` messages lost upstream: one seq stands for them all."""
        notice = encode(LossNotice(dropped=self._stats.dropped + max(1, count)))
        with self._lock:
            self._stats.dropped += max(1, count)
            if not self._closed:
                self._send(self._take_seq(), Kind.CONTROL, notice, 0, count=False)

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _send(self, seq: int, kind: Kind, data: bytes, flags: int, count: bool = True) -> bool:
        """Under ``_lock``: the frames of message ``seq``, or a drop."""
        sent = len(data) <= self.max_message_bytes and self._frames(seq, kind, data, flags)
        if count:
            if sent:
                self._stats.published += 1
            else:
                self._stats.dropped += 1
        return sent

    def _frames(self, seq: int, kind: Kind, data: bytes, flags: int) -> bool:
        relay = self._socket
        if relay is None:
            if time.monotonic() < self._restart_at or not self._start():
                return False
            relay = self._socket
            assert relay is not None
        ts = time.time()
        try:
            # sendmsg gathers header and payload into one datagram: no copy of the
            # payload on the engine's thread.
            if len(data) <= PART_BYTES:
                relay.sendmsg((HEADER.pack(seq, kind, flags, ts), data))
            else:
                view = memoryview(data)
                for at in range(0, len(data), PART_BYTES):
                    more = MORE if at + PART_BYTES < len(data) else 0
                    part = view[at : at + PART_BYTES]
                    relay.sendmsg((HEADER.pack(seq, kind, flags | more, ts), part))
            self._handed += 1
            self._handed_seq = seq
            return True
        except BlockingIOError:
            return False  # the relay is behind: the seq is skipped (a part sent is dropped)
        except OSError as error:
            if error.errno == errno.EMSGSIZE:
                return False
            self._lost_relay(error)
            return False

    # --- the relay process -------------------------------------------------------------

    def _start(self) -> bool:
        """A relay process, its socket connected; False (tried again later) on failure."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(OSError):
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        ours.setblocking(False)
        after, sent = PROGRESS.unpack_from(self._progress)
        # What the last relay was handed and did not send is lost (it died with it).
        lost = max(0, self._handed - sent)
        self._sent_before += sent
        PROGRESS.pack_into(self._progress, 0, after, 0)
        self._handed = 0
        command = [
            sys.executable, "-m", "kvbus.bus.relay_process",
            "--socket-fd", str(theirs.fileno()), "--progress-fd", str(self._progress_fd),
            "--stream", self.stream, "--source", self.source, "--epoch", str(self.epoch),
            "--after", str(after), "--max-message-bytes", str(self.max_message_bytes),
        ]  # fmt: skip
        environment = {**os.environ, "KVBUS_URL": self.url}
        # Started by a shell that exits at once: the relay is no child of this process,
        # so vLLM's shutdown, which SIGKILLs the engine core's process tree, leaves it to
        # end the engine's epoch.
        detached = ["/bin/sh", "-c", '"$@" </dev/null >&2 & echo $!', "kvbus-relay", *command]
        try:
            started = subprocess.run(
                detached, env=environment, pass_fds=(theirs.fileno(), self._progress_fd),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, timeout=30, check=True,
            )  # fmt: skip
            self._relay_pid = int(started.stdout)
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            ours.close()
            self._restart_at = time.monotonic() + RESTART_EVERY
            log.error("kvbus: cannot start a relay for %s: %s", redact_url(self.url), error)
            return False
        finally:
            theirs.close()
        self._starts += 1
        self._started_at = time.monotonic()
        self._socket = ours
        # The seqs after ``after`` are lost (in the dead relay, or dropped here while
        # none ran): the message being sent, this relay's first, carries the gap marker
        # that announces them.
        self._stats.dropped += lost
        return True

    def _lost_relay(self, error: OSError) -> None:
        log.error("kvbus: the relay for %s is gone (%s): starting another",
                  redact_url(self.url), error)  # fmt: skip
        if self._socket is not None:
            self._socket.close()
        self._socket = None
        if self._relay_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._relay_pid, signal.SIGKILL)
            self._relay_pid = None
        # At once, unless the relay lived less than RESTART_EVERY: one that keeps dying
        # (a URL it cannot use, say) costs the engine a start a second at most.
        self._restart_at = self._started_at + RESTART_EVERY

    @property
    def sent_seq(self) -> int:
        """The newest seq the relay's transport took (0: none yet)."""
        value: int = PROGRESS.unpack_from(self._progress)[0]
        return value

    @property
    def stats(self) -> PublisherStats:
        """The counters; ``sent`` as the relays tell it (the relays' own retries,
        reconnects and append times are theirs)."""
        if not self._progress.closed:
            self._stats.sent = self._sent_before + PROGRESS.unpack_from(self._progress)[1]
        return self._stats

    @property
    def queue_messages(self) -> int:
        """Messages handed to the relay and not yet reported sent."""
        if self._progress.closed:
            return 0
        sent: int = PROGRESS.unpack_from(self._progress)[1]
        return max(0, self._handed - sent)

    @property
    def queue_bytes(self) -> int:
        return 0  # held in the relay's socket and process, not in this one

    @property
    def restarts(self) -> int:
        """Relays started after the first (each after one died)."""
        return max(0, self._starts - 1)

    @property
    def relay_pid(self) -> int | None:
        return self._relay_pid

    # --- lifecycle ---------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every message handed to the relay so far went to the transport;
        False after ``timeout``, or if the relay died (what it held is lost: the next
        message announces it). Those dropped here are not waited for."""
        deadline = time.monotonic() + timeout
        target = self._handed_seq
        while time.monotonic() < deadline:
            if self.sent_seq >= target:
                return True
            if not _alive(self._relay_pid):
                return False
            time.sleep(0.001)
        return False

    async def aflush(self, timeout: float = 10.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """End the epoch (``SourceStopped``) and wait up to ``timeout`` seconds for the
        relay to send what it holds and exit. Idempotent."""
        with self._lock:
            if self._closed:
                return
            stopped = encode(SourceStopped(dropped=self._stats.dropped))
            self._send(self._take_seq(), Kind.CONTROL, stopped, END, count=False)
            self._closed = True
            pid, self._relay_pid = self._relay_pid, None
            if self._socket is not None:
                self._socket.close()  # the relay also ends on EOF
                self._socket = None
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        if _alive(pid):
            assert pid is not None
            log.error("kvbus: the relay for %s did not end in %g s",
                      redact_url(self.url), timeout)  # fmt: skip
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _ = self.stats  # its last ``sent``
        self._progress.close()
        os.close(self._progress_fd)

    async def aclose(self, timeout: float = 10.0) -> None:
        """`close` without blocking the event loop."""
        await asyncio.to_thread(self.close, timeout)

    def __enter__(self) -> RelayPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RelayPublisher({redact_url(self.url)!r}, stream={self.stream!r}, "
            f"source={self.source!r})"
        )
