"""A real KV connector for tests: vLLM's ExampleConnector (KV to safetensors files) plus
what it lacks to exercise kvbus's wrapper: stats handed over each step (the way vLLM's
offloading connector does), KV events from the worker for each block it stores (the
way LMCache does, medium STORAGE), and faults switched on by the test.

Loaded by vLLM through ``kv_connector_module_path: "tests.kv_inner"``.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.kv_events import (
    BlockStored,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class CountingStats(KVConnectorStats):
    """Sums: blocks and tokens saved and loaded, seconds spent."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class StoredEvents(KVConnectorKVEvents):
    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[Any]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> StoredEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


class Unencodable:
    """A stats value msgpack cannot encode."""


class RecordingConnector(ExampleConnector):
    totals: ClassVar[dict[str, float]] = {}
    """Everything the worker side counted since the test began (never reset)."""
    fail: ClassVar[set[str]] = set()
    """Methods that raise once, then are removed (set by the test)."""
    poison_stats: ClassVar[str] = ""
    """"unencodable" or "oversized": the next stats object handed over is bad."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._stats = CountingStats()
        self._events: list[Any] = []
        self._pending_events: list[Any] = []

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            self.fail.discard(method)
            raise RuntimeError(f"test fault in {method}")

    def _count(self, key: str, value: float) -> None:
        self._stats.data[key] = self._stats.data.get(key, 0) + value
        RecordingConnector.totals[key] = RecordingConnector.totals.get(key, 0) + value

    # worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._maybe_fail("start_load_kv")
        began = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        loads = [r for r in meta.requests if not r.is_store]
        if loads:
            self._count("load_seconds", time.perf_counter() - began)
            self._count("loaded_tokens", sum(len(r.token_ids) for r in loads))
            self._count("loaded_blocks", sum(len(r.token_ids) // self._block_size for r in loads))

    def wait_for_save(self) -> None:
        self._maybe_fail("wait_for_save")
        super().wait_for_save()
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        for request in meta.requests:
            if not request.is_store:
                continue
            tokens = request.token_ids.tolist()
            blocks = len(tokens) // self._block_size
            self._count("saved_tokens", blocks * self._block_size)
            self._count("saved_blocks", blocks)
            # hash() of ints only: the same in every worker process (str hashes are not).
            hashes = [hash(tuple(tokens[: (i + 1) * self._block_size])) for i in range(blocks)]
            self._events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=tokens[: blocks * self._block_size],
                    block_size=self._block_size,
                    lora_id=None,
                    medium="STORAGE",
                    lora_name=None,
                )
            )

    def get_kv_connector_kv_cache_events(self) -> StoredEvents | None:
        if not self._events:
            return None
        events = StoredEvents(1)
        events.add_events(self._events)
        self._events = []
        return events

    # both sides: handed over, then replaced (never reset once given away)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role != KVConnectorRole.WORKER:
            return None
        if RecordingConnector.poison_stats == "unencodable":
            RecordingConnector.poison_stats = ""
            return CountingStats({"bad": Unencodable()})  # type: ignore[dict-item]
        if RecordingConnector.poison_stats == "oversized":
            RecordingConnector.poison_stats = ""
            return CountingStats({f"k{i}": i for i in range(100_000)})
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, CountingStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return CountingStats(data=dict(data or {}))

    # scheduler side: the workers' events, common to all of them, in the engine's batch

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self._maybe_fail("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        if connector_output.kv_cache_events is not None:
            self._pending_events += connector_output.kv_cache_events.aggregate().get_all_events()

    def take_events(self) -> Any:
        events, self._pending_events = self._pending_events, []
        return events


class AsyncConnector(ExampleConnector):
    """For a unit test of the scheduler path without workers: loads and saves that
    run asynchronously (the way NIXL or the offloading connector report them), as
    the test plans them in ``matches`` and ``saves``."""

    matches: ClassVar[dict[str, int]] = {}
    saves: ClassVar[set[str]] = set()
    broken: ClassVar[set[str]] = set()
    """Requests whose allocation the inner fails on (it raises)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        tokens = self.matches.get(request.request_id, 0)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if request.request_id in self.broken:
            raise RuntimeError("test fault in update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        return ExampleConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        if request.request_id in self.saves:
            return True, {"remote_host": "decode-1"}
        return False, None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return CountingStats(data=dict(data or {}))


class HandoffConnector(ExampleConnector):
    """Prefill/decode through shared storage, handed over by the request's parameters
    as NIXL's is: a prefill request (``do_remote_decode``) stores its prompt's KV and
    answers ``kv_transfer_params`` naming it; an engine loads KV only for a request that
    carries those parameters back. A proxy that drops them gets the prompt computed
    again (``cached_tokens`` 0), and no engine ever loads what it was not handed."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        params = request.kv_transfer_params or {}
        if params.get("kvbus_handoff") != len(request.prompt_token_ids or ()):
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            return False, {"kvbus_handoff": len(request.prompt_token_ids or ())}
        return False, None


class TwoRankConnector(RecordingConnector):
    """RecordingConnector whose saves finish asynchronously, as each worker reports
    them (``get_finished``), for an engine with tensor parallel 2. Files in the storage
    directory steer the workers from the test (they run in processes of their own):
    ``hold-rank1`` makes rank 1 hold its reports back until the file is gone, and
    ``fail-rank1-load`` makes rank 1's next load raise (the file is then removed)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._saving: set[str] = set()  # scheduler: requests whose prompt is being stored
        self._saved: set[str] = set()  # worker: stored, not yet reported
        self._held: set[str] = set()

    def _flag(self, name: str) -> str:
        return os.path.join(self._storage_path, name)

    def _rank(self) -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    # scheduler side

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        stored = [
            new.req_id
            for new in scheduler_output.scheduled_new_reqs
            if new.req_id not in self._requests_need_load
            and not self._found_match_for_prompt(list(new.prompt_token_ids or []), [])
        ]
        meta = super().build_connector_meta(scheduler_output)
        self._saving.update(stored)
        meta.stored_ids = stored  # type: ignore[attr-defined]
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, None  # the workers report when their save is done
        return False, None

    # worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loading = any(not r.is_store for r in getattr(meta, "requests", ()))
        if loading and self._rank() == 1 and os.path.exists(self._flag("fail-rank1-load")):
            os.remove(self._flag("fail-rank1-load"))
            raise RuntimeError("test fault: rank 1 cannot load")
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        self._saved.update(getattr(self._get_connector_metadata(), "stored_ids", ()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        done = self._saved & finished_req_ids
        self._saved -= done
        if self._rank() == 1 and os.path.exists(self._flag("hold-rank1")):
            self._held |= done
            return None, None
        done |= self._held
        self._held = set()
        return done or None, None


# --- for the tests that run engines with these connectors ---------------------------


def wrapped(inner: str, storage: Any) -> Any:
    """A KvbusConnector config wrapping ``inner`` (a class of this module) that keeps
    KV in ``storage``, with digests on and failed loads recomputed."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvbusConnector",
        kv_connector_module_path="kvbus.connectors.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "inner": {
                "kv_connector": inner,
                "kv_connector_module_path": "tests.kv_inner",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)},
            },
            "verify_transfers": True,
        },
    )


def generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy output tokens (4 each) of token prompts."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def prompt(seed: int, length: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]
