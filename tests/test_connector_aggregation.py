"""The scheduler-side KvbusConnector fed by vLLM's own KVOutputAggregator with the
outputs of two workers (tensor parallel 2): a transfer is finished only when every
worker reported it, failed when one worker failed it, and the workers' stats are
summed into one record. The inner is a test connector whose loads and saves are
asynchronous (tests/kv_inner.py: AsyncConnector); no engine runs."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvbus import Kind, Message
from kvbus.wire.events import ConnectorBatch, TransferEvent, decode_raw

from .conftest import collect

URL = "memory://connector-aggregation"
ASYNC_INNER = {"kv_connector": "AsyncConnector", "kv_connector_module_path": "tests.kv_inner"}


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("KVBUS_SOURCE", "tp2-engine")
    from kvbus.connectors.vllm_connector import KvbusConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    scheduler = KvbusConnector(config(ASYNC_INNER), KVConnectorRole.SCHEDULER, None)
    yield scheduler
    scheduler.shutdown()


def request(request_id: str, prompt_tokens: int = 64) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        num_prompt_tokens=prompt_tokens,
        prompt_token_ids=list(range(prompt_tokens)),
        num_computed_tokens=0,
    )


def blocks(*ids: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: ([*ids],))


def worker_output(stats: dict[str, int] | None = None, **sets: Any) -> Any:
    from kvbus.connectors.vllm_connector import KvbusConnectorStats
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    from tests.kv_inner import CountingStats

    output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    output.kv_connector_output = KVConnectorOutput(
        finished_sending=sets.get("sending"),
        finished_recving=sets.get("recving"),
        failed_recving=sets.get("failed", set()),
        invalid_block_ids=sets.get("invalid", set()),
        kv_connector_stats=KvbusConnectorStats(
            inner=CountingStats(dict(stats)), connector="tests.kv_inner:AsyncConnector"
        )
        if stats
        else None,
    )
    return output


class Engine:
    """Drives the connector the way vLLM's scheduler does, one step at a time, with
    vLLM's KVOutputAggregator between two workers and it."""

    def __init__(self, connector: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.connector = connector
        self.aggregator = KVOutputAggregator(expected_finished_count=2)

    def step(self, rank0: Any, rank1: Any) -> None:
        self.connector.build_connector_meta(
            SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})
        )
        output = self.aggregator.aggregate([rank0, rank1]).kv_connector_output
        if output and not output.is_empty():
            self.connector.update_connector_output(output)
        self.connector.get_kv_connector_stats()
        self.connector.take_events()


async def records(connector: Any) -> list[ConnectorBatch]:
    assert await connector.publisher.aflush()
    items, _ = await collect(URL, stream="connector")
    return [i.body for i in items if isinstance(i, Message) and i.kind == Kind.CONNECTOR]


def ended(batches: list[ConnectorBatch]) -> dict[str, TransferEvent]:
    return {
        f"{t.direction}:{t.request_id}": t
        for b in batches
        for t in b.transfers
        if t.phase in ("finished", "failed")
    }


def plan_load(connector: Any, request_id: str, tokens: int, *block_ids: int) -> None:
    from tests.kv_inner import AsyncConnector

    AsyncConnector.matches[request_id] = tokens
    req = request(request_id)
    assert connector.get_num_new_matched_tokens(req, 0) == (tokens, True)
    connector.update_state_after_alloc(req, blocks(*block_ids), tokens)


async def test_a_transfer_is_finished_when_every_worker_reported_it(connector: Any) -> None:
    from tests.kv_inner import AsyncConnector

    engine = Engine(connector)
    plan_load(connector, "r1", 32, 5, 6)
    AsyncConnector.saves.add("s1")
    assert connector.request_finished(request("s1"), [1, 2, 3]) == (
        True,
        {"remote_host": "decode-1"},
    )
    engine.step(worker_output(recving={"r1"}, sending={"s1"}), worker_output())
    assert ended(await records(connector)) == {}  # one worker of two: not yet
    engine.step(worker_output(), worker_output(recving={"r1"}))
    done = ended(await records(connector))
    assert set(done) == {"load:r1"}
    assert (done["load:r1"].phase, done["load:r1"].tokens, done["load:r1"].blocks) == (
        "finished",
        32,
        2,
    )
    assert done["load:r1"].is_async and done["load:r1"].steps == 2
    engine.step(worker_output(), worker_output(sending={"s1"}))
    done = ended(await records(connector))
    assert (done["save:s1"].phase, done["save:s1"].blocks) == ("finished", 3)
    pending = [t for b in await records(connector) for t in b.transfers if t.phase == "pending"]
    assert [(t.request_id, decode_raw(t.params)) for t in pending] == [
        ("s1", {"remote_host": "decode-1"})
    ]


async def test_a_failure_on_one_worker_fails_the_transfer(connector: Any) -> None:
    engine = Engine(connector)
    plan_load(connector, "r2", 32, 7, 8)
    plan_load(connector, "r3", 16, 9)
    # Rank 1 fails r2 (vLLM reports a failed receive as received, to release it) and
    # cannot load block 9 of r3; rank 0 does both fine.
    engine.step(
        worker_output(recving={"r2", "r3"}),
        worker_output(recving={"r2", "r3"}, failed={"r2"}, invalid={9}),
    )
    done = ended(await records(connector))
    assert (done["load:r2"].phase, done["load:r2"].reason) == ("failed", "failed_recving")
    assert (done["load:r3"].phase, done["load:r3"].reason) == ("failed", "invalid_blocks")
    assert done["load:r3"].invalid_blocks == 1


async def test_the_workers_stats_are_summed_into_one_record_per_step(connector: Any) -> None:
    engine = Engine(connector)
    engine.step(worker_output({"loaded_blocks": 2}), worker_output({"loaded_blocks": 3}))
    engine.step(worker_output({"loaded_blocks": 1}), worker_output())
    stats = [b.stats for b in await records(connector) if b.stats is not None]
    assert [decode_raw(s.workers) for s in stats] == [{"loaded_blocks": 5}, {"loaded_blocks": 1}]
    assert {s.connector for s in stats} == {"tests.kv_inner:AsyncConnector"}


def config(inner: dict[str, Any] | None, name: str = "KvbusConnector") -> Any:
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    extra: dict[str, Any] = {"url": URL}
    if inner is not None:
        extra["inner"] = inner
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path="kvbus.connectors.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        cache_config=CacheConfig(block_size=16),
    )


async def test_an_async_load_the_inner_failed_to_plan_is_released_by_every_worker(
    connector: Any,
) -> None:
    """The lookup said asynchronous, so vLLM waits for the load to be received; the
    inner raised while planning it and will never report it: each worker reports it
    received and failed, and vLLM's aggregator lets it go (and recomputes its blocks)."""
    from kvbus.connectors.vllm_connector import KvbusConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.kv_inner import AsyncConnector

    AsyncConnector.broken.add("r9")
    plan_load(connector, "r9", 32, 11, 12)
    meta = connector.build_connector_meta(
        SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})
    )
    assert meta.released_loads == ("r9",) and set(meta.invalid_loads) == {11, 12}
    assert connector.errors == {"update_state_after_alloc": 1}
    outputs = []
    for _rank in range(2):
        worker = KvbusConnector(config(ASYNC_INNER), KVConnectorRole.WORKER, None)
        worker.bind_connector_metadata(meta)
        results = worker.get_transfer_results(set())
        assert (results.finished_recving, results.failed_recving) == ({"r9"}, {"r9"})
        assert worker.get_block_ids_with_load_errors() == {11, 12}
        outputs.append(
            worker_output(recving=results.finished_recving, failed=results.failed_recving)
        )
        worker.clear_connector_metadata()
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output
    assert merged.finished_recving == {"r9"} and merged.failed_recving == {"r9"}
    done = ended(await records(connector)) if connector.publisher else {}
    engine = Engine(connector)
    engine.step(worker_output(), worker_output())
    done = ended(await records(connector))
    assert (done["load:r9"].phase, done["load:r9"].reason) == ("failed", "inner_error")


def test_the_hma_variant_refuses_an_inner_without_hma() -> None:
    from kvbus.connectors.vllm_connector import KvbusHMAConnector
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    hma = config(None, "KvbusHMAConnector")
    assert hma.kv_transfer_config is not None
    assert KVConnectorFactory.supports_hma_config(hma.kv_transfer_config)
    inner = {"kv_connector": "ExampleConnector"}
    with pytest.raises(ValueError, match="does not support the hybrid memory allocator"):
        KvbusHMAConnector(config(inner, "KvbusHMAConnector"), KVConnectorRole.SCHEDULER, None)
