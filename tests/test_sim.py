"""`kvbus sim`: the timing model, an engine's OpenAI API, and what it publishes.

The engines run in this process (the fleet's own objects on the test's event loop);
their events go to a real nats-server, and a consumer rebuilds each engine's block
pool from the stream exactly. Fidelity against a real vLLM engine is in
test_sim_fidelity.py; routers in front of the sim in test_sim_routers.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cluster import free_port, make_model
from router_demo import sim_engine

import kvbus
from kvbus import AllBlocksCleared, LoadMetrics, Message
from kvbus.routing.index import PrefixIndex
from kvbus.sim.timing import Profile, TimingModel
from kvbus.wire.events import SourceStarted, SourceStopped

from .conftest import BatchRecorder
from .servers import NatsServer

BLOCK = 16
BLOCKS = 40  # 39 usable: workloads below evict
PREFIX = " ".join(f"w{i}" for i in range(100, 180))  # 80 tokens: 5 blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sim-model")
    make_model(directory)
    return directory


def sim_args(model: Path, port: int, url: str | None, engines: int = 2, **extra: Any) -> Any:
    parser = argparse.ArgumentParser()
    from kvbus.sim import fleet

    fleet.add_arguments(parser)
    argv = [
        "--engines", str(engines), "--port", str(port), "--kv-blocks", str(BLOCKS),
        "--block-size", str(BLOCK), "--model", str(model), "--max-model-len", "512",
        "--profile", "instant", "--source-prefix", f"simtest{port}-",
    ]  # fmt: skip
    if url:
        argv += ["--url", url]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return parser.parse_args(argv)


class Sim:
    """An in-process fleet and an HTTP client for it."""

    def __init__(self, fleet: Any, session: aiohttp.ClientSession, port: int) -> None:
        self.fleet = fleet
        self.session = session
        self.port = port

    def source(self, engine: int) -> str:
        return f"{self.fleet.engines[engine].name}/dp0"

    def url(self, engine: int, path: str) -> str:
        return f"http://127.0.0.1:{self.port + engine}{path}"

    async def post(self, engine: int, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.session.post(self.url(engine, path), json=body) as response:
            text = await response.text()
            return response.status, json.loads(text) if text else None

    async def complete(self, engine: int, prompt: str | list[int], **body: Any) -> Any:
        status, reply = await self.post(
            engine, "/v1/completions", {"prompt": prompt, "max_tokens": 3, **body}
        )
        assert status == 200, reply
        return reply


@pytest.fixture
async def sim(model_dir: Path, nats_server: NatsServer) -> AsyncIterator[Sim]:
    from kvbus.sim.fleet import Fleet

    port = free_port()
    fleet = Fleet(sim_args(model_dir, port, nats_server.url))
    await fleet.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield Sim(fleet, session, port)
    finally:
        await fleet.close()


async def read_bus(url: str, source: str, stream: str = "kv") -> list[Message]:
    """Everything ``source`` published on ``stream`` so far (its publishers flushed)."""
    sub = kvbus.subscribe(stream, url, follow=False, sources=[source])
    items = [item async for item in sub if isinstance(item, Message)]
    await sub.aclose()
    return items


def flush(sim: Sim, engine: int) -> None:
    publisher = sim.fleet.engines[engine]._publishers.publishers[0].publisher
    assert publisher.flush(10)


def pool_hashes(sim: Sim, engine: int) -> set[Any]:
    """The block hashes the engine's vLLM block pool holds now, as events carry them."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = sim.fleet.engines[engine].core.scheduler.kv_cache_manager.block_pool
    return {
        maybe_convert_block_hash(get_block_hash(key))
        for key in pool.cached_block_hash_to_block._cache
    }


# --- the timing model -----------------------------------------------------------------------


def test_step_time_follows_the_profile_for_prefill_and_decode_steps(model_dir: Path) -> None:
    from vllm.sampling_params import SamplingParams

    from kvbus.sim.engine_core import EngineCore, EngineShape, engine_config
    from kvbus.sim.timing import Profile, StepWork, TimingModel, step_work

    profile = Profile(overhead=1e-3, weight_read=5e-3, prefill=1e-4, decode=2e-4, context=1e-6)
    timing = TimingModel(profile, speedup=2.0)
    core = EngineCore(engine_config(EngineShape(str(model_dir), BLOCKS, BLOCK, 512)), timing)
    core.add("a", list(range(3, 103)), SamplingParams(max_tokens=2, ignore_eos=True), 0.0)
    decision, seconds = core.begin_step()
    work = step_work(decision, core.scheduler.requests)
    assert work == StepWork(prefill_tokens=100, decode_seqs=0, context_tokens=100)
    # 100 prefill tokens (10 ms of compute) beat the 5 ms weight read; halved by speedup.
    assert seconds == pytest.approx((1e-3 + 100 * 1e-4 + 100 * 1e-6) / 2)
    core.end_step(decision)
    decision, seconds = core.begin_step()
    work = step_work(decision, core.scheduler.requests)
    assert work == StepWork(prefill_tokens=0, decode_seqs=1, context_tokens=101)
    # One decode: the weight read is the floor.
    assert seconds == pytest.approx((1e-3 + 5e-3 + 101 * 1e-6) / 2)
    assert timing.seconds(StepWork()) == 0.0


def test_profiles_load_by_name_or_file_and_refuse_bad_numbers(tmp_path: Path) -> None:
    from kvbus.sim.timing import PROFILES, load_profile

    assert load_profile("h100-llama-3.1-8b") is PROFILES["h100-llama-3.1-8b"]
    assert all(p.source for p in PROFILES.values())  # every profile says where it comes from
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"overhead": 0, "weight_read": 0.02, "prefill": 1e-5,
                                "decode": 1e-5, "context": 0}))  # fmt: skip
    assert load_profile(str(mine)).weight_read == 0.02
    mine.write_text(json.dumps({"overhead": -1, "weight_read": 0, "prefill": 0,
                                "decode": 0, "context": 0}))  # fmt: skip
    with pytest.raises(ValueError, match="overhead"):
        load_profile(str(mine))
    with pytest.raises(ValueError, match="neither"):
        load_profile("b200-unknown")


# --- the API --------------------------------------------------------------------------------


async def test_completions_report_the_prefix_cache_as_vllm_does(sim: Sim) -> None:
    first = await sim.complete(0, PREFIX + " w5 w6")
    again = await sim.complete(0, PREFIX + " w7 w8 w9")
    assert first["usage"]["prompt_tokens"] == 82
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 80  # 5 whole blocks
    assert again["usage"]["completion_tokens"] == 3
    assert again["choices"][0]["finish_reason"] == "length"
    assert len(again["choices"][0]["text"].split()) == 3
    # The other engine has its own cache; a salt makes a different cache key, as in vLLM.
    other = await sim.complete(1, PREFIX + " w7")
    salted = await sim.complete(0, PREFIX + " w7", cache_salt="tenant-b")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    tokens = await sim.complete(0, [*range(100, 180), 9])  # token ids: the same blocks
    assert tokens["usage"]["prompt_tokens_details"]["cached_tokens"] == 80


async def test_a_client_that_leaves_aborts_its_request_as_vllm_does(sim: Sim) -> None:
    """vLLM's server aborts a request whose client disconnects (``with_cancellation``);
    so does the sim, streamed or not, so an abandoned request takes no more steps."""
    engine = sim.fleet.engines[1]
    engine.core.timing = TimingModel(Profile(overhead=0, weight_read=0.05, prefill=0,
                                             decode=0, context=0))  # fmt: skip
    for stream in (False, True):
        body = {"prompt": PREFIX, "max_tokens": 400, "stream": stream}  # 20 s
        post = asyncio.create_task(sim.post(1, "/v1/completions", body))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.load[0]:
                break
        assert engine.load == (1, 0)
        post.cancel()  # the client goes away
        await asyncio.gather(post, return_exceptions=True)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.load == (0, 0):
                break
        assert engine.load == (0, 0), stream
        # The abort is applied between steps; vLLM's scheduler then runs one empty step
        # to report the finished id, which may still be under way when the load reads
        # zero. Let it end (one step is 50 ms here) before counting.
        await asyncio.sleep(0.2)
        steps = engine.steps
        await asyncio.sleep(0.3)
        assert engine.steps == steps  # nothing left to step


async def test_chat_streams_deltas_then_usage_then_done(sim: Sim) -> None:
    body = {
        "messages": [{"role": "user", "content": PREFIX}],
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with sim.session.post(sim.url(0, "/v1/chat/completions"), json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() async for line in response.content]
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    # Decoded a window at a time, the deltas join into the whole text: 40 words.
    assert re.fullmatch(r"w\d+( w\d+){39}", text), text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 40
    status, counted = await sim.post(0, "/tokenize", {"messages": body["messages"]})
    assert status == 200 and usage["prompt_tokens"] == counted["count"]


async def test_a_chat_streams_first_chunk_comes_after_the_prefill_as_vllms_does(sim: Sim) -> None:
    """vLLM sends a chat stream's role chunk with the first token, so a router timing
    the first chunk (its ttft, its decode pace) sees the prefill in it; a role chunk
    sent on accepting the request would read as a first token before any step ran."""
    engine = sim.fleet.engines[0]
    engine.core.timing = TimingModel(Profile(overhead=0, weight_read=0.3, prefill=0,
                                             decode=0, context=0))  # fmt: skip
    body = {"messages": [{"role": "user", "content": PREFIX}], "max_tokens": 2, "stream": True}
    async with sim.session.post(sim.url(0, "/v1/chat/completions"), json=body) as response:
        assert response.status == 200
        first = await response.content.readline()
        steps_at_first_chunk = engine.steps
        rest = [line async for line in response.content]
    chunk = json.loads(first.decode().removeprefix("data: "))
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert steps_at_first_chunk >= 1  # the prefill's step had run (each takes 0.3 s)
    assert b"data: [DONE]\n" in rest  # and the answer still ends as vLLM's does


async def test_n_choices_share_the_prompt_and_bad_requests_get_vllm_errors(sim: Sim) -> None:
    reply = await sim.complete(0, PREFIX, n=3)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["usage"]["completion_tokens"] == 9
    long = " ".join(["w9"] * 600)
    for body in (
        {"prompt": PREFIX, "max_tokens": 0},
        {"prompt": PREFIX, "max_tokens": "3"},
        {"prompt": PREFIX, "n": 10_000},
        {"prompt": ""},
        {"prompt": [-1, 5]},
        {"prompt": long},
        {"prompt": PREFIX, "cache_salt": 7},
        {"nothing": 1},
    ):
        status, error = await sim.post(0, "/v1/completions", body)
        assert status == 400, body
        assert error["error"]["type"] == "BadRequestError" and error["error"]["message"]
    status, error = await sim.post(0, "/v1/chat/completions", {"messages": []})
    assert status == 400
    # The engine still serves after them.
    assert (await sim.complete(0, "w5 w6"))["usage"]["prompt_tokens"] == 2


async def test_an_answers_id_names_its_engine(sim: Sim) -> None:
    """Behind a router that adds no header of its own, the answers still show where each
    request went (bench/bench_fleet_routing.py's placement of the peers)."""
    for engine in (0, 1):
        answer = await sim.complete(engine, PREFIX)
        name = sim.fleet.engines[engine].name
        assert answer["id"].startswith(f"cmpl-{name}-")
        assert sim_engine(answer["id"]) == name
    assert sim_engine("cmpl-0123abcd") == "" and sim_engine(None) == ""


async def test_models_health_metrics_and_what_vllm_router_calls(sim: Sim, model_dir: Path) -> None:
    async with sim.session.get(sim.url(0, "/v1/models")) as response:
        models = await response.json()
    assert models["data"][0]["id"] == str(model_dir)
    assert models["data"][0]["max_model_len"] == 512
    async with sim.session.get(sim.url(1, "/health")) as response:
        assert response.status == 200
    await sim.complete(0, PREFIX)
    await sim.complete(0, PREFIX)
    async with sim.session.get(sim.url(0, "/metrics")) as response:
        text = await response.text()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:") and "{" in line
    }
    assert values["vllm:prefix_cache_queries_total"] == 160
    assert values["vllm:prefix_cache_hits_total"] == 64  # 4 blocks: the last token is computed
    assert values["vllm:generation_tokens_total"] == 6
    assert "vllm:num_requests_running" in values and "vllm:kv_cache_usage_perc" in values
    status, tokens = await sim.post(0, "/tokenize", {"prompt": "w5 w6"})
    assert status == 200 and tokens["tokens"][-2:] == [5, 6]
    status, text_back = await sim.post(0, "/detokenize", {"tokens": [5, 6]})
    assert status == 200 and text_back["prompt"] == "w5 w6"
    # As a server without --enable-scale-out: vllm-router falls back to /tokenize.
    status, error = await sim.post(0, "/v1/completions/render", {"prompt": "w5"})
    assert status == 403 and error["error"]["type"] == "PermissionDeniedError"


# --- the bus ---------------------------------------------------------------------------------


async def test_the_bus_rebuilds_each_engines_block_pool_exactly(
    sim: Sim, nats_server: NatsServer
) -> None:
    """A workload that evicts (more prefixes than the 39 usable blocks hold): kvbus's own
    index, fed the engine's stream, holds exactly the blocks vLLM's block pool holds."""
    for round_ in range(3):
        for tenant in range(8):
            prefix = " ".join(f"w{100 + 50 * tenant + i}" for i in range(80 + 16 * (tenant % 3)))
            await sim.complete(0, f"{prefix} w{round_ + 3}", max_tokens=5)
    await sim.complete(0, f"{prefix} w9", max_tokens=5)  # the last prefix again: a hit
    flush(sim, 0)
    stat_logger = sim.fleet.engines[0].stat_logger
    assert stat_logger is not None and stat_logger.publisher.flush(10)
    index = PrefixIndex(BLOCK)
    removed = 0
    for message in await read_bus(nats_server.url, sim.source(0)):
        index.apply(message)
        if isinstance(message.body, kvbus.KVEventBatch):
            removed += sum(isinstance(e, kvbus.BlockRemoved) for e in message.body.events)
    assert removed > 0  # the workload did evict
    assert index.blocks(sim.source(0)) == pool_hashes(sim, 0)
    load = [m.body for m in await read_bus(nats_server.url, sim.source(0), "metrics")]
    assert any(isinstance(b, LoadMetrics) and b.prefix_cache_hits > 0 for b in load)
    assert any(isinstance(b, LoadMetrics) and b.kv_cache_blocks == BLOCKS for b in load)


def indexed(messages: list[Message]) -> PrefixIndex:
    index = PrefixIndex(BLOCK)
    for message in messages:
        index.apply(message)
    return index


async def assert_clears_and_pool(sim: Sim, nats_server: NatsServer, clears: int) -> None:
    """Engine 0's stream so far holds ``clears`` AllBlocksCleared and rebuilds its pool
    (not empty)."""
    flush(sim, 0)
    kv = await read_bus(nats_server.url, sim.source(0))
    cleared = [e for m in kv if isinstance(m.body, kvbus.KVEventBatch) for e in m.body.events
               if isinstance(e, AllBlocksCleared)]  # fmt: skip
    assert len(cleared) == clears
    assert indexed(kv).blocks(sim.source(0)) == pool_hashes(sim, 0) != set()


async def test_a_cache_reset_and_a_restart_reach_the_bus(sim: Sim, nats_server: NatsServer) -> None:
    prompt = [*range(100, 180), 9]  # token ids: 5 whole blocks and one more token
    await sim.complete(0, prompt)
    flush(sim, 0)
    before = await read_bus(nats_server.url, sim.source(0))
    assert indexed(before).match(prompt) == {sim.source(0): 80}
    steps = sim.fleet.engines[0].steps
    status, _ = await sim.post(0, "/reset_prefix_cache")
    assert status == 200 and _ == {"success": True}
    # The engine is idle and runs no step, yet its AllBlocksCleared is on the bus at once
    # (vLLM alone would publish it with the next step's batch), alone in its batch, after
    # everything published before: an index fed the stream expects nothing cached.
    flush(sim, 0)  # a bounded wait (10 s) for what the engine published so far
    kv = await read_bus(nats_server.url, sim.source(0))
    assert sim.fleet.engines[0].steps == steps
    assert [m.seq for m in kv] == [m.seq for m in before] + [before[-1].seq + 1]
    assert isinstance(kv[-1].body, kvbus.KVEventBatch)
    assert kv[-1].body.events == [AllBlocksCleared()]
    assert indexed(kv).match(prompt) == {}
    assert indexed(kv).blocks(sim.source(0)) == pool_hashes(sim, 0) == set()
    assert (await sim.complete(0, prompt))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A reset refused (a request holds blocks) clears nothing and publishes no clear:
    # vLLM 0.32 answers 200 {"success": false}.
    slow = sim.fleet.engines[0].core
    slow.timing = TimingModel(Profile(overhead=0, weight_read=0.02, prefill=0, decode=0,
                                      context=0))  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 50, "stream": True}  # 1 s
    async with sim.session.post(sim.url(0, "/v1/completions"), json=body) as running:
        assert (await running.content.readline()).startswith(b"data: ")  # a token: running
        status, refused = await sim.post(0, "/reset_prefix_cache")
        rest = (await running.read()).decode()
    assert (status, refused) == (200, {"success": False})
    assert rest.endswith("data: [DONE]\n\n")
    await assert_clears_and_pool(sim, nats_server, 1)
    # ?reset_running_requests=true preempts the running request and resets: the request
    # recomputes and ends with all its tokens, and the bus still equals the pool.
    async with sim.session.post(sim.url(0, "/v1/completions"), json=body) as running:
        assert (await running.content.readline()).startswith(b"data: ")
        status, reset = await sim.post(0, "/reset_prefix_cache?reset_running_requests=true")
        rest = (await running.read()).decode()
    assert (status, reset) == (200, {"success": True})
    assert rest.endswith("data: [DONE]\n\n") and "error" not in rest
    await assert_clears_and_pool(sim, nats_server, 2)
    status, invalid = await sim.post(0, "/reset_prefix_cache?reset_running_requests=maybe")
    assert status == 400 and "reset_running_requests" in invalid["error"]["message"]
    # A restart fails the request in flight and starts a new epoch with an empty cache.
    slow_steps = Profile(overhead=0, weight_read=0.05, prefill=0, decode=0, context=0)
    sim.fleet.engines[1].core.timing = TimingModel(slow_steps)  # 400 tokens: 20 s
    whole = asyncio.create_task(sim.post(1, "/v1/completions", {"prompt": "w5", "max_tokens": 400}))
    body = {"prompt": PREFIX, "max_tokens": 400, "stream": True}
    async with sim.session.post(sim.url(1, "/v1/completions"), json=body) as response:
        assert (await response.content.readline()).startswith(b"data: ")  # a token: running
        status, restarted = await sim.post(1, "/sim/restart")
        assert status == 200 and restarted == {"restarts": 1}
        rest = (await response.read()).decode()
    assert "the engine restarted" in rest and rest.endswith("data: [DONE]\n\n")
    status, failed = await whole
    assert status == 500 and "restarted" in failed["error"]["message"]
    assert (await sim.complete(1, PREFIX))["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    flush(sim, 1)
    sub = kvbus.subscribe("kv", nats_server.url, follow=False, sources=[sim.source(1)])
    items = [item async for item in sub]
    await sub.aclose()
    bodies = [type(i.body).__name__ if isinstance(i, Message) else i.reason for i in items]
    stopped = bodies.index("SourceStopped")
    assert bodies[stopped + 1 : stopped + 3] == ["new_epoch", "SourceStarted"]
    epochs = {i.epoch for i in items if isinstance(i, Message)}
    assert len(epochs) == 2
    assert isinstance(items[0], Message) and isinstance(items[0].body, SourceStarted)
    assert any(isinstance(i, Message) and isinstance(i.body, SourceStopped) for i in items)


async def test_a_restarted_engine_sends_its_load_before_it_runs_a_step(
    sim: Sim, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM's front end, the sim tells its stat logger the engine is up: the new
    epoch's first load record is on the bus at once, not at the first heartbeat (routers
    take an engine back on its first record; an idle one runs no step to record)."""
    monkeypatch.setenv("KVBUS_METRICS_HEARTBEAT", "600")  # no heartbeat in this test
    engine = sim.fleet.engines[1]
    steps = engine.steps
    status, _ = await sim.post(1, "/sim/restart")
    assert status == 200
    assert engine.flush(10)
    records = await read_bus(nats_server.url, sim.source(1), "metrics")
    newest = max(m.epoch for m in records)
    loads = [m.body for m in records if m.epoch == newest and isinstance(m.body, LoadMetrics)]
    assert engine.steps == steps and len(loads) == 1
    assert loads[0].running == loads[0].waiting == 0 and loads[0].kv_cache_blocks > 0


def test_vllms_zmq_events_carry_a_reset_with_the_next_step_as_vllms_own_do() -> None:
    """A sim engine's reset goes to the bus at once and to its ``--zmq-port`` publisher
    (what vllm-router kv_aware reads) at the head of the next step's batch, as vLLM's own
    publisher sends it: peers in front of the sim see what they see in front of vLLM."""
    from kvbus.connectors.vllm_events import KvbusEventPublisher
    from vllm.distributed.kv_events import AllBlocksCleared as Cleared
    from vllm.distributed.kv_events import BlockStored as Stored
    from vllm.distributed.kv_events import KVEventBatch as Batch

    from kvbus.sim.engine import _Publishers

    bus, zmq_side = KvbusEventPublisher(0, url="memory://sim-zmq-reset"), BatchRecorder()
    publishers = _Publishers([bus, zmq_side])  # type: ignore[list-item]
    try:
        stored = Stored([7], None, list(range(BLOCK)), BLOCK, None, "GPU", None)
        publishers.publish(Batch(ts=1.0, events=[stored]))
        publishers.publish_early(Batch(ts=2.0, events=[Cleared()]))
        publishers.publish(Batch(ts=3.0, events=[stored]))
        assert bus.publisher.stats.published == 4  # SourceStarted, then the three at once
        assert [(b.ts, [type(e).__name__ for e in b.events]) for b in zmq_side.batches] == [
            (1.0, ["BlockStored"]),
            (3.0, ["AllBlocksCleared", "BlockStored"]),
        ]
    finally:
        publishers.shutdown()


# --- the command ------------------------------------------------------------------------------


def test_the_command_documents_its_interface_and_refuses_bad_options(model_dir: Path) -> None:
    kvbus_cli = [sys.executable, "-m", "kvbus.cli", "sim"]
    shown = subprocess.run([*kvbus_cli, "--help"], capture_output=True, text=True, check=True)
    for option in ("--engines", "--port", "--kv-blocks", "--block-size", "--model",
                   "--served-model-name", "--url", "--source-prefix", "--zmq-port",
                   "--profile", "--speedup", "--slow"):  # fmt: skip
        assert option in shown.stdout
    assert "ENGINE=FACTOR" in shown.stdout
    base = ["--port", "9000", "--kv-blocks", "64", "--model", str(model_dir)]
    for bad in (["--engines", "0"], ["--port", "65535", "--engines", "2"], ["--profile", "nope"],
                ["--engines", "2", "--slow", "2=2"], ["--slow", "0=0"], ["--slow", "0=-1"],
                ["--slow", "0=inf"], ["--slow", "two"], ["--slow", "-1=2"],
                ["--engines", "2", "--slow", "1=2", "--slow", "1=3"]):  # fmt: skip
        # Refused before vLLM loads: these take a fraction of a second.
        argv = [*base, *bad] if bad[0] != "--port" else [*bad, "--kv-blocks", "64",
                                                         "--model", str(model_dir)]  # fmt: skip
        failed = subprocess.run([*kvbus_cli, *argv], capture_output=True, text=True, timeout=120)
        assert failed.returncode != 0 and "kvbus sim:" in failed.stderr, failed.stderr


async def test_a_slow_engine_takes_factor_times_as_long_for_the_same_requests(
    model_dir: Path,
) -> None:
    """``--slow 1=2``: engine 1 runs the same requests in the same steps as engines 0
    and 2 (the same scheduler), each step modelled twice as long; its requests take at
    least that long on the wall clock."""
    from kvbus.sim.fleet import Fleet

    port = free_port()
    args = sim_args(model_dir, port, None, engines=3, profile="h100-llama-3.1-8b", slow="1=2")
    fleet = Fleet(args)
    await fleet.start()
    try:
        async with aiohttp.ClientSession() as session:
            sim = Sim(fleet, session, port)
            loop = asyncio.get_running_loop()
            modelled: dict[int, list[float]] = {0: [], 1: [], 2: []}
            wall: dict[int, list[float]] = {0: [], 1: [], 2: []}
            other = " ".join(f"w{i}" for i in range(300, 340))
            prompts = [PREFIX + " w1", PREFIX + " w2 w3", other]  # a miss, a hit, a miss
            for prompt in prompts:  # one at a time: each engine runs the same steps
                for engine in (0, 1, 2):
                    before, started = fleet.engines[engine].step_seconds, loop.time()
                    await sim.complete(engine, prompt, max_tokens=8)
                    wall[engine].append(loop.time() - started)
                    modelled[engine].append(fleet.engines[engine].step_seconds - before)
            async with session.get(sim.url(1, "/sim/state")) as response:
                state = await response.json()
    finally:
        await fleet.close()
    assert state["slowdown"] == 2.0 and state["step_seconds"] == pytest.approx(sum(modelled[1]))
    assert [fleet.engines[i].steps for i in (0, 1, 2)] == [fleet.engines[0].steps] * 3
    for request in range(len(prompts)):
        fast = modelled[0][request]
        assert fast > 0.005  # at least one step's weight read (6.5 ms on this profile)
        assert modelled[2][request] == pytest.approx(fast)
        assert modelled[1][request] == pytest.approx(2 * fast)
        # The wall clock: a step's tokens come out only once its modelled time has passed.
        assert wall[1][request] >= 0.99 * modelled[1][request]
    assert sum(wall[1]) / sum(modelled[0]) > 1.5


def test_a_cache_too_small_for_one_request_is_refused_as_vllm_refuses_it(model_dir: Path) -> None:
    # vLLM plans its admission check against --num-gpu-blocks-override, less the null block.
    argv = ["--port", str(free_port()), "--kv-blocks", "8", "--block-size", "16",
            "--max-model-len", "512", "--model", str(model_dir)]  # fmt: skip
    failed = subprocess.run(
        [sys.executable, "-m", "kvbus.cli", "sim", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode != 0
    assert "kvbus sim: 8 KV blocks of 16 tokens cannot hold one request" in failed.stderr


def launch(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvbus.cli", *argv], stdout=out, stderr=out)


async def test_sigterm_ends_every_engines_epoch_on_both_streams(
    model_dir: Path, nats_server: NatsServer, tmp_path: Path
) -> None:
    """A fleet stopped with SIGTERM announces each engine stopped (kv and metrics
    streams) within kvbus's shutdown grace: consumers see `stopped`, not silence."""
    engines, port = 24, free_port()
    while any(free_port() == port + i for i in range(1, engines)):  # pragma: no cover
        port = free_port()
    prefix = f"simterm{port}-"
    argv = [
        "sim", "--engines", str(engines), "--port", str(port), "--kv-blocks", "64",
        "--block-size", "16", "--max-model-len", "512", "--model", str(model_dir),
        "--url", nats_server.url, "--source-prefix", prefix, "--profile", "instant",
    ]  # fmt: skip
    process = launch(argv, tmp_path / "sim.log")
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(1200):
                if process.poll() is not None:
                    break
                try:
                    async with session.get(f"http://127.0.0.1:{port + engines - 1}/health"):
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            body = {"prompt": PREFIX, "max_tokens": 2}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200, (tmp_path / "sim.log").read_text()[-3000:]
        process.terminate()
        assert process.wait(30) == 143
    finally:
        process.kill()
    for stream in ("kv", "metrics"):
        sources = [f"{prefix}{i}/dp0" for i in range(engines)]
        sub = kvbus.subscribe(stream, nats_server.url, follow=False, sources=sources)
        last = {m.source: m.body async for m in sub if isinstance(m, Message)}
        await sub.aclose()
        not_stopped = [s for s in sources if not isinstance(last.get(s), SourceStopped)]
        assert not_stopped == [], (stream, (tmp_path / "sim.log").read_text()[-2000:])


async def test_an_engine_states_its_shape_and_gpu_profiles_bring_vllms_gpu_limits(
    sim: Sim, model_dir: Path
) -> None:
    from kvbus.sim.engine_core import EngineShape, engine_config
    from kvbus.sim.timing import PROFILES

    async with sim.session.get(sim.url(1, "/sim/state")) as response:
        state = await response.json()
    # The instant profile keeps this platform's defaults (vLLM on a CPU: 128 and 2048).
    assert state["kv_blocks"] == BLOCKS and state["name"] == sim.fleet.engines[1].name
    assert (state["max_num_seqs"], state["max_num_batched_tokens"]) == (128, 2048)
    h100 = PROFILES["h100-llama-3.1-8b"]
    shape = EngineShape(str(model_dir), 2048, 16, 2048, h100.max_num_seqs,
                        h100.max_num_batched_tokens)  # fmt: skip
    scheduler = engine_config(shape).scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (1024, 8192)


async def test_restarts_under_load_fail_only_requests_in_flight_and_the_bus_keeps_up(
    sim: Sim, nats_server: NatsServer
) -> None:
    """A soak: 30 restarts while 6 clients keep sending. Every request ends (done, or
    failed by a restart); each restart is one epoch ended and one begun on the bus; the
    index fed the whole stream holds exactly the last core's blocks."""
    from kvbus.sim.timing import Profile, TimingModel

    engine = sim.fleet.engines[0]
    engine.timing = TimingModel(
        Profile(overhead=0, weight_read=2e-3, prefill=0, decode=0, context=0)
    )
    engine.core.timing = engine.timing
    outcomes: list[int] = []
    stop = asyncio.Event()

    async def client(tenant: int) -> None:
        while not stop.is_set():
            prompt = " ".join(f"w{100 + 60 * tenant + i}" for i in range(40 + tenant))
            status, _ = await sim.post(0, "/v1/completions", {"prompt": prompt, "max_tokens": 12})
            outcomes.append(status)

    clients = [asyncio.create_task(client(t)) for t in range(6)]
    for round_ in range(30):
        await asyncio.sleep(0.04 + 0.003 * (round_ % 7))
        status, _ = await sim.post(0, "/sim/restart")
        assert status == 200
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*clients), 30)
    assert set(outcomes) == {200, 500} and outcomes.count(200) > 20
    flush(sim, 0)
    sub = kvbus.subscribe("kv", nats_server.url, follow=False, sources=[sim.source(0)])
    index = PrefixIndex(BLOCK)
    epochs: dict[int, list[str]] = {}
    async for item in sub:
        index.apply(item)
        if isinstance(item, Message):
            epochs.setdefault(item.epoch, []).append(type(item.body).__name__)
    await sub.aclose()
    assert len(epochs) == 31
    ended = [e for e, kinds in epochs.items() if kinds[-1] == "SourceStopped"]
    assert len(ended) == 30 and all(kinds[0] == "SourceStarted" for kinds in epochs.values())
    assert index.blocks(sim.source(0)) == pool_hashes(sim, 0)


def test_making_an_engine_config_leaves_vllms_plugins_unloaded(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM loads its plugins once per process. The sim's config must neither run
    kvbus's (it wires its own publishers) nor use up that once: a real engine started
    later in the process, with KVBUS_URL, must still get kvbus's publisher."""
    import vllm.plugins
    from vllm.distributed.kv_events import EventPublisherFactory

    from kvbus.sim.engine_core import EngineShape, engine_config

    monkeypatch.setenv("KVBUS_URL", "memory://sim-plugins")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setitem(EventPublisherFactory._registry, "zmq", "vLLM's own")
    engine_config(EngineShape(str(model_dir), BLOCKS, BLOCK, 512))
    assert vllm.plugins.plugins_loaded is False
    assert EventPublisherFactory._registry["zmq"] == "vLLM's own"
