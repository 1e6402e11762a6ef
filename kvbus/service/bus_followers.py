"""The router service's bus followers: the kv stream into the index (its history, then
its live tail), the metrics stream's loads, other replicas' requests in flight (routes)
and the KV connector's records (into /metrics), each resumed after a failure where it
stopped; and whether the bus is up, judged by the metrics stream's silence."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

import kvbus
from kvbus.bus.follow import Follower
from kvbus.bus.subscription import Message, Resync
from kvbus.logs import LimitedLog, shown
from kvbus.routing.router import Router
from kvbus.routing.transfers import ConnectorMetrics
from kvbus.service.disagg import WorkerRoles
from kvbus.service.discovery import WorkerDiscovery
from kvbus.service.router_metrics import Metrics
from kvbus.service.worker_names import RANK
from kvbus.transports import open_transport
from kvbus.wire.events import LoadMetrics

log = logging.getLogger("kvbus.routing.router")
_limited_log = LimitedLog(log)  # one line a second per kind: bus items may come in floods
MAX_ENGINE_RANKS: Final = 256
"""Engines (data-parallel ranks) of one worker taken from its endpoint at most."""
_MAX_OTHER_SOURCES: Final = 64
"""Sources on the bus that are no configured worker's, remembered (for the message
that names them) at most; the names come from the network."""


class BusFollowers:
    """The bus streams the router follows, and what they told of the workers: which
    configured workers and which other sources were heard (`_known`), each worker's
    sources that sent load, and whether the history is read (`kv_replayed`,
    `load_read`)."""

    def __init__(
        self,
        workers: dict[str, str],
        router: Router,
        metrics: Metrics,
        url: str,
        kv_stream: str,
        metrics_stream: str,
        connector_metrics: ConnectorMetrics | None,
        connector_stream: str | None,
        routes_stream: str | None,
    ) -> None:
        self.workers = workers
        self.router = router
        self.metrics = metrics
        self.url = url
        self.kv_stream = kv_stream
        self.metrics_stream = metrics_stream
        self.connector_metrics = connector_metrics
        """The engines' KV connector transfers and stats, in this router's /metrics."""
        self.connector_stream = connector_stream
        self.routes_stream = routes_stream
        """Where replicas behind one address share their requests in flight."""
        self.started = self._bus_heard = time.monotonic()
        """When the latest item of the metrics stream arrived (or the start)."""
        self.heard_names: set[str] = set()
        """Configured workers some item on the bus came from."""
        self.other_sources: dict[str, None] = {}
        """Sources on the bus of no configured worker (`_MAX_OTHER_SOURCES` at most)."""
        self.load_sources: dict[str, set[str]] = {}
        """Per configured worker: its sources that sent load (bus or endpoint)."""
        self.discovery: WorkerDiscovery | None = None
        self.roles: WorkerRoles | None = None
        """Told each worker's advertised role (P/D, `kvbus.service.disagg`)."""
        """Workers found on the bus (``--discover-hosts``; None: only those configured)."""
        self.kv_replayed = False
        """The kv stream's retained history is in the index."""
        self.load_read = False
        """The metrics stream's recent past (each engine's latest load) was read."""

    def start_clock(self) -> None:
        """The service starts: the bus gets ``stale_after`` from now to be heard."""
        self.started = self._bus_heard = time.monotonic()

    @property
    def bus_up(self) -> bool:
        """Whether the metrics stream delivered anything in the last ``stale_after``
        seconds: every engine's stat logger sends a record every 2 s, so silence means
        the bus is down (or no engine publishes on it)."""
        return time.monotonic() - self._bus_heard < self.router.stale_after

    async def follow_kv(self) -> None:
        """The kv stream's history (until it ends, then ready), then its live tail."""
        async with self._follower(self.kv_stream, self.router.apply_kv, snapshot=True) as kv:
            await kv.replay()
            self.kv_replayed = True
            await kv.follow()

    async def follow_connector(self) -> None:
        """The connector stream's retained history, then its live tail, into /metrics."""
        assert self.connector_metrics is not None and self.connector_stream
        async with self._follower(self.connector_stream, self.connector_metrics.apply) as records:
            await records.follow()

    async def follow_routes(self) -> None:
        """Other replicas' requests in flight, from now on (older ones are done or
        will be soon); a lost event is not worth waiting for."""
        assert self.routes_stream
        routes = self._follower(
            self.routes_stream, self.router.apply_routes, start="latest", gap_timeout=0,
            accept=lambda _: True,
        )  # fmt: skip
        async with routes:
            await routes.follow()

    async def follow_metrics(self) -> None:
        """The metrics stream from ``stale_after`` seconds ago (older records would be
        stale anyway) to its end, then ready, then its live tail. Load records are
        state, not history: a gap is not worth waiting for (``gap_timeout=0``)."""
        position = None
        transport = open_transport(self.url)
        try:
            since = time.time() - self.router.stale_after
            position = await transport.position_at(self.metrics_stream, since)
        except Exception as error:  # then read what is retained
            log.warning("could not find the recent past of %s: %r", self.metrics_stream, error)
        finally:
            await transport.aclose()

        def apply_aged(item: Message | Resync) -> None:
            age = time.time() - item.ts if isinstance(item, Message) else 0.0
            self._apply_load(item, age)

        loads = self._follower(
            self.metrics_stream, apply_aged, start=kvbus.Cursor(position), gap_timeout=0,
            accept=self._heard_on_bus,
        )  # fmt: skip
        async with loads:
            await loads.replay()
            self.load_read = True
            loads.apply = self._apply_load
            await loads.follow()

    def _apply_load(self, item: Message | Resync, age: float = 0.0) -> None:
        discovery = self.discovery
        body = item.body if isinstance(item, Message) else None
        if discovery is not None:
            if isinstance(body, LoadMetrics) and body.url:
                discovery.offer(item.source, body.url)
            if RANK.sub("", item.source) not in self.workers:
                return  # not a worker (yet): its load would make it eligible, unreachable
        if isinstance(body, LoadMetrics):
            self.add_load_source(item.source)
            if self.roles is not None and RANK.sub("", item.source) in self.workers:
                # Only the router's own workers' roles: another fleet's engines on the
                # same bus must not turn P/D on here.
                self.roles.advertise(item.source, body.role)
        self.router.apply_metrics(item, age)

    def add_load_source(self, source: str) -> None:
        sources = self.load_sources.setdefault(RANK.sub("", source), set())
        if len(sources) < MAX_ENGINE_RANKS:
            sources.add(source)

    def _heard_on_bus(self, source: str) -> bool:
        """An item of the metrics stream arrived: the bus is up. Whether it is a
        configured worker's."""
        self._bus_heard = time.monotonic()
        return self._known(source)

    def _follower(
        self,
        stream: str,
        apply: Callable[[Message | Resync], None],
        *,
        accept: Callable[[str], bool] | None = None,
        **options: Any,
    ) -> Follower:
        """A reader of ``stream`` into ``apply``, of the items of sources ``accept``
        takes (default: configured workers); one bad item is counted and logged, not
        fatal; after a failure it resumes where it stopped (nothing applied twice)."""

        def bad_item(item: Message | Resync, _error: Exception) -> None:
            # One bad item must not stop the router.
            self.metrics.bad_items.inc()
            _limited_log.exception(
                "apply", "could not apply %s item from %s", stream, shown(item.source)
            )

        return Follower(
            stream, self.url, apply, accept=accept or self._known, on_bad_item=bad_item,
            retry_log=log, **options,
        )  # fmt: skip

    def _known(self, source: str) -> bool:
        """Whether ``source`` is a configured worker's (``NAME`` or ``NAME/dpN``);
        either way it was seen on the bus (`BusWatch` names the others)."""
        name = RANK.sub("", source)
        if name in self.workers:
            self.heard_names.add(name)
            return True
        if self.discovery is not None:
            # It may advertise itself (the metrics stream decides, `_apply_load`): its
            # history is indexed meanwhile, for a bounded number of such names.
            return self.discovery.indexes(name)
        others = self.other_sources
        if source not in others and len(others) < _MAX_OTHER_SOURCES:
            others[source] = None
        return False
