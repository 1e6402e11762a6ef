"""`SchedulerSide`: the scheduler-role hooks of `KvbusConnector` that do more than forward.

Each hook asks the inner, then tells the `TransferTracker` what it reported: a lookup,
a load planned on allocated blocks, the step scheduled, the workers' aggregated output,
a request finished (a save pending or done). A fault of the inner while planning fails
that request's load (its blocks are reported invalid, asynchronous ones released)
instead of the step. Once per step the records go to `StepRecords`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from kvbus.connectors.vllm_connector_parts import (
    Faults,
    KvbusConnectorStats,
    KvbusMetadata,
    KvbusWorkerMetadata,
)
from kvbus.connectors.vllm_connector_records import StepRecords
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from kvbus.routing.transfers import LOAD, MAX_TRACKED, SAVE, TransferTracker

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

Finished = tuple[bool, "dict[str, Any] | None"]
_encoder = msgspec.msgpack.Encoder()


class SchedulerSide:
    def __init__(
        self,
        inner: KVConnectorBase_V1,
        faults: Faults,
        records: StepRecords,
        tracker: TransferTracker,
        can_fail_loads: bool,
        verify_sample: float,
        digests_saves: bool,
    ) -> None:
        self.inner = inner
        self.faults = faults
        self.records = records
        self.tracker = tracker
        self.block_size = tracker.block_size
        self.can_fail_loads = can_fail_loads
        """False where vLLM refuses invalid-block reports: a load fault is raised."""
        self.verify_sample = verify_sample
        self.digests_saves = digests_saves
        """Whether to digest saved blocks: verifying, in a producer role."""
        self._matched_async: dict[str, bool] = {}
        self._invalid_loads: list[int] = []
        self._released: list[str] = []
        self._step_async: dict[str, list[int]] = {}
        self._step_loads: dict[str, list[int]] = {}
        self._digest_loads: dict[str, tuple[int, list[int]]] = {}

    # --- planning a request's load -----------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.tracker.looked_up(request.request_id, num_computed_tokens)
        try:
            tokens, is_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as error:
            self.faults.contain("get_num_new_matched_tokens", error)
            self.tracker.failed(request.request_id, LOAD, "inner_error")
            return 0, False
        self._matched_async.pop(request.request_id, None)  # the last lookup decides
        if is_async:
            self._matched_async[request.request_id] = True
            while len(self._matched_async) > MAX_TRACKED:  # looked up, never allocated
                del self._matched_async[next(iter(self._matched_async))]
        return tokens, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
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
            if loaded and not self.can_fail_loads:
                raise
            self.faults.contain("update_state_after_alloc", error)
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

    # --- the step ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        inner_meta: KVConnectorMetadata | None
        try:
            inner_meta = self.inner.build_connector_meta(scheduler_output)
        except Exception as error:
            # The inner's step state is gone: none of the loads planned since will run.
            if (self._step_loads or self._step_async) and not self.can_fail_loads:
                raise
            self.faults.contain("build_connector_meta", error)
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
        if self.digests_saves:
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

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stats, meta = connector_output.kv_connector_stats, connector_output.kv_connector_worker_meta
        inner_meta = meta.inner if isinstance(meta, KvbusWorkerMetadata) else meta
        inner_stats = stats.inner if isinstance(stats, KvbusConnectorStats) else stats
        # The inner sees its own objects, as MultiConnector gives its children theirs.
        connector_output.kv_connector_stats = inner_stats
        connector_output.kv_connector_worker_meta = inner_meta
        try:
            self.inner.update_connector_output(connector_output)
        except Exception as error:
            self.faults.contain("update_connector_output", error)
        finally:
            connector_output.kv_connector_stats = stats
            connector_output.kv_connector_worker_meta = meta
        if inner_stats is not None:
            if not self.records.workers_stats(inner_stats) and isinstance(
                stats, KvbusConnectorStats
            ):
                stats.inner = None  # vLLM would fail to send it to its front end
        failed_saves: Iterable[str] = ()
        if isinstance(meta, KvbusWorkerMetadata):
            self.records.digests += meta.digests
            failed_saves = meta.failed_saves
        self.tracker.workers_reported(
            connector_output.finished_recving or (),
            connector_output.finished_sending or (),
            connector_output.failed_recving or (),
            connector_output.invalid_block_ids or (),
            failed_saves,
        )

    def take_events(self) -> Iterable[Any]:
        events: Iterable[Any] = ()
        try:
            events = list(self.inner.take_events())
        except Exception as error:
            self.faults.contain("take_events", error)
        self.tracker.step_done()
        self.records.publish_step(self.tracker.step, self.tracker.take())
        return events

    # --- a request finished ------------------------------------------------------------

    def finished(
        self, request: Any, first_group: list[int], call: Callable[[], Finished]
    ) -> Finished:
        """``call()`` asks the inner, then the tracker notes the outcome."""
        try:
            delay_free, params = call()
        except Exception as error:
            self.faults.contain("request_finished", error)
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
