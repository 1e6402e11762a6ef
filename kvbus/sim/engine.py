"""`SimEngine`: drives one simulated engine's core on the event loop, as vLLM's engine
loop drives a real one: requests that arrive are added before the next step, a step's
tokens come out when its modelled time has passed, and each step's KV events and load
go to the bus through the same publisher and stat logger as on a real engine (sources
``NAME/dp0``), and to vLLM's own ZMQ publisher when a port is given.

A prefix cache reset is published at once, not with the next step (as kvbus's plugin
does on a real engine; vLLM's ZMQ events still carry it with the next step).

A restart (`restart`) is a new engine process: in-flight requests fail, the cache is
empty, and the bus sees the old epoch end (``SourceStopped``) and a new one start."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_events import EventBatch, EventPublisher, ZmqEventPublisher
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutput

from kvbus.connectors.vllm_events import KvbusEventPublisher, prepend_events
from kvbus.connectors.vllm_stats import KvbusStatLogger
from kvbus.sim.engine_core import EngineCore, request_seed
from kvbus.sim.engine_metrics import EngineMetrics
from kvbus.sim.timing import TimingModel

log = logging.getLogger("kvbus.sim")


class EngineStopped(Exception):
    """The engine restarted or stopped while the request ran."""


@dataclass(eq=False)
class RequestStream:
    """One request's progress, read by the HTTP handler that submitted it."""

    request_id: str
    prompt_tokens: int
    arrival: float
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: Exception | None = None
    first_token_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class _Publishers(EventPublisher):
    """The step's batch to each of the engine's publishers (kvbus's, vLLM's ZMQ). A
    batch published between steps (a cache reset's, `publish_queued_events`) goes to
    kvbus's at once and to vLLM's ZMQ publisher with the next step's, as a real engine
    running the plugin with ``KVBUS_KEEP_ZMQ`` does."""

    def __init__(self, publishers: list[EventPublisher]) -> None:
        super().__init__(0)
        self.publishers = publishers
        self._held: list[Any] = []

    def publish(self, events: EventBatch) -> None:
        later = prepend_events(self._held, events)
        for publisher in self.publishers:
            publisher.publish(events if isinstance(publisher, KvbusEventPublisher) else later)

    def publish_early(self, events: EventBatch) -> None:
        for publisher in self.publishers:
            if isinstance(publisher, KvbusEventPublisher):
                publisher.publish_early(events)
        if not all(isinstance(p, KvbusEventPublisher) for p in self.publishers):
            self._held.extend(events.events)

    def shutdown(self) -> None:
        for publisher in self.publishers:
            publisher.shutdown()


class _BoundZmqPublisher(ZmqEventPublisher):
    """vLLM's ZMQ publisher, always bound on its endpoint. vLLM binds only wildcard
    endpoints (``tcp://*:Z``) and *connects* to a named host, so ``tcp://127.0.0.1:Z``
    would listen nowhere and no subscriber (vllm-router kv_aware) would get an event;
    binding the named host keeps ``--host`` (loopback by default) as the only address."""

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        return True


@dataclass(frozen=True)
class BusOptions:
    """Where a simulated engine publishes: the bus (``url``, None: nowhere) and vLLM's
    ZMQ events (``zmq_port``, None: off) with their replay socket (``zmq_replay_port``,
    None: none), both on ``zmq_host``."""

    url: str | None = None
    zmq_port: int | None = None
    zmq_host: str = "127.0.0.1"
    zmq_replay_port: int | None = None
    advertise: str = ""
    """Where the engine serves HTTP, in its load records (routers that find their workers
    on the bus)."""


class SimEngine:
    """One simulated engine named ``name`` (its bus source is ``name/dp0``)."""

    def __init__(
        self,
        name: str,
        config: VllmConfig,
        timing: TimingModel,
        bus: BusOptions,
        model_name: str,
    ) -> None:
        self.name = name
        self.config = config
        self.timing = timing
        self.bus = bus
        self.model_name = model_name
        self.metrics = EngineMetrics(model_name)
        self.restarts = 0
        self._ids = itertools.count()
        self._streams: dict[str, RequestStream] = {}
        self._arrived: list[tuple[RequestStream, list[int], SamplingParams, str | None]] = []
        self._aborted: list[str] = []
        self._wake = asyncio.Event()
        self._stepping = asyncio.Lock()
        """Held from a step's schedule to its update: what runs between steps (a reset)
        takes it."""
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.step_seconds = 0.0
        """The modelled time of every step run so far (what the profile, ``--speedup`` and
        ``--slow`` make them; the wall time is at least this)."""
        self._start_core()

    # --- lifecycle -----------------------------------------------------------------

    def _start_core(self) -> None:
        self.core = EngineCore(self.config, self.timing, seed=request_seed(self.name))
        publishers: list[EventPublisher] = []
        source = f"{self.name}/dp0"
        if self.bus.url:
            publishers.append(KvbusEventPublisher(0, url=self.bus.url, source=source))
        if self.bus.zmq_port is not None:
            host, replay_port = self.bus.zmq_host, self.bus.zmq_replay_port
            replay = None if replay_port is None else f"tcp://{host}:{replay_port}"
            publisher = _BoundZmqPublisher(
                0, endpoint=f"tcp://{host}:{self.bus.zmq_port}", replay_endpoint=replay
            )
            publishers.append(publisher)
        self._publishers = _Publishers(publishers)
        self.core.scheduler.kv_event_publisher = self._publishers
        self.stat_logger = (
            KvbusStatLogger(
                self.core.config, 0, url=self.bus.url, source=source, advertise=self.bus.advertise
            )
            if self.bus.url
            else None
        )
        if self.stat_logger is not None:
            self.stat_logger.log_engine_initialized()  # as vLLM's front end, once up

    async def _stop_core(self, why: str, executor: Executor | None) -> None:
        """Stop stepping, fail every request the core holds (on the loop: they wake
        their handlers) and close its publishers in ``executor`` (a close blocks while
        it flushes). Requests that arrive meanwhile wait for the next core."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.error = EngineStopped(why)
            stream.changed.set()
        self._arrived = [a for a in self._arrived if a[0].request_id in self._streams]
        self._aborted = []
        publishers, stat_logger = self._publishers, self.stat_logger
        loop = asyncio.get_running_loop()
        closing = [loop.run_in_executor(executor, publishers.shutdown)]
        if stat_logger is not None:  # both epochs end together, not one after the other
            closing.append(loop.run_in_executor(executor, stat_logger.close))
        await asyncio.gather(*closing)

    def flush(self, timeout: float) -> bool:
        """Block until what the engine published so far reached the bus (from a thread)."""
        publishers: list[Any] = [
            p.publisher for p in self._publishers.publishers if isinstance(p, KvbusEventPublisher)
        ]
        if self.stat_logger is not None and self.stat_logger.publisher is not None:
            publishers.append(self.stat_logger.publisher)
        return all(p.flush(timeout) for p in publishers)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kvbus-sim-{self.name}")

    async def restart(self) -> None:
        """As if the engine's process were killed and started again (a new epoch, an
        empty cache; requests in flight fail)."""
        await self._stop_core("the engine restarted", None)
        self.restarts += 1
        self._start_core()
        self.start()

    async def close(self, executor: Executor | None = None) -> None:
        """Stop stepping and end the epoch (``SourceStopped``)."""
        await self._stop_core("the engine stopped", executor)

    # --- requests --------------------------------------------------------------------

    def submit(
        self, prompt: list[int], sampling: SamplingParams, cache_salt: str | None = None
    ) -> RequestStream:
        stream = RequestStream(f"{self.name}-{next(self._ids)}", len(prompt), time.time())
        self._arrived.append((stream, prompt, sampling, cache_salt))
        self._streams[stream.request_id] = stream
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """The client went away: the request is aborted before the next step."""
        if self._streams.pop(stream.request_id, None) is not None:
            self._aborted.append(stream.request_id)
            self._wake.set()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``/reset_prefix_cache`` (see `EngineCore.reset_prefix_cache`), run
        after the step in progress as vLLM's engine core runs it; its ``AllBlocksCleared``
        reaches the bus at once, as on a real engine running kvbus's plugin."""
        async with self._stepping:
            return self.core.reset_prefix_cache(reset_running_requests)

    @property
    def load(self) -> tuple[int, int]:
        scheduler = self.core.scheduler
        return len(scheduler.running), len(scheduler.waiting)

    # --- the engine loop -----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._admit()
            while self.core.has_work():
                async with self._stepping:
                    started = loop.time()
                    decision, seconds = self.core.begin_step()
                    # The forward pass: new arrivals wait for the next step, as in vLLM.
                    await asyncio.sleep(max(0.0, started + seconds - loop.time()))
                    outputs, stats = self.core.end_step(decision)
                self._deliver(outputs)
                self.steps += 1
                self.step_seconds += seconds
                if stats is not None:
                    self._record(stats)
                if not decision.total_num_scheduled_tokens and not outputs:
                    break  # nothing can run until a request arrives or ends: no busy loop
                self._admit()

    def _admit(self) -> None:
        if self._aborted:
            self.core.abort(self._aborted)
            self._aborted = []
        for stream, prompt, sampling, cache_salt in self._arrived:
            self.core.add(stream.request_id, prompt, sampling, stream.arrival, cache_salt)
        self._arrived.clear()

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.time()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.prefill_stats is not None:
                stream.cached_tokens = output.prefill_stats.num_cached_tokens
            if output.new_token_ids:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                    self.metrics.ttft.observe(now - stream.arrival)
                stream.tokens.extend(output.new_token_ids)
            if output.finish_reason is not None:
                stream.finish_reason = str(output.finish_reason)
                del self._streams[output.request_id]
                self.metrics.finished(
                    stream.finish_reason, stream.prompt_tokens, len(stream.tokens)
                )
                self.metrics.e2e.observe(now - stream.arrival)
            stream.changed.set()

    def _record(self, stats: Any) -> None:
        self.metrics.record_step(stats)
        if self.stat_logger is not None:
            self.stat_logger.record(stats, None)
