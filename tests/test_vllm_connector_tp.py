"""KvbusConnector in a real vLLM engine with tensor parallel 2 on the CPU: two worker
processes, vLLM's KVOutputAggregator between them and the scheduler, the records on a
real NATS server. The inner (tests/kv_inner.py: TwoRankConnector) stores KV in files
and reports each save asynchronously per worker; files in its directory steer rank 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import engine_options, make_model

import kvbus
from kvbus import Message
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import ConnectorBatch, TransferEvent, decode_raw
from tests.kv_inner import generate, prompt, wrapped

from .conftest import scoped_env
from .servers import NatsServer

SOURCE = "tp2-engine/dp0"
BLOCK = 32


@pytest.fixture(scope="module")
def engine(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Path]]:
    model = tmp_path_factory.mktemp("model")
    make_model(model)
    storage = tmp_path_factory.mktemp("kv-store")
    env = {
        "KVBUS_URL": nats_server.url,
        "KVBUS_SOURCE": "tp2-engine",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per worker (one NUMA node here)
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    from vllm import LLM
    from vllm.config import KVEventsConfig

    options = engine_options(model, KVEventsConfig(enable_kv_cache_events=True), 256)
    options.update(enable_prefix_caching=False, tensor_parallel_size=2)
    with scoped_env(env):
        llm = LLM(**options, kv_transfer_config=wrapped("TwoRankConnector", storage))
        yield llm, storage
        llm.llm_engine.engine_core.shutdown()


async def stream(url: str, name: str) -> list[Message]:
    """Everything on ``name`` so far (the engine's publisher sends within milliseconds:
    read until two reads agree)."""
    import asyncio

    seen = -1
    while True:
        sub = kvbus.subscribe(name, url, follow=False)
        items = [i async for i in sub if isinstance(i, Message) and i.source == SOURCE]
        await sub.aclose()
        if len(items) == seen:
            return items
        seen = len(items)
        await asyncio.sleep(0.3)


async def transfers(url: str) -> list[TransferEvent]:
    items = await stream(url, "connector")
    return [t for i in items if isinstance(i.body, ConnectorBatch) for t in i.body.transfers]


async def test_a_save_is_finished_only_when_both_workers_reported_it(
    engine: tuple[Any, Path], nats_server: NatsServer
) -> None:
    llm, storage = engine
    hold = storage / "hold-rank1"
    hold.touch()
    tokens = prompt(1)
    first = generate(llm, [tokens])
    generate(llm, [prompt(2, 40)])  # more steps: rank 0 reports, rank 1 holds back
    saves = [t for t in await transfers(nats_server.url) if t.direction == "save"]
    pending = [t.request_id for t in saves if t.phase == "pending"]
    assert pending and not [t for t in saves if t.phase == "finished"]
    hold.unlink()
    generate(llm, [prompt(3, 40)])
    saves = [t for t in await transfers(nats_server.url) if t.direction == "save"]
    finished = {t.request_id: t for t in saves if t.phase == "finished"}
    assert pending[0] in finished and finished[pending[0]].steps >= 3
    full = (len(tokens) - 1) // BLOCK
    assert finished[pending[0]].blocks >= full

    assert generate(llm, [tokens]) == first  # loaded from the files, on both ranks
    loads = [t for t in await transfers(nats_server.url) if t.direction == "load"]
    assert [(t.phase, t.tokens) for t in loads if t.phase != "planned"] == [
        ("finished", full * BLOCK)
    ]
    # Each rank holds its shard of every block: saved and loaded digests agree per rank.
    items = await stream(nats_server.url, "connector")
    digests = [d for i in items if isinstance(i.body, ConnectorBatch) for d in i.body.digests]
    load_id = next(t.request_id for t in loads if t.phase == "finished")
    saved = {(d.rank, d.index): d.digest for d in digests if d.request_id == pending[0]}
    loaded = {(d.rank, d.index): d.digest for d in digests if d.request_id == load_id}
    assert {rank for rank, _ in loaded} == {0, 1}
    assert loaded == {key: saved[key] for key in loaded}
    assert {rank for rank, _ in saved} == {0, 1}


async def test_a_load_failed_on_one_worker_is_failed_and_recomputed(
    engine: tuple[Any, Path], nats_server: NatsServer
) -> None:
    llm, storage = engine
    tokens = prompt(10)
    computed = generate(llm, [tokens])
    generate(llm, [prompt(11, 40)])
    (storage / "fail-rank1-load").touch()
    assert generate(llm, [tokens]) == computed  # rank 0 loaded, rank 1 failed: recomputed
    assert not (storage / "fail-rank1-load").exists()
    loads = [t for t in await transfers(nats_server.url) if t.direction == "load"]
    ended = [t for t in loads if t.phase in ("finished", "failed")]
    assert (ended[-1].phase, ended[-1].reason) == ("failed", "invalid_blocks")
    assert ended[-1].invalid_blocks == (len(tokens) - 1) // BLOCK


async def test_the_workers_stats_and_common_events_are_aggregated(
    engine: tuple[Any, Path], nats_server: NatsServer
) -> None:
    llm, _ = engine
    tokens = prompt(20)
    generate(llm, [tokens])
    generate(llm, [prompt(21, 40)])
    items = await stream(nats_server.url, "connector")
    per_step = [
        (decode_raw(i.body.stats.workers) or {}).get("saved_blocks", 0)
        for i in items
        if isinstance(i.body, ConnectorBatch) and i.body.stats is not None
    ]
    # Each worker stored its shard of every block and counted it: vLLM sums the two
    # workers' stats into the one record of the step (rank 0's alone would be odd here).
    stored = [n for n in per_step if n]
    assert stored and all(n % 2 == 0 for n in stored)
    assert 2 * ((len(tokens) - 1) // BLOCK) in stored
    # The STORAGE events both workers emitted reach the kv stream once, in the batch.
    index = PrefixIndex(BLOCK)
    for item in await stream(nats_server.url, "kv"):
        index.apply(item)
    assert index.copies(SOURCE, "STORAGE") >= (len(tokens) - 1) // BLOCK
