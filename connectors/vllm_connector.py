"""`KvbusConnector`: a vLLM KV connector that wraps another and puts its transfers on the bus.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvbusConnector",
        "kv_connector_module_path": "kvbus.connectors.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"inner": {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}}}'

``inner`` is any vLLM connector's ``KVTransferConfig`` as a dict (MultiConnector
included; ``kv_role`` defaults to the outer one). Every method of both roles is
forwarded to it explicitly, class methods included. Without ``inner`` the connector
is a pass-through: its inner is `PassThrough`, which answers as vLLM runs with no
connector (nothing to load or save, no per-layer hooks), so nothing is published.
Use ``KvbusHMAConnector`` for an inner that supports the hybrid memory allocator.

From the scheduler-side instance (one per engine core), under the engine's source name
(``$KVBUS_SOURCE/dp<rank>``, as its KV events), one `kvbus.wire.events.ConnectorBatch` per
step with anything to say goes to the ``connector`` stream of ``$KVBUS_URL``
(``extra_config["url"]``/``["stream"]`` override): each request's transfers from plan to
outcome (`kvbus.routing.transfers.TransferTracker`), the inner's stats of the step (the objects
handed over that step, serialized at once, never re-sent), and, with
``"verify_transfers": true`` (or ``{"sample": 0.1}``), per-block digests of the KV the
workers saved and loaded (`kvbus.connectors.kv_blocks`). The connector's KV events
(``take_events``, worker-side ``get_kv_connector_kv_cache_events``) are forwarded, so
they leave in the engine's own KV event batch as before: never published twice.

Faults stay inside: an inner that raises in a lookup loses that request's external hit
(it is computed instead); one that raises while planning or running a load gets the
load's blocks reported as invalid, so vLLM fails or recomputes those requests
(``kv_load_failure_policy``) and keeps serving the rest; stats that cannot be encoded,
or exceed ``max_stats_bytes``, are left out of the record with the reason. Each is
counted, logged (rate-limited) and recorded on the bus.

This class is what vLLM loads and calls; each hook asks the inner and records what it
reported, through the parts it is made of: `SchedulerSide` (scheduler-role hooks and
the transfer tracker, `vllm_connector_scheduler`), `WorkerSide` (worker-role hooks,
`vllm_connector_worker`), `StepRecords` (the records and their publisher,
`vllm_connector_records`), and what travels between the roles
(`vllm_connector_parts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvbus.connectors.vllm_connector_parts import (
    MAX_OUTCOMES,
    Faults,
    KvbusConnectorStats,
    KvbusMetadata,
    KvbusPromMetrics,
    KvbusWorkerMetadata,
    class_name,
    class_of,
    extra_config,
    inner_of,
    inner_transfer_config,
)
from kvbus.connectors.vllm_connector_passthrough import PassThrough
from kvbus.connectors.vllm_connector_records import DEFAULT_MAX_STATS_BYTES, StepRecords
from kvbus.connectors.vllm_connector_scheduler import Finished, SchedulerSide
from kvbus.connectors.vllm_connector_worker import WorkerSide
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbus.bus.relay import EnginePublisher
from kvbus.routing.transfers import TransferTracker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

__all__ = [
    "DEFAULT_MAX_STATS_BYTES",
    "MAX_OUTCOMES",
    "KvbusConnector",
    "KvbusConnectorStats",
    "KvbusHMAConnector",
    "KvbusMetadata",
    "KvbusPromMetrics",
    "KvbusWorkerMetadata",
    "PassThrough",
]


class KvbusConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = extra_config(vllm_config)
        inner_cls, child = inner_of(vllm_config)
        self.inner: KVConnectorBase_V1 = inner_cls(child, role, kv_cache_config)
        # A pass-through moves no KV: nothing to verify, no saves to record.
        moves_kv = inner_cls is not PassThrough
        self.inner_name = class_name(inner_cls) if moves_kv else ""
        self.faults = Faults(self.inner_name)
        self.block_size = vllm_config.cache_config.block_size
        # vLLM refuses invalid-block reports from models with several KV cache groups
        # (hybrid models): there a load fault cannot be contained, only raised.
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        can_fail_loads = len(groups) <= 1
        verify = (extra.get("verify_transfers") or False) if moves_kv else False
        verify_sample = (
            float(verify.get("sample", 1.0))
            if isinstance(verify, dict)
            else (1.0 if verify else 0.0)
        )
        rank = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        self.records = StepRecords(extra, rank, self.faults)
        self.scheduler = SchedulerSide(
            self.inner,
            self.faults,
            self.records,
            TransferTracker(self.block_size, sync_saves=moves_kv and self._sync_saves(extra)),
            can_fail_loads,
            verify_sample,
            digests_saves=verify_sample > 0.0 and bool(self._kv_transfer_config.is_kv_producer),
        )
        num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        self.worker = WorkerSide(self.inner, self.faults, num_blocks, can_fail_loads)

    def _sync_saves(self, extra: dict[str, Any]) -> bool:
        """Whether to record saves the inner makes inside the forward passes (see
        `TransferTracker`): ``"sync_saves"`` in the config, else for vLLM's
        ExampleConnector and its subclasses, which save every prompt they did not load."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )

        if "sync_saves" in extra:
            return bool(extra["sync_saves"])
        return isinstance(self.inner, ExampleConnector) and bool(
            self._kv_transfer_config.is_kv_producer
        )

    @property
    def errors(self) -> dict[str, int]:
        """Inner calls that raised, by method (contained, see the module's docstring)."""
        return self.faults.counts

    @property
    def tracker(self) -> TransferTracker:
        return self.scheduler.tracker

    @property
    def verify_sample(self) -> float:
        return self.scheduler.verify_sample

    @property
    def stats_lost(self) -> int:
        return self.records.stats_lost

    @property
    def max_stats_bytes(self) -> int:
        return self.records.max_stats_bytes

    @property
    def publisher(self) -> EnginePublisher | None:
        return self.records.publisher

    # --- properties ----------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.inner.supports_divergent_local_hybrid_hits

    # --- worker side ---------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        return self.inner.get_mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata)

    def has_connector_metadata(self) -> bool:
        """vLLM runs the per-layer hooks while this is true: while the inner holds this
        step's metadata (never for `PassThrough`, as with no connector; nor in a step
        whose inner metadata could not be built, where the hooks have nothing to run)."""
        return self.inner.has_connector_metadata()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear()

    def finish_forward(self) -> None:
        self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        self.inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> Any:
        return self.inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    # --- both sides ----------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker side: the inner's stats of the step. Scheduler side: the inner's,
        plus the transfers that ended since the last call (for vLLM's metrics)."""
        inner_stats = None
        try:
            inner_stats = self.inner.get_kv_connector_stats()
        except Exception as error:
            self.faults.contain("get_kv_connector_stats", error)
            self.records.stats_failed()
        if self._role == KVConnectorRole.SCHEDULER and inner_stats is not None:
            if not self.records.scheduler_stats(inner_stats):
                inner_stats = None  # vLLM would fail to send it to its front end
        transfers = self.records.take_outcomes()
        if inner_stats is None and not transfers:
            return None
        return KvbusConnectorStats(
            inner=inner_stats, connector=self.inner_name, transfers=transfers
        )

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()  # type: ignore[no-untyped-call]
        finally:
            self.records.close()

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache()

    # vLLM 0.33: sleep mode around the KV caches.
    def unregister_kv_caches(self) -> None:
        if hasattr(self.inner, "unregister_kv_caches"):
            self.inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if hasattr(self.inner, "restore_kv_caches"):
            self.inner.restore_kv_caches()

    # --- scheduler side ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Any) -> None:
        self.inner.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> Finished:
        return self.scheduler.finished(
            request, block_ids, lambda: self.inner.request_finished(request, block_ids)
        )

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...], partial_tail_offloads: Any
    ) -> bool:
        return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[Any]:
        """The inner's KV events, forwarded into the engine's batch; and, once per
        step (vLLM calls this once per step output), this step's record to the bus."""
        return self.scheduler.take_events()

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work()

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    # --- class methods: resolved through the inner's class -------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner_cls, child = inner_of(vllm_config)
        return inner_cls.get_required_kvcache_layout(child)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = (extra_config or {}).get("inner")
        if not isinstance(inner, dict) or not inner.get("kv_connector"):
            return PassThrough.requires_piecewise_for_cudagraph({})
        config = KVTransferConfig(**{"kv_role": "kv_both", **inner})
        return class_of(config).requires_piecewise_for_cudagraph(
            dict(config.kv_connector_extra_config)
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.33: sleep mode is possible when the inner allows it."""
        inner = kv_transfer_config.kv_connector_extra_config.get("inner")
        if not isinstance(inner, dict) or not inner.get("kv_connector"):
            return PassThrough.supports_sleep_mode(kv_transfer_config)
        inner_cls: Any = class_of(inner_transfer_config(kv_transfer_config, inner))
        check = getattr(inner_cls, "supports_sleep_mode", None)
        return bool(check(inner_transfer_config(kv_transfer_config, inner))) if check else False

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        if not data:
            return KvbusConnectorStats()
        return KvbusConnectorStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvbusPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class KvbusHMAConnector(KvbusConnector, SupportsHMA):
    """`KvbusConnector` for an inner that supports the hybrid memory allocator (vLLM
    decides HMA from this class alone, so an inner without it is refused)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if not isinstance(self.inner, SupportsHMA):
            raise ValueError(
                f"KvbusHMAConnector: the inner {self.inner_name} does not support the "
                "hybrid memory allocator; use KvbusConnector"
            )
        self._hma_inner: SupportsHMA = self.inner

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> Finished:
        first = block_ids[0] if block_ids else []
        return self.scheduler.finished(
            request, first, lambda: self._hma_inner.request_finished_all_groups(request, block_ids)
        )
