"""`StepRecords`: what the scheduler-side `KvbusConnector` publishes on the bus.

One `kvbus.wire.events.ConnectorBatch` per step with anything to say, on the ``connector``
stream of ``$KVBUS_URL`` (``extra_config["url"]``/``["stream"]`` override), under the
engine's source name: the step's transfer records, the inner's stats of the step
(serialized when handed over, never re-sent; left out with the reason when they cannot
be encoded or exceed ``max_stats_bytes``) and the workers' block digests. The ended
transfers also wait here for vLLM's own metrics (`take_outcomes`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Final

import msgspec
from kvbus.connectors.vllm_connector_parts import MAX_OUTCOMES, Faults
from kvbus.connectors.vllm_events import engine_source, report_bus_metrics
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvbus.bus.relay import EnginePublisher, engine_publisher
from kvbus.logs import LimitedLog
from kvbus.routing.transfers import Outcome, outcomes
from kvbus.wire.envelope import Kind
from kvbus.wire.events import BlockDigest, ConnectorBatch, ConnectorStats, TransferEvent

_limited = LimitedLog(logging.getLogger("kvbus.connectors"))

DEFAULT_MAX_STATS_BYTES: Final = 256 * 1024
_encoder: Final = msgspec.msgpack.Encoder()


class StepRecords:
    def __init__(self, extra: dict[str, Any], rank: int, faults: Faults) -> None:
        self.faults = faults
        self.max_stats_bytes = int(extra.get("max_stats_bytes", DEFAULT_MAX_STATS_BYTES))
        self.stats_lost = 0
        """Stats objects left out of the records (unencodable or oversized)."""
        self.digests: list[BlockDigest] = []
        """The workers' block digests, for the next record."""
        self._url = extra.get("url")
        self._stream = str(extra.get("stream", "connector"))
        self._rank = rank
        self._publisher: EnginePublisher | None = None
        self._publisher_lock = threading.Lock()
        self._publishing = True
        self._worker_stats: bytes | None = None
        self._scheduler_stats: bytes | None = None
        self._unencodable = False
        self._lost = ""
        self._outcomes: list[Outcome] = []

    # --- the inner's stats -------------------------------------------------------------

    def workers_stats(self, stats: KVConnectorStats) -> bool:
        """The workers' stats of a step, aggregated by vLLM: serialized now (vLLM
        aggregates into this object later in the step). False when they cannot be
        encoded, so vLLM must not be handed them either."""
        self._worker_stats = self._encode(stats)
        return not self._unencodable

    def scheduler_stats(self, stats: KVConnectorStats) -> bool:
        """The scheduler-side inner's stats, as `workers_stats`."""
        self._scheduler_stats = self._encode(stats)
        return not self._unencodable

    def stats_failed(self) -> None:
        """The inner raised while asked for its stats."""
        self._lost = self._lost or "inner_error"

    def _encode(self, stats: KVConnectorStats) -> bytes | None:
        """The stats' payload in msgpack, or None (empty, or lost: see ``_lost``)."""
        self._unencodable = False
        try:
            if stats.is_empty():
                return None
            data = _encoder.encode(stats.to_dict())
        except Exception as error:  # a payload msgspec cannot encode, or a broken stats class
            self._unencodable = True
            self.stats_lost += 1
            self._lost = f"unencodable: {type(error).__name__}"
            _limited.warning("stats_unencodable", "kvbus: connector stats not encodable: %r", error)
            return None
        if len(data) > self.max_stats_bytes:
            self.stats_lost += 1
            self._lost = f"oversized: {len(data)} bytes > max_stats_bytes={self.max_stats_bytes}"
            _limited.warning("stats_oversized", "kvbus: connector stats %s", self._lost)
            return None
        return data

    def take_outcomes(self) -> list[Outcome]:
        """The transfers that ended since the last call (for vLLM's metrics)."""
        ended, self._outcomes = self._outcomes, []
        return ended

    # --- one record per step -----------------------------------------------------------

    def publish_step(self, step: int, transfers: list[TransferEvent]) -> None:
        ended = outcomes(transfers)
        if ended:
            room = max(0, MAX_OUTCOMES - len(self._outcomes))
            self._outcomes += ended[:room]
        stats = None
        if self._worker_stats or self._scheduler_stats or self._lost:
            stats = ConnectorStats(
                connector=self.faults.inner_name,
                workers=self._worker_stats or b"",
                scheduler=self._scheduler_stats or b"",
                lost=self._lost,
            )
            self._worker_stats = self._scheduler_stats = None
            self._lost = ""
        if not transfers and stats is None and not self.digests:
            return
        batch = ConnectorBatch(time.time(), step, transfers, stats, self.digests)
        self.digests = []
        try:
            publisher = self._ensure_publisher()
            if publisher is not None:
                publisher.publish(batch, Kind.CONNECTOR)
        except Exception as error:  # a URL no transport takes: the engine goes on
            self.faults.contain("publish", error)
            self._url, self._publishing = None, False

    def _ensure_publisher(self) -> EnginePublisher | None:
        """Opened on the first record (a pass-through never opens one)."""
        if self._publisher is None:
            if not self._publishing or not (self._url or os.environ.get("KVBUS_URL")):
                return None
            with self._publisher_lock:
                if self._publisher is None:
                    self._publisher = engine_publisher(
                        self._url,
                        stream=self._stream,
                        source=engine_source(self._rank),
                        data_parallel_rank=self._rank,
                    )
                    report_bus_metrics()
        return self._publisher

    @property
    def publisher(self) -> EnginePublisher | None:
        return self._publisher

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
