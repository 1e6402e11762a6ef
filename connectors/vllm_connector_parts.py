"""What `KvbusConnector` hands between vLLM's processes, and how it finds its inner.

vLLM moves connector metadata from the scheduler to the workers and back each step,
stats from the workers to the scheduler and on to its front end (as a dict, rebuilt
there with no config at hand), and builds Prometheus metrics in the front end from the
config alone: each of those wraps the inner connector's own object here. The inner's
faults, contained by the wrapper, are counted here too (`Faults`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvbus.connectors.vllm_connector_passthrough import PassThrough
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbus.logs import LimitedLog
from kvbus.routing.transfers import LOAD, SAVE, Outcome, TransferCounters
from kvbus.wire.events import BlockDigest

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MAX_OUTCOMES: Final = 4096
"""Ended transfers carried by one stats object to vLLM's front end (the rest are
counted on the bus only)."""


def extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(ktc.kv_connector_extra_config) if ktc is not None else {}


def inner_transfer_config(outer: KVTransferConfig, inner: dict[str, Any]) -> KVTransferConfig:
    fields = {"kv_role": outer.kv_role, **inner}
    fields.setdefault("engine_id", outer.engine_id)
    return KVTransferConfig(**fields)


def inner_config(vllm_config: VllmConfig) -> VllmConfig | None:
    """The VllmConfig the inner connector sees (a shallow copy, as MultiConnector
    gives its children), or None for a pass-through."""
    inner = extra_config(vllm_config).get("inner")
    if inner is None:
        return None
    if not isinstance(inner, dict) or not inner.get("kv_connector"):
        raise ValueError('KvbusConnector: "inner" must be a KVTransferConfig dict')
    child = copy.copy(vllm_config)
    assert vllm_config.kv_transfer_config is not None
    child.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config, inner)
    return child


def inner_of(vllm_config: VllmConfig) -> tuple[type[KVConnectorBase_V1], VllmConfig]:
    """The inner connector's class and the VllmConfig it sees: `PassThrough` and the
    wrapper's own config when none is configured."""
    child = inner_config(vllm_config)
    if child is None:
        return PassThrough, vllm_config
    assert child.kv_transfer_config is not None
    return class_of(child.kv_transfer_config), child


def class_of(config: KVTransferConfig) -> type[KVConnectorBase_V1]:
    return KVConnectorFactory.get_connector_class(config)


def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.lru_cache(maxsize=64)
def _class_named(name: str) -> type[KVConnectorBase_V1] | None:
    """An inner connector class from `_class_name` (only connector classes qualify)."""
    module, _, qualname = name.partition(":")
    try:
        value: Any = importlib.import_module(module)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError, ValueError):
        return None
    if isinstance(value, type) and issubclass(value, KVConnectorBase_V1):
        return value
    return None


_limited = LimitedLog(logging.getLogger("kvbus.connectors"))


class Faults:
    """The inner's calls that raised and were contained (see `KvbusConnector`): counted
    by method and logged, rate-limited."""

    def __init__(self, inner_name: str) -> None:
        self.inner_name = inner_name
        self.counts: dict[str, int] = {}

    def contain(self, method: str, error: BaseException) -> None:
        self.counts[method] = self.counts.get(method, 0) + 1
        _limited.warning(
            f"inner_{method}",
            "kvbus: the inner connector %s raised in %s (contained, %d so far): %r",
            self.inner_name,
            method,
            self.counts[method],
            error,
        )


# --- what travels between the two roles --------------------------------------------------


@dataclass
class KvbusMetadata(KVConnectorMetadata):
    """Scheduler to workers, each step: the inner's metadata and kvbus's own notes."""

    inner: KVConnectorMetadata | None
    new_requests: tuple[str, ...] = ()
    """Requests whose prompt is computed this step (a save error blames them)."""
    invalid_loads: tuple[int, ...] = ()
    """Blocks of loads the scheduler side knows failed (the inner raised): reported
    back as load errors, so vLLM fails or recomputes their requests."""
    released_loads: tuple[str, ...] = ()
    """Asynchronous loads the inner never heard of (it raised while planning them):
    each worker reports them received and failed, which is how vLLM lets them go."""
    loads: dict[str, list[int]] = field(default_factory=dict)
    """This step's synchronous loads (their blocks), for load errors and digests."""
    digest_saves: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    """Requests whose saved blocks to digest after the step: (first index, blocks)."""
    digest_loads: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


@dataclass
class KvbusWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers to scheduler, each step (vLLM aggregates it over workers)."""

    inner: KVConnectorWorkerMetadata | None = None
    digests: list[BlockDigest] = field(default_factory=list)
    failed_saves: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvbusWorkerMetadata):
            return self
        if self.inner is None:
            self.inner = other.inner
        elif other.inner is not None:
            self.inner = self.inner.aggregate(other.inner)
        self.digests += other.digests
        self.failed_saves |= other.failed_saves
        return self


@dataclass
class KvbusConnectorStats(KVConnectorStats):
    """The inner's stats object, with the class that rebuilds it named in the payload
    (vLLM's front end rebuilds stats from a dict, with no config at hand), plus this
    connector's ended transfers for vLLM's Prometheus endpoint."""

    inner: KVConnectorStats | None = None
    connector: str = ""
    transfers: list[Outcome] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "connector": self.connector,
            "data": self.inner.to_dict() if self.inner is not None else {},
            "transfers": [list(t) for t in self.transfers],
        }

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()  # type: ignore[no-untyped-call]
        self.transfers = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KvbusConnectorStats):
            if self.inner is None:
                self.inner = other.inner
            elif other.inner is not None:
                self.inner = self.inner.aggregate(other.inner)
            self.connector = self.connector or other.connector
            self.transfers += other.transfers[: max(0, MAX_OUTCOMES - len(self.transfers))]
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {}
        if self.inner is not None and not self.inner.is_empty():
            reduced.update(self.inner.reduce())
        for direction in (LOAD, SAVE):
            ended = [t for t in self.transfers if t[0] == direction]
            if ended:
                reduced[f"kvbus_{direction}s"] = len(ended)
                reduced[f"kvbus_{direction}_failed"] = sum(t[1] == "failed" for t in ended)
        return reduced

    def is_empty(self) -> bool:
        return not self.transfers and (self.inner is None or self.inner.is_empty())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvbusConnectorStats:
        name = str(data.get("connector", ""))
        inner_cls = _class_named(name) if name else None
        inner = None
        if inner_cls is not None and data.get("data"):
            inner = inner_cls.build_kv_connector_stats(data["data"])
        transfers: list[Outcome] = []
        for t in data.get("transfers", ())[:MAX_OUTCOMES]:
            direction, outcome, tokens, blocks, seconds = t
            transfers.append((str(direction), str(outcome), int(tokens), int(blocks), seconds))
        return cls(inner=inner, connector=name, transfers=transfers)


class KvbusPromMetrics(KVConnectorPromMetrics):
    """The inner's Prometheus metrics, as vLLM would have made them, beside kvbus's
    ``kvbus_connector_*`` transfer families, on vLLM's own metrics endpoint."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        inner_cls, child = inner_of(vllm_config)
        self.inner: KVConnectorPromMetrics | None = inner_cls.build_prom_metrics(
            child, metric_types, labelnames, per_engine_labelvalues
        )
        # vLLM unregisters its own "vllm:" families before building them again (a new
        # stat logger); do the same for ours.
        for name in list(getattr(REGISTRY, "_names_to_collectors", {})):
            if name.startswith("kvbus_connector_"):
                try:
                    REGISTRY.unregister(REGISTRY._names_to_collectors[name])
                except KeyError:
                    pass
        self.counters = TransferCounters(
            metric_types.get(Counter, Counter), metric_types.get(Histogram, Histogram), labelnames
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        stats = KvbusConnectorStats.from_dict(transfer_stats_data)
        self.counters.observe(labels, stats.transfers)
        if self.inner is not None and transfer_stats_data.get("data"):
            self.inner.observe(transfer_stats_data["data"], engine_idx)
