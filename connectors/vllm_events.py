"""A vLLM event publisher that sends each engine step's KV events through kvbus.

vLLM's config accepts only the publishers "null" and "zmq", so the ``vllm.general_plugins``
entry point `register` (run by vLLM in every one of its processes) puts
`KvbusEventPublisher` in place of the "zmq" constructor when ``KVBUS_URL`` is set. The
operator's whole set-up::

    KVBUS_URL=nats://host:4222 KVBUS_SOURCE=worker-a vllm serve MODEL \\
        --enable-prefix-caching --kv-events-config '{"enable_kv_cache_events": true}'

Without ``KVBUS_URL`` nothing changes. The engine's step loop only pays
`kvbus.Publisher.publish` (a deque append; the batch is encoded on kvbus's sender thread,
byte for byte as vLLM's own publisher would), never a blocking queue put.

A server stopped cleanly (SIGTERM, Ctrl-C) ends each engine's epoch with
``SourceStopped``, so consumers see it ``stopped`` rather than silent. vLLM stops its
engine-core processes with SIGTERM and, unless ``--shutdown-timeout`` is set, SIGKILL
right after: the publisher there rarely gets to close. So each engine's publisher keeps
its place in its epoch (`Handoff`: a few bytes in shared memory, written as each batch
goes to the transport), and the first vLLM process, which outlives its engines, ends
the epoch of every engine that could not (`stop_for_engines`, at its exit).

``KVBUS_KEEP_ZMQ=1`` keeps vLLM's own ZMQ publisher running beside kvbus's, on the
endpoints of ``--kv-events-config``, for consumers not yet moved to the bus (vLLM's
router, Dynamo's indexer); the step then also pays that publisher's queue put, which
blocks when its queue is full, as without kvbus.

A prefix cache reset reaches the bus at once. vLLM's block pool queues its
``AllBlocksCleared`` and the scheduler publishes the queue only at the end of the
engine's next step (``Scheduler.update_from_output``): an idle engine that was reset
(``/reset_prefix_cache``, an RL weight sync, ``pause_generation(clear_cache=True)``)
stays in every index as holding its old blocks until a request runs. vLLM has no hook
for this, so `install_reset_publishing` wraps ``Scheduler.reset_prefix_cache`` (on the
vLLM versions in `RESET_PUBLISHING_VLLM` only; elsewhere nothing changes): after the
reset, `publish_queued_events` publishes what the queue holds, in one batch, from the
engine core's own thread. The events and their order are the same; the next step's
batch just no longer starts with them. vLLM's own ZMQ publisher (``KVBUS_KEEP_ZMQ``)
still gets them with the next step, as without kvbus.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import functools
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec
import vllm
from kvbus.transports import Entry, Position, Record, Transport, open_transport
from vllm.distributed.kv_events import (
    EventBatch,
    EventPublisher,
    EventPublisherFactory,
    KVEventBatch,
    ZmqEventPublisher,
)

import kvbus
from kvbus import metrics
from kvbus.bus.publisher_stats import PublisherStats
from kvbus.bus.relay import EnginePublisher, RelayPublisher, relay_wanted
from kvbus.config import redact_url, resolve_source, resolve_stream, resolve_url
from kvbus.wire.envelope import SCHEMA_VERSION, Envelope, Kind, encode_envelope
from kvbus.wire.events import SourceStopped, encode

log = logging.getLogger("kvbus.connectors")

STOP_WITHIN: Final = 2.0
"""Seconds the first vLLM process spends, at its exit, ending its engines' epochs (and
its stat logger's): a bus that does not answer costs the exit no more."""
HANDOFF_DIR: Final = "handoffs"
"""The subdirectory of ``$KVBUS_METRICS_DIR`` holding each engine publisher's `Handoff`."""
_SERVERLESS: Final = ("memory", "zmq")
"""Schemes whose bus lives in the publishing process: no other process can end its epoch."""


def engine_source(data_parallel_rank: int) -> str:
    """The source name of one engine: ``$KVBUS_SOURCE/dp<rank>``.

    The event publisher (in vLLM's engine-core process) and the stat logger (in its
    front-end process) both use it, so a consumer joins an engine's KV state and load
    by name. `register` gives ``KVBUS_SOURCE`` a default in the first vLLM process
    (``hostname-pid`` of the front end), which the engine processes it spawns inherit.
    """
    return f"{resolve_source(None)}/dp{data_parallel_rank}"


class HandoffState(msgspec.Struct, kw_only=True):
    source: str
    stream: str
    epoch: int
    seq: int
    """The newest seq handed to the transport (0: none)."""
    dropped: int
    closed: bool
    """The publisher sent its own ``SourceStopped``."""


class Handoff:
    """Where an engine's publisher stands in its epoch, for the process that outlives it.

    A file in ``directory``: 32 bytes (epoch, newest seq handed to the transport,
    messages dropped, closed) mapped in memory, so each batch sent costs a few stores;
    then the source and stream names. The publishing process holds a lock on the file
    while it lives; the kernel drops it when the process ends, however it ends (a
    SIGKILL too), so `stop_for_engines` never speaks for a live publisher."""

    _NUMBERS: Final = struct.Struct("<qqqq")

    def __init__(self, directory: Path, source: str, stream: str) -> None:
        directory.mkdir(mode=0o700, exist_ok=True)
        self.path = directory / f"{os.getpid()}-{os.urandom(4).hex()}.handoff"
        names = msgspec.json.encode({"source": source, "stream": stream})
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._file = os.fdopen(fd, "r+b")
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: never held
        self._file.write(bytes(self._NUMBERS.size) + names)
        self._file.flush()
        self._numbers = mmap.mmap(self._file.fileno(), self._NUMBERS.size)
        self.stats: PublisherStats | None = None
        """The publisher's counters, for the dropped count (set once it exists)."""

    def handed(self, msg_id: str) -> None:
        """``msg_id`` (``source:epoch:seq``) goes to the transport now."""
        head, _, seq = msg_id.rpartition(":")
        epoch = head.rpartition(":")[2]
        dropped = self.stats.dropped if self.stats is not None else 0
        self._NUMBERS.pack_into(self._numbers, 0, int(epoch), int(seq), dropped, 0)

    def closed(self) -> None:
        """The publisher closed: its ``SourceStopped`` was sent (or given up on)."""
        epoch, seq, dropped, _ = self._NUMBERS.unpack_from(self._numbers)
        self._NUMBERS.pack_into(self._numbers, 0, epoch, seq, dropped, 1)

    @classmethod
    def read(cls, path: Path, deadline: float = 0.0) -> HandoffState | None:
        """The state in ``path`` once its publisher is gone, waiting for that until
        ``deadline`` (`time.monotonic`); None if it still runs then, or for a file that
        holds no handoff. (A process just sent SIGKILL takes a moment to end.)"""
        with open(path, "rb") as file:
            while True:
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        return None  # its process still runs
                    time.sleep(0.01)
            data = file.read(cls._NUMBERS.size + 4096)
        if len(data) <= cls._NUMBERS.size:
            return None
        epoch, seq, dropped, closed = cls._NUMBERS.unpack_from(data)
        try:
            names = msgspec.json.decode(data[cls._NUMBERS.size :], type=dict[str, str])
            return HandoffState(
                source=names["source"],
                stream=names["stream"],
                epoch=epoch,
                seq=seq,
                dropped=dropped,
                closed=bool(closed),
            )
        except (msgspec.DecodeError, KeyError):
            return None


class _Recording(Transport):
    """A transport that notes in a `Handoff` each message handed to it."""

    def __init__(self, inner: Transport, handoff: Handoff) -> None:
        self.inner = inner
        self.handoff = handoff

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        if records:  # before the append: it may reach the server and never return
            self.handoff.handed(records[-1].msg_id)
        await self.inner.append(stream, records)

    def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        return self.inner.read(stream, after, follow=follow)

    async def aclose(self) -> None:
        await self.inner.aclose()


def stopped_message(state: HandoffState, now: float) -> Record:
    """The ``SourceStopped`` that ends ``state``'s epoch right after what it sent."""
    envelope = Envelope(
        SCHEMA_VERSION,
        Kind.CONTROL,
        state.source,
        state.epoch,
        state.seq + 1,
        now,
        encode(SourceStopped(dropped=state.dropped)),
    )
    return Record(state.source, envelope.msg_id, encode_envelope(envelope))


def unstopped_engines(directory: Path, wait: float = 0.0) -> list[HandoffState]:
    """The engine publishers with a `Handoff` in ``directory`` whose process is gone
    without their ``SourceStopped``, or goes within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    states = (Handoff.read(path, deadline) for path in sorted(directory.glob("*.handoff")))
    return [s for s in states if s is not None and not s.closed and s.seq > 0]


async def stop_for_engines(pending: list[HandoffState], url: str) -> int:
    """End the epoch of each of ``pending`` (`unstopped_engines`) on the bus of ``url``;
    returns how many it ended. Bounded by `STOP_WITHIN` seconds."""
    if not pending or urlsplit(url).scheme in _SERVERLESS:
        return 0
    transport = open_transport(url)
    ended = 0
    try:
        async with asyncio.timeout(STOP_WITHIN):
            for state in pending:
                await transport.append(state.stream, [stopped_message(state, time.time())])
                ended += 1
                log.info("kvbus: ended the epoch of %s for its stopped engine", state.source)
    except Exception as error:  # the bus is down: consumers will see the engine go stale
        log.warning(
            "kvbus: %d stopped engines not announced on %s: %r",
            len(pending) - ended,
            redact_url(url),
            error,
        )
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_WITHIN):
                await transport.aclose()
    return ended


def _stop_for_engines_at_exit(directory: str) -> None:
    with contextlib.suppress(Exception):
        # vLLM has stopped its engines by now, the last with a SIGKILL a moment ago.
        pending = unstopped_engines(Path(directory) / HANDOFF_DIR, STOP_WITHIN)
        if pending:
            asyncio.run(stop_for_engines(pending, resolve_url(None)))


RESET_PUBLISHING_VLLM: Final = frozenset({(0, 32)})
"""vLLM releases (major, minor) whose scheduler was read for `install_reset_publishing`:
``reset_prefix_cache`` runs on the engine core's busy-loop thread (a utility call, as
``update_from_output`` does) and queues ``AllBlocksCleared`` on the block pool, which
``update_from_output`` publishes as ``kv_cache_manager.take_events()`` followed by the
connector's events."""


def publish_queued_events(scheduler: Any) -> int:
    """Publish now, in one batch, the KV events ``scheduler``'s KV cache manager has
    queued since the last step published them (a reset's ``AllBlocksCleared``), when the
    scheduler's publisher is kvbus's (it has ``publish_early``); returns how many.

    Exact: the scheduler publishes the manager's events, then the connector's, in each
    step's batch; taking the manager's earlier moves no event past another, so a
    consumer sees the same events in the same order, one batch sooner. Call it only on
    the thread that steps the scheduler."""
    early = getattr(getattr(scheduler, "kv_event_publisher", None), "publish_early", None)
    manager = getattr(scheduler, "kv_cache_manager", None)
    if early is None or manager is None:
        return 0
    events = manager.take_events()
    if events:
        early(KVEventBatch(ts=time.time(), events=events))
    return len(events)


def install_reset_publishing(version: str | None = None) -> bool:
    """Wrap vLLM's ``Scheduler.reset_prefix_cache`` so that, for a scheduler publishing
    through kvbus, the reset's ``AllBlocksCleared`` is published at once rather than
    with the next step (see the module's docstring). Idempotent; only on the vLLM
    releases in `RESET_PUBLISHING_VLLM` (``version``: vLLM's, for tests), elsewhere it
    changes nothing and returns False. Other schedulers and publishers are untouched."""
    release = tuple(int(part) for part in (version or vllm.__version__).split(".")[:2]
                    if part.isdigit())  # fmt: skip
    if release not in RESET_PUBLISHING_VLLM:
        log.info(
            "kvbus: vLLM %s not in the releases read for publishing resets at once: "
            "resets reach the bus with the engine's next step",
            version or vllm.__version__,
        )
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    reset = Scheduler.reset_prefix_cache
    if getattr(reset, "kvbus_publishes_resets", False):
        return True

    @functools.wraps(reset)
    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = reset(self, *args, **kwargs)
        publish_queued_events(self)
        return done

    reset_prefix_cache.kvbus_publishes_resets = True  # type: ignore[attr-defined]
    Scheduler.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]
    return True


def prepend_events(held: list[Any], batch: EventBatch) -> EventBatch:
    """``batch`` with the events in ``held`` first (and ``held`` emptied): what a
    publisher that is not kvbus's gets of events published early (`publish_early`),
    with the next step's batch, as it would without kvbus."""
    if not held:
        return batch
    events = [*held, *batch.events]
    held.clear()
    return type(batch)(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)


class KvbusEventPublisher(EventPublisher):
    """vLLM ``EventPublisher`` backed by a `kvbus.Publisher` (URL from ``KVBUS_URL``).

    Takes the ZMQ options vLLM's config passes to a "zmq" publisher, for vLLM's own
    publisher when ``KVBUS_KEEP_ZMQ`` is set (ignored otherwise). ``source`` names the
    engine where ``KVBUS_SOURCE`` cannot (`kvbus sim`'s many engines in one process).
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        *,
        url: str | None = None,
        stream: str | None = None,
        source: str | None = None,
        **zmq_options: Any,
    ) -> None:
        super().__init__(data_parallel_rank)
        install_reset_publishing()
        self.zmq: ZmqEventPublisher | None = None
        self._zmq_held: list[Any] = []
        """Events published early, for vLLM's ZMQ publisher's next batch."""
        if os.environ.get("KVBUS_KEEP_ZMQ", "").lower() in ("1", "true", "yes"):
            self.zmq = ZmqEventPublisher(data_parallel_rank, **zmq_options)
        source = source or engine_source(data_parallel_rank)
        self.handoff: Handoff | None = None
        self.publisher: EnginePublisher
        if relay_wanted(url):
            # The engine's process pays an encode and a send per step; the transport's
            # client runs in a relay process, which ends the epoch if this one is killed
            # (so no Handoff is needed). kvbus sim passes its URL: in process, as before.
            self.publisher = RelayPublisher(
                stream=stream, source=source, data_parallel_rank=data_parallel_rank
            )
        else:
            transport = None
            directory = os.environ.get(metrics.METRICS_DIR_ENV)
            if directory and url is None:  # the bus of KVBUS_URL, which the first process has
                self.handoff = Handoff(
                    Path(directory) / HANDOFF_DIR, source, resolve_stream(stream)
                )
                transport = _Recording(open_transport(resolve_url(None)), self.handoff)
            self.publisher = kvbus.Publisher(
                url,
                stream=stream,
                source=source,
                data_parallel_rank=data_parallel_rank,
                transport=transport,
            )
            if self.handoff is not None:
                self.handoff.stats = self.publisher.stats
        report_bus_metrics()
        log.info(
            "kvbus: KV events of %s go to %s", self.publisher.source, redact_url(self.publisher.url)
        )

    def publish(self, events: EventBatch) -> None:
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self.publisher.publish(events, Kind.KV)
        if self.zmq is not None:
            self.zmq.publish(prepend_events(self._zmq_held, events))

    def publish_early(self, events: EventBatch) -> None:
        """A batch vLLM queued between steps (`publish_queued_events`): on the bus now;
        vLLM's own ZMQ publisher (``KVBUS_KEEP_ZMQ``) gets its events at the head of the
        next step's batch, as it would without kvbus."""
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self.publisher.publish(events, Kind.KV)
        if self.zmq is not None:
            self._zmq_held.extend(events.events)

    def shutdown(self) -> None:
        self.publisher.close()
        if self.handoff is not None:
            self.handoff.closed()
        if self.zmq is not None:
            self.zmq.shutdown()


def report_bus_metrics() -> None:
    """Hand this process's bus metrics to vLLM's front end, which serves them on vLLM's
    ``/metrics`` (see `kvbus.metrics`); the front end reads its own objects directly."""
    directory = os.environ.get(metrics.METRICS_DIR_ENV)
    if directory:
        metrics.start_reporting(directory)


def register() -> None:
    """``vllm.general_plugins`` entry point. Idempotent: vLLM runs it in each process."""
    if not os.environ.get("KVBUS_URL"):
        return
    os.environ.setdefault("KVBUS_SOURCE", resolve_source(None))
    if metrics.METRICS_DIR_ENV not in os.environ:
        # The first vLLM process (the front end) makes the directory its engine
        # processes inherit, and removes it when it exits.
        directory = tempfile.mkdtemp(prefix="kvbus-metrics-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        # Registered after the removal, so run before it: the engines are gone by then.
        atexit.register(_stop_for_engines_at_exit, directory)
        os.environ[metrics.METRICS_DIR_ENV] = directory
    # register_publisher() refuses a taken name, and the config only allows "zmq".
    EventPublisherFactory._registry["zmq"] = KvbusEventPublisher
