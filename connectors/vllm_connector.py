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
is a pass-through: nothing to load or save, no per-layer hooks, nothing published.
Use ``KvbusHMAConnector`` for an inner that supports the hybrid memory allocator.

From the scheduler-side instance (one per engine core), under the engine's source name
(``$KVBUS_SOURCE/dp<rank>``, as its KV events), one `kvbus.events.ConnectorBatch` per
step with anything to say goes to the ``connector`` stream of ``$KVBUS_URL``
(``extra_config["url"]``/``["stream"]`` override): each request's transfers from plan to
outcome (`kvbus.transfers.TransferTracker`), the inner's stats of the step (the objects
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
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

import msgspec
from kvbus.connectors.kv_blocks import block_digests
from kvbus.connectors.vllm_connector_parts import (
    MAX_OUTCOMES,
    KvbusConnectorStats,
    KvbusMetadata,
    KvbusPromMetrics,
    KvbusWorkerMetadata,
    class_name,
    class_of,
    extra_config,
    inner_config,
    inner_transfer_config,
)
from kvbus.connectors.vllm_events import engine_source, report_bus_metrics
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

import kvbus
from kvbus.envelope import Kind
from kvbus.events import BlockDigest, ConnectorBatch, ConnectorStats
from kvbus.logs import LimitedLog
from kvbus.transfers import (
    LOAD,
    MAX_TRACKED,
    SAVE,
    Outcome,
    TransferTracker,
    outcomes,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

log = logging.getLogger("kvbus.connectors")
_limited = LimitedLog(log)

DEFAULT_MAX_STATS_BYTES: Final = 256 * 1024
_encoder: Final = msgspec.msgpack.Encoder()
_Finished = tuple[bool, "dict[str, Any] | None"]
_PASS_THROUGH_META: Final = KvbusMetadata(None)
"""Every step's metadata of a pass-through (nothing in it changes)."""


# --- the connector ---------------------------------------------------------------------


class KvbusConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = extra_config(vllm_config)
        child = inner_config(vllm_config)
        self.inner: KVConnectorBase_V1 | None = None
        self.inner_name = ""
        if child is not None:
            assert child.kv_transfer_config is not None
            inner_cls = class_of(child.kv_transfer_config)
            self.inner_name = class_name(inner_cls)
            self.inner = inner_cls(child, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        # vLLM refuses invalid-block reports from models with several KV cache groups
        # (hybrid models): there a load fault cannot be contained, only raised.
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        self._can_fail_loads = len(groups) <= 1
        self.errors: dict[str, int] = {}
        """Inner calls that raised, by method (contained, see the module's docstring)."""
        self.stats_lost = 0
        verify = extra.get("verify_transfers") or False
        self.verify_sample = (
            float(verify.get("sample", 1.0))
            if isinstance(verify, dict)
            else (1.0 if verify else 0.0)
        )
        self.max_stats_bytes = int(extra.get("max_stats_bytes", DEFAULT_MAX_STATS_BYTES))
        self._url = extra.get("url")
        self._stream = str(extra.get("stream", "connector"))
        self._rank = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        self._publisher: kvbus.Publisher | None = None
        self._publisher_lock = threading.Lock()
        self._publishing = True
        # scheduler side
        self.tracker = TransferTracker(self.block_size, sync_saves=self._records_sync_saves(extra))
        self._matched_async: dict[str, bool] = {}
        self._invalid_loads: list[int] = []
        self._released: list[str] = []
        self._step_async: dict[str, list[int]] = {}
        self._step_loads: dict[str, list[int]] = {}
        self._digest_loads: dict[str, tuple[int, list[int]]] = {}
        self._worker_stats: bytes | None = None
        self._unencodable = False
        self._scheduler_stats: bytes | None = None
        self._lost = ""
        self._digests: list[BlockDigest] = []
        self._outcomes: list[Outcome] = []
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._release: set[str] = set()
        self._failed_saves: set[str] = set()
        self._bound: KvbusMetadata | None = None
        self._worker_rank = 0

    def _records_sync_saves(self, extra: dict[str, Any]) -> bool:
        """Whether to record saves the inner makes inside the forward passes (see
        `TransferTracker`): ``"sync_saves"`` in the config, else for vLLM's
        ExampleConnector and its subclasses, which save every prompt they did not load."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )

        if "sync_saves" in extra:
            return bool(extra["sync_saves"])
        assert self._kv_transfer_config is not None
        return isinstance(self.inner, ExampleConnector) and bool(
            self._kv_transfer_config.is_kv_producer
        )

    # --- containment ---------------------------------------------------------------------

    def _contain(self, method: str, error: BaseException) -> None:
        self.errors[method] = self.errors.get(method, 0) + 1
        _limited.warning(
            f"inner_{method}",
            "kvbus: the inner connector %s raised in %s (contained, %d so far): %r",
            self.inner_name,
            method,
            self.errors[method],
            error,
        )

    # --- properties ----------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery if self.inner is not None else False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        inner = self.inner
        return inner.supports_divergent_local_hybrid_hits if inner is not None else False

    # --- worker side ---------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        return self.inner.get_mem_pool_context() if self.inner is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self._kv_caches = kv_caches
        try:
            self._worker_rank = get_world_group().rank
        except (AssertionError, AttributeError):  # no process group (a unit test)
            self._worker_rank = 0
        if self.inner is not None:
            self.inner.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        if self.inner is not None:
            self.inner.set_host_xfer_buffer_ops(copy_operation)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if self.inner is None:
            return  # nothing bound: vLLM skips the per-layer hooks
        assert isinstance(connector_metadata, KvbusMetadata)
        super().bind_connector_metadata(connector_metadata)
        self._bound = connector_metadata
        self._load_errors.update(connector_metadata.invalid_loads)
        self._release.update(connector_metadata.released_loads)
        if connector_metadata.inner is not None:
            self.inner.bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        if self.inner is None:
            return  # nothing was bound
        super().clear_connector_metadata()
        if self._bound is not None:
            self.inner.clear_connector_metadata()
        self._bound = None

    def finish_forward(self) -> None:
        if self.inner is not None:
            self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        if self.inner is not None:
            self.inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.inner is None:
            return
        if isinstance(kv_connector_metadata, KvbusMetadata):
            if kv_connector_metadata.inner is not None:
                self.inner.handle_preemptions(kv_connector_metadata.inner)

    def _running_inner(self) -> KVConnectorBase_V1 | None:
        """The inner, if this step's metadata reached it (not when building it failed)."""
        bound = self._bound
        return self.inner if bound is not None and bound.inner is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.inner is None:
            return
        inner = self._running_inner()
        if inner is None:
            self._fail_loads()
            return
        try:
            inner.start_load_kv(forward_context, **kwargs)
        except Exception as error:
            self._contain_load("start_load_kv", error)

    def wait_for_layer_load(self, layer_name: str) -> None:
        inner = self._running_inner()
        if inner is None:
            return
        try:
            inner.wait_for_layer_load(layer_name)
        except Exception as error:
            self._contain_load("wait_for_layer_load", error)

    def _contain_load(self, method: str, error: Exception) -> None:
        """This step's synchronous loads failed: report their blocks invalid, so vLLM
        recomputes or fails their requests alone (where it accepts such reports)."""
        if not self._can_fail_loads:
            raise error
        self._contain(method, error)
        self._fail_loads()

    def _fail_loads(self) -> None:
        if self._bound is not None:
            for blocks in self._bound.loads.values():
                self._load_errors.update(blocks)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        inner = self._running_inner()
        if inner is None:
            return
        try:
            inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        except Exception as error:
            self._contain("save_kv_layer", error)
            self._fail_saves()

    def wait_for_save(self) -> None:
        if self.inner is None:
            return
        inner = self._running_inner()
        if inner is not None:
            try:
                inner.wait_for_save()  # type: ignore[no-untyped-call]
            except Exception as error:
                self._contain("wait_for_save", error)
                self._fail_saves()
        if self._bound is not None and self._kv_caches:
            self._digest(SAVE, self._bound.digest_saves)
            self._digest(LOAD, self._bound.digest_loads)

    def _fail_saves(self) -> None:
        if self._bound is not None:
            self._failed_saves.update(self._bound.new_requests)

    def _digest(self, direction: str, requests: dict[str, tuple[int, list[int]]]) -> None:
        for request_id, (first, blocks) in requests.items():
            try:
                digests = block_digests(self._kv_caches, blocks, self.num_blocks)
            except Exception as error:  # a KV layout kv_blocks does not know
                self._contain("block_digest", error)
                return
            self._digests += [
                BlockDigest(request_id, direction, first + i, self._worker_rank, d)
                for i, d in enumerate(digests)
            ]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.inner is None:
            return None, None
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.inner is None:
            return KVConnectorTransferResults()
        results = self.inner.get_transfer_results(finished_req_ids)
        if self._release:
            # Async loads the inner never heard of (it raised while planning them):
            # every worker reports them received and failed, so vLLM lets them go.
            results.finished_recving |= self._release
            results.failed_recving |= self._release
            self._release = set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.inner is None:
            return set()
        errors = self.inner.get_block_ids_with_load_errors()
        if self._load_errors:
            errors = set(errors) | self._load_errors
            self._load_errors = set()
        return errors

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.inner.get_kv_connector_kv_cache_events() if self.inner is not None else None

    def get_handshake_metadata(self) -> Any:
        return self.inner.get_handshake_metadata() if self.inner is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self.inner.build_connector_worker_meta() if self.inner is not None else None
        if inner is None and not self._digests and not self._failed_saves:
            return None
        meta = KvbusWorkerMetadata(inner, self._digests, self._failed_saves)
        self._digests, self._failed_saves = [], set()
        return meta

    # --- both sides ----------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker side: the inner's stats of the step. Scheduler side: the inner's,
        plus the transfers that ended since the last call (for vLLM's metrics)."""
        if self.inner is None:
            return None  # a pass-through has no transfers
        inner_stats = None
        try:
            inner_stats = self.inner.get_kv_connector_stats()
        except Exception as error:
            self._contain("get_kv_connector_stats", error)
            self._lost = self._lost or "inner_error"
        if self._role == KVConnectorRole.SCHEDULER and inner_stats is not None:
            self._scheduler_stats = self._encode_stats(inner_stats)
            if self._unencodable:
                inner_stats = None  # vLLM would fail to send it to its front end
        transfers, self._outcomes = self._outcomes, []
        if inner_stats is None and not transfers:
            return None
        return KvbusConnectorStats(
            inner=inner_stats, connector=self.inner_name, transfers=transfers
        )

    def shutdown(self) -> None:
        try:
            if self.inner is not None:
                self.inner.shutdown()  # type: ignore[no-untyped-call]
        finally:
            if self._publisher is not None:
                self._publisher.close()

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache() if self.inner is not None else None

    # vLLM 0.33: sleep mode around the KV caches.
    def unregister_kv_caches(self) -> None:
        if self.inner is not None and hasattr(self.inner, "unregister_kv_caches"):
            self.inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self.inner is not None and hasattr(self.inner, "restore_kv_caches"):
            self.inner.restore_kv_caches()

    # --- scheduler side ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        if self.inner is not None:
            self.inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.inner is not None:
            self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        if self.inner is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.inner is None:
            return 0, False
        self.tracker.looked_up(request.request_id, num_computed_tokens)
        try:
            tokens, is_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as error:
            self._contain("get_num_new_matched_tokens", error)
            self.tracker.failed(request.request_id, LOAD, "inner_error")
            return 0, False
        self._matched_async.pop(request.request_id, None)  # the last lookup decides
        if is_async:
            self._matched_async[request.request_id] = True
            while len(self._matched_async) > MAX_TRACKED:  # looked up, never allocated
                del self._matched_async[next(iter(self._matched_async))]
        return tokens, is_async

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        if self.inner is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.inner is None:
            return
        request_id = request.request_id
        is_async = self._matched_async.pop(request_id, False)
        loaded: list[int] = []
        if num_external_tokens > 0:
            all_blocks = blocks.get_block_ids()[0]
            first = self.tracker.local_tokens(request_id) // self.block_size
            count = -(-num_external_tokens // self.block_size)
            loaded = list(all_blocks[first : first + count])
            if not is_async and self._sampled(request):  # async data lands later
                self._digest_loads[request_id] = (first, loaded)
        try:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as error:
            if loaded and not self._can_fail_loads:
                raise
            self._contain("update_state_after_alloc", error)
            if loaded:
                self.tracker.failed(request_id, LOAD, "inner_error")
                self._invalid_loads += loaded
                self._digest_loads.pop(request_id, None)
                if is_async:
                    self._released.append(request_id)
            return
        if loaded:
            self.tracker.load_planned(request_id, num_external_tokens, loaded, is_async)
            (self._step_async if is_async else self._step_loads)[request_id] = loaded

    def _sampled(self, request: Any) -> bool:
        """Whether to digest this request's blocks: by its first block's tokens, so a
        prompt saved and later loaded is sampled (or not) both times."""
        if self.verify_sample <= 0.0:
            return False
        if self.verify_sample >= 1.0:
            return True
        head = bytes(str(list(request.prompt_token_ids or ())[: self.block_size]), "ascii")
        return zlib.crc32(head) / 2**32 < self.verify_sample

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.inner is None:
            return _PASS_THROUGH_META
        inner_meta: KVConnectorMetadata | None
        try:
            inner_meta = self.inner.build_connector_meta(scheduler_output)
        except Exception as error:
            # The inner's step state is gone: none of the loads planned since will run.
            if (self._step_loads or self._step_async) and not self._can_fail_loads:
                raise
            self._contain("build_connector_meta", error)
            inner_meta = None
            for request_id, blocks in {**self._step_loads, **self._step_async}.items():
                self.tracker.failed(request_id, LOAD, "inner_error")
                self._invalid_loads += blocks
            self._released += self._step_async
            self._step_loads = {}
        self.tracker.step_scheduled()
        new = scheduler_output.scheduled_new_reqs
        meta = KvbusMetadata(
            inner_meta,
            new_requests=tuple(r.req_id for r in new),
            invalid_loads=tuple(self._invalid_loads),
            released_loads=tuple(self._released),
            loads=self._step_loads,
        )
        self._invalid_loads, self._released, self._step_loads, self._step_async = [], [], {}, {}
        if self.verify_sample > 0.0 and self._kv_transfer_config.is_kv_producer:
            self._plan_save_digests(scheduler_output, meta)
        if self._digest_loads:
            meta.digest_loads, self._digest_loads = self._digest_loads, {}
        return meta

    def _plan_save_digests(self, scheduler_output: SchedulerOutput, meta: KvbusMetadata) -> None:
        """Digest the full prompt blocks a new request computes in this step (prompts
        prefilled in one step; a chunked prefill is not digested)."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            if not self._sampled(new):
                continue
            full = len(prompt) // self.block_size
            first = new.num_computed_tokens // self.block_size
            if new.num_computed_tokens + scheduled.get(new.req_id, 0) < full * self.block_size:
                continue
            if new.req_id in meta.loads or first >= full:
                continue
            meta.digest_saves[new.req_id] = (first, list(new.block_ids[0][first:full]))

    def on_new_request(self, request: Any) -> None:
        if self.inner is not None:
            self.inner.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.inner is None:
            return
        stats, meta = connector_output.kv_connector_stats, connector_output.kv_connector_worker_meta
        inner_meta = meta.inner if isinstance(meta, KvbusWorkerMetadata) else meta
        inner_stats = stats.inner if isinstance(stats, KvbusConnectorStats) else stats
        # The inner sees its own objects, as MultiConnector gives its children theirs.
        connector_output.kv_connector_stats = inner_stats
        connector_output.kv_connector_worker_meta = inner_meta
        try:
            self.inner.update_connector_output(connector_output)
        except Exception as error:
            self._contain("update_connector_output", error)
        finally:
            connector_output.kv_connector_stats = stats
            connector_output.kv_connector_worker_meta = meta
        if inner_stats is not None:
            # Serialized now: vLLM aggregates into this object later in the step.
            self._worker_stats = self._encode_stats(inner_stats)
            if self._unencodable and isinstance(stats, KvbusConnectorStats):
                stats.inner = None  # vLLM would fail to send it to its front end
        failed_saves: Iterable[str] = ()
        if isinstance(meta, KvbusWorkerMetadata):
            self._digests += meta.digests
            failed_saves = meta.failed_saves
        self.tracker.workers_reported(
            connector_output.finished_recving or (),
            connector_output.finished_sending or (),
            connector_output.failed_recving or (),
            connector_output.invalid_block_ids or (),
            failed_saves,
        )

    def _encode_stats(self, stats: KVConnectorStats) -> bytes | None:
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

    def request_finished(self, request: Any, block_ids: list[int]) -> _Finished:
        return self._finished(
            request, block_ids, lambda inner: inner.request_finished(request, block_ids)
        )

    def _finished(
        self, request: Any, first_group: list[int], call: Callable[[Any], _Finished]
    ) -> _Finished:
        """``call(inner)`` asks the inner, then the tracker notes the outcome."""
        if self.inner is None:
            return False, None
        try:
            delay_free, params = call(self.inner)
        except Exception as error:
            self._contain("request_finished", error)
            self.tracker.failed(request.request_id, SAVE, "inner_error")
            return False, None
        encoded = b""
        if params:
            try:
                encoded = _encoder.encode(params)
            except Exception:  # params only vLLM's front end reads; the record goes without
                encoded = b""
        self.tracker.request_finished(
            request.request_id,
            request.num_prompt_tokens,
            first_group,
            bool(delay_free),
            encoded,
            computed_tokens=getattr(request, "num_computed_tokens", None),
        )
        return delay_free, params

    def register_finished_partial_tail(
        self, request: Any, block_ids: tuple[list[int], ...], partial_tail_offloads: Any
    ) -> bool:
        if self.inner is None:
            return False
        return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[Any]:
        """The inner's KV events, forwarded into the engine's batch; and, once per
        step (vLLM calls this once per step output), this step's record to the bus."""
        if self.inner is None:
            return ()
        events: Iterable[Any] = ()
        try:
            events = list(self.inner.take_events())
        except Exception as error:
            self._contain("take_events", error)
        self.tracker.step_done()
        self._publish_step()
        return events

    def _publish_step(self) -> None:
        transfers = self.tracker.take()
        ended = outcomes(transfers)
        if ended:
            room = max(0, MAX_OUTCOMES - len(self._outcomes))
            self._outcomes += ended[:room]
        stats = None
        if self._worker_stats or self._scheduler_stats or self._lost:
            stats = ConnectorStats(
                connector=self.inner_name,
                workers=self._worker_stats or b"",
                scheduler=self._scheduler_stats or b"",
                lost=self._lost,
            )
            self._worker_stats = self._scheduler_stats = None
            self._lost = ""
        if not transfers and stats is None and not self._digests:
            return
        batch = ConnectorBatch(time.time(), self.tracker.step, transfers, stats, self._digests)
        self._digests = []
        try:
            publisher = self._ensure_publisher()
            if publisher is not None:
                publisher.publish(batch, Kind.CONNECTOR)
        except Exception as error:  # a URL no transport takes: the engine goes on
            self._contain("publish", error)
            self._url, self._publishing = None, False

    def _ensure_publisher(self) -> kvbus.Publisher | None:
        """Opened on the first record (a pass-through never opens one)."""
        if self._publisher is None:
            if not self._publishing or not (self._url or os.environ.get("KVBUS_URL")):
                return None
            with self._publisher_lock:
                if self._publisher is None:
                    self._publisher = kvbus.Publisher(
                        self._url,
                        stream=self._stream,
                        source=engine_source(self._rank),
                        data_parallel_rank=self._rank,
                    )
                    report_bus_metrics()
        return self._publisher

    @property
    def publisher(self) -> kvbus.Publisher | None:
        return self._publisher

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees() if self.inner is not None else False

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work() if self.inner is not None else False

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count() if self.inner is not None else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.inner is not None:
            self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        if self.inner is not None:
            self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    # --- class methods: resolved through the inner's class -------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        child = inner_config(vllm_config)
        if child is None or child.kv_transfer_config is None:
            return None
        return class_of(child.kv_transfer_config).get_required_kvcache_layout(child)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = (extra_config or {}).get("inner")
        if not isinstance(inner, dict) or not inner.get("kv_connector"):
            return False
        config = KVTransferConfig(**{"kv_role": "kv_both", **inner})
        return class_of(config).requires_piecewise_for_cudagraph(
            dict(config.kv_connector_extra_config)
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.33: sleep mode is possible when the inner allows it."""
        inner = kv_transfer_config.kv_connector_extra_config.get("inner")
        if not isinstance(inner, dict) or not inner.get("kv_connector"):
            return True
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
        if self.inner is not None and not isinstance(self.inner, SupportsHMA):
            raise ValueError(
                f"KvbusHMAConnector: the inner {self.inner_name} does not support the "
                "hybrid memory allocator; use KvbusConnector"
            )

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> _Finished:
        first = block_ids[0] if block_ids else []
        return self._finished(
            request, first, lambda inner: inner.request_finished_all_groups(request, block_ids)
        )
