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

``KVBUS_KEEP_ZMQ=1`` keeps vLLM's own ZMQ publisher running beside kvbus's, on the
endpoints of ``--kv-events-config``, for consumers not yet moved to the bus (vLLM's
router, Dynamo's indexer); the step then also pays that publisher's queue put, which
blocks when its queue is full, as without kvbus.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from typing import Any

from vllm.distributed.kv_events import (
    EventBatch,
    EventPublisher,
    EventPublisherFactory,
    ZmqEventPublisher,
)

import kvbus
from kvbus import metrics
from kvbus.config import redact_url, resolve_source
from kvbus.envelope import Kind

log = logging.getLogger("kvbus.connectors")


def engine_source(data_parallel_rank: int) -> str:
    """The source name of one engine: ``$KVBUS_SOURCE/dp<rank>``.

    The event publisher (in vLLM's engine-core process) and the stat logger (in its
    front-end process) both use it, so a consumer joins an engine's KV state and load
    by name. `register` gives ``KVBUS_SOURCE`` a default in the first vLLM process
    (``hostname-pid`` of the front end), which the engine processes it spawns inherit.
    """
    return f"{resolve_source(None)}/dp{data_parallel_rank}"


class KvbusEventPublisher(EventPublisher):
    """vLLM ``EventPublisher`` backed by a `kvbus.Publisher` (URL from ``KVBUS_URL``).

    Takes the ZMQ options vLLM's config passes to a "zmq" publisher, for vLLM's own
    publisher when ``KVBUS_KEEP_ZMQ`` is set (ignored otherwise).
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        *,
        url: str | None = None,
        stream: str | None = None,
        **zmq_options: Any,
    ) -> None:
        super().__init__(data_parallel_rank)
        self.zmq: ZmqEventPublisher | None = None
        if os.environ.get("KVBUS_KEEP_ZMQ", "").lower() in ("1", "true", "yes"):
            self.zmq = ZmqEventPublisher(data_parallel_rank, **zmq_options)
        self.publisher = kvbus.Publisher(
            url,
            stream=stream,
            source=engine_source(data_parallel_rank),
            data_parallel_rank=data_parallel_rank,
        )
        report_bus_metrics()
        log.info(
            "kvbus: KV events of %s go to %s", self.publisher.source, redact_url(self.publisher.url)
        )

    def publish(self, events: EventBatch) -> None:
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self.publisher.publish(events, Kind.KV)
        if self.zmq is not None:
            self.zmq.publish(events)

    def shutdown(self) -> None:
        self.publisher.close()
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
        os.environ[metrics.METRICS_DIR_ENV] = directory
    # register_publisher() refuses a taken name, and the config only allows "zmq".
    EventPublisherFactory._registry["zmq"] = KvbusEventPublisher
