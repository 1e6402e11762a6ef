"""`WorkerSide`: the worker-role hooks of `KvbusConnector` that do more than forward.

Each step it binds the inner's part of the scheduler's `KvbusMetadata`, runs the
inner's loads and saves with their faults contained (a failed load's blocks are
reported invalid, a failed save blames the step's new requests), digests the KV blocks
the scheduler asked for, and reports all of it back in `KvbusWorkerMetadata`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbus.connectors.kv_blocks import block_digests
from kvbus.connectors.vllm_connector_parts import Faults, KvbusMetadata, KvbusWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kvbus.routing.transfers import LOAD, SAVE
from kvbus.wire.events import BlockDigest

if TYPE_CHECKING:
    import torch


class WorkerSide:
    def __init__(
        self, inner: KVConnectorBase_V1, faults: Faults, num_blocks: int, can_fail_loads: bool
    ) -> None:
        self.inner = inner
        self.faults = faults
        self.num_blocks = num_blocks
        self.can_fail_loads = can_fail_loads
        """False where vLLM refuses invalid-block reports: a load fault is raised."""
        self.bound: KvbusMetadata | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._worker_rank = 0
        self._load_errors: set[int] = set()
        self._release: set[str] = set()
        self._failed_saves: set[str] = set()
        self._digests: list[BlockDigest] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self._kv_caches = kv_caches
        try:
            self._worker_rank = get_world_group().rank
        except (AssertionError, AttributeError):  # no process group (a unit test)
            self._worker_rank = 0
        self.inner.register_kv_caches(kv_caches)

    # --- the step's metadata -----------------------------------------------------------

    def bind(self, meta: KVConnectorMetadata) -> None:
        assert isinstance(meta, KvbusMetadata)
        self.bound = meta
        self._load_errors.update(meta.invalid_loads)
        self._release.update(meta.released_loads)
        if meta.inner is not None:
            self.inner.bind_connector_metadata(meta.inner)

    def clear(self) -> None:
        if self.bound is not None:
            self.inner.clear_connector_metadata()
        self.bound = None

    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:
        if isinstance(meta, KvbusMetadata) and meta.inner is not None:
            self.inner.handle_preemptions(meta.inner)

    def _running_inner(self) -> KVConnectorBase_V1 | None:
        """The inner, if this step's metadata reached it (not when building it failed)."""
        bound = self.bound
        return self.inner if bound is not None and bound.inner is not None else None

    # --- loads -------------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
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
        if not self.can_fail_loads:
            raise error
        self.faults.contain(method, error)
        self._fail_loads()

    def _fail_loads(self) -> None:
        if self.bound is not None:
            for blocks in self.bound.loads.values():
                self._load_errors.update(blocks)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self.inner.get_transfer_results(finished_req_ids)
        if self._release:
            # Async loads the inner never heard of (it raised while planning them):
            # every worker reports them received and failed, so vLLM lets them go.
            results.finished_recving |= self._release
            results.failed_recving |= self._release
            self._release = set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.inner.get_block_ids_with_load_errors()
        if self._load_errors:
            errors = set(errors) | self._load_errors
            self._load_errors = set()
        return errors

    # --- saves -------------------------------------------------------------------------

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        inner = self._running_inner()
        if inner is None:
            return
        try:
            inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        except Exception as error:
            self.faults.contain("save_kv_layer", error)
            self._fail_saves()

    def wait_for_save(self) -> None:
        inner = self._running_inner()
        if inner is not None:
            try:
                inner.wait_for_save()  # type: ignore[no-untyped-call]
            except Exception as error:
                self.faults.contain("wait_for_save", error)
                self._fail_saves()
        if self.bound is not None and self._kv_caches:
            self._digest(SAVE, self.bound.digest_saves)
            self._digest(LOAD, self.bound.digest_loads)

    def _fail_saves(self) -> None:
        if self.bound is not None:
            self._failed_saves.update(self.bound.new_requests)

    # --- what goes back to the scheduler -----------------------------------------------

    def _digest(self, direction: str, requests: dict[str, tuple[int, list[int]]]) -> None:
        for request_id, (first, blocks) in requests.items():
            try:
                digests = block_digests(self._kv_caches, blocks, self.num_blocks)
            except Exception as error:  # a KV layout kv_blocks does not know
                self.faults.contain("block_digest", error)
                return
            self._digests += [
                BlockDigest(request_id, direction, first + i, self._worker_rank, d)
                for i, d in enumerate(digests)
            ]

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self.inner.build_connector_worker_meta()
        if inner is None and not self._digests and not self._failed_saves:
            return None
        meta = KvbusWorkerMetadata(inner, self._digests, self._failed_saves)
        self._digests, self._failed_saves = [], set()
        return meta
