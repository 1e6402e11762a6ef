"""A vLLM stat logger that publishes each engine's load on the kvbus metrics stream.

Loaded by vLLM's ``vllm.stat_logger_plugins`` entry point (every ``vllm serve`` /
AsyncLLM), or passed as ``stat_loggers=[KvbusStatLogger]``. Without ``KVBUS_URL`` it
does nothing. Records go to ``$KVBUS_METRICS_STREAM`` (default ``metrics``) under the
same source name as the engine's KV events (`engine_source`), at most one per
``$KVBUS_METRICS_INTERVAL`` seconds per engine (default 0.25), plus at once when the
engine turns busy or idle, and every ``$KVBUS_METRICS_HEARTBEAT`` seconds (default 2) while
nothing else is sent, so consumers can tell an idle engine from a dead one. When the
process exits (a server stopped cleanly), the logger closes: ``SourceStopped`` ends its
epoch, and consumers see the engine ``stopped`` rather than silent.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Final

from kvbus.connectors.vllm_events import STOP_WITHIN, engine_source
from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase

from kvbus import metrics
from kvbus.bus.relay import EnginePublisher, engine_publisher
from kvbus.wire.envelope import Kind
from kvbus.wire.events import LoadMetrics

log = logging.getLogger("kvbus.connectors.vllm_stats")


def advertised_url(argv: list[str] | None = None) -> str:
    """Where this engine serves, for routers that discover it from the bus:
    ``$KVBUS_ADVERTISE_URL`` (behind NAT, or a Kubernetes pod's IP), else the API
    server's own ``--host``/``--port`` (this logger runs in its process): ``--host``
    unset or a wildcard advertises the machine's host name; port 8000 unless given.
    "" when the process is not vLLM's API server (no ``--port`` and not ``serve``)."""
    given = os.environ.get("KVBUS_ADVERTISE_URL")
    if given:
        return given.rstrip("/")
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    argv = sys.argv[1:] if argv is None else argv
    try:
        known, _ = parser.parse_known_args(argv)
    except SystemExit:  # a --port that is not a number: not ours to judge
        return ""
    if known.port is None and "serve" not in argv:
        return ""
    host = known.host
    if not host or host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{known.port or 8000}"


ROLES: Final = {"prefill": "prefill", "decode": "decode", "both": "", "": ""}


def engine_role() -> str:
    """This engine's part in prefill/decode disaggregation, for routers:
    ``$KVBUS_ROLE`` (``prefill``, ``decode`` or ``both``, the default). Never guessed
    from the connector's ``kv_role``: producer and consumer engines (LMCache's, say)
    need not be a P/D fleet, and routing them as one would split every request."""
    given = os.environ.get("KVBUS_ROLE", "").strip().lower()
    role = ROLES.get(given)
    if role is None:
        log.warning("KVBUS_ROLE=%r is not prefill, decode or both: advertising both", given)
        return ""
    return role


class KvbusStatLogger(StatLoggerBase):
    """``url`` and ``source`` default to ``KVBUS_URL`` and `engine_source`, ``advertise``
    (where the engine serves) to `advertised_url`; `kvbus sim` gives them for each of
    its engines."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_index: int = 0,
        *,
        url: str | None = None,
        source: str | None = None,
        advertise: str | None = None,
    ) -> None:
        self.engine_index = engine_index
        self.vllm_config = vllm_config
        self.interval = float(os.environ.get("KVBUS_METRICS_INTERVAL", "0.25"))
        self.heartbeat = float(os.environ.get("KVBUS_METRICS_HEARTBEAT", "2"))
        self.publisher: EnginePublisher | None = None
        if not (url or os.environ.get("KVBUS_URL")):
            return
        self.publisher = engine_publisher(
            url,
            stream=os.environ.get("KVBUS_METRICS_STREAM", "metrics"),
            source=source or engine_source(engine_index),
            data_parallel_rank=engine_index,
        )
        # vLLM's /metrics (one API server) serves the default registry: the bus's
        # series, this process's and its engine processes' reports, go there too.
        metrics.register()
        self._lock = threading.Lock()
        self._latest = LoadMetrics(
            ts=time.time(), engine_index=engine_index, running=0, waiting=0, kv_cache_usage=0.0
        )
        self.url = advertise if advertise is not None else advertised_url()
        self.role = engine_role()
        names = vllm_config.model_config.served_model_name if vllm_config.model_config else None
        self.model: str = (names[0] if names else "") if isinstance(names, list) else names or ""
        self._deltas = [0, 0, 0, 0]  # prefix queries, hits; connector queries, hits
        self._last_sent = 0.0
        self._closed = threading.Event()
        threading.Thread(target=self._beat, name="kvbus-metrics-heartbeat", daemon=True).start()
        # vLLM tells a stat logger nothing when it stops; the process's exit does.
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the heartbeat and end the epoch with ``SourceStopped`` (within about
        `STOP_WITHIN` seconds whatever the bus does). Idempotent."""
        if self.publisher is None:
            return
        self._closed.set()
        self.publisher.close(STOP_WITHIN)  # a record published after it is only counted

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if self.publisher is None or scheduler_stats is None:
            return
        with self._lock:
            prefix = scheduler_stats.prefix_cache_stats
            connector = scheduler_stats.connector_prefix_cache_stats
            self._deltas[0] += prefix.queries
            self._deltas[1] += prefix.hits
            if connector is not None:
                self._deltas[2] += connector.queries
                self._deltas[3] += connector.hits
            was_busy = self._latest.running or self._latest.waiting
            self._latest = LoadMetrics(
                ts=time.time(),
                engine_index=self.engine_index,
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs,
                kv_cache_usage=scheduler_stats.kv_cache_usage,
            )
            busy = bool(self._latest.running or self._latest.waiting)
            # Changes between idle and busy go out at once; the rest at most per interval.
            if busy != bool(was_busy) or time.monotonic() - self._last_sent >= self.interval:
                self._send()

    def _send(self) -> None:
        """Publish the latest state with the deltas gathered since the last one (lock held)."""
        assert self.publisher is not None
        queries, hits, connector_queries, connector_hits = self._deltas
        self._deltas = [0, 0, 0, 0]
        self._last_sent = time.monotonic()
        self.publisher.publish(
            LoadMetrics(
                ts=time.time(),
                engine_index=self.engine_index,
                running=self._latest.running,
                waiting=self._latest.waiting,
                kv_cache_usage=self._latest.kv_cache_usage,
                prefix_cache_queries=queries,
                prefix_cache_hits=hits,
                connector_prefix_cache_queries=connector_queries,
                connector_prefix_cache_hits=connector_hits,
                kv_cache_blocks=self._kv_cache_blocks(),
                block_size=int(self.vllm_config.cache_config.block_size or 0),
                url=self.url,
                model=self.model,
                role=self.role,
            ),
            Kind.METRICS,
        )

    def _kv_cache_blocks(self) -> int:
        """This engine's KV cache capacity: vLLM sets the total of the engines this
        front end started once they report in (0 until then)."""
        total = self.vllm_config.cache_config.num_gpu_blocks or 0
        engines = getattr(self.vllm_config.parallel_config, "data_parallel_size_local", 1)
        return int(total) // max(1, int(engines or 1))

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat / 2):
            with self._lock:
                if time.monotonic() - self._last_sent >= self.heartbeat:
                    self._send()

    def log_engine_initialized(self) -> None:
        """vLLM calls this once the engine is up (its KV cache sized): the first load
        record goes out now, so routers take a (re)started engine back at once. An idle
        engine runs no step to record, and the heartbeat would tell them only after half
        of ``KVBUS_METRICS_HEARTBEAT``; meanwhile the conversations it held went to
        other workers, and stay there."""
        if self.publisher is None:
            return
        with self._lock:
            self._send()
