"""`kvbus router` in front of `kvbus sim` (one process of simulated engines) on a real
nats-server, as an operator runs it in front of real vLLM servers: the router knows the
engines only from their KV events and load records on the bus, and from their HTTP API.

Also what a router needs of the sim's own endpoints: vLLM's ZMQ KV events listening on
``--zmq-port`` (with replay), and the scale-out render endpoints vllm-router reads."""

from __future__ import annotations

import contextlib
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from cluster import BLOCK, RouterProcess, SimEngine, SimFleet, get_json, make_model
from cluster import post_json as post
from peers import PEERS, PeerRouter, find_peers

from kvbus.wire.events import BlockStored, KVEventBatch

from .servers import NatsServer

ENGINES = 3
PREFIX_BLOCKS = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer) -> Iterator[SimFleet]:
    directory = tmp_path_factory.mktemp("sim-routers")
    model = directory / "model"
    model.mkdir()
    make_model(model)
    fleet = SimFleet(
        directory, model, ENGINES, nats_server.url, blocks=64, max_model_len=1024,
        zmq=True, profile="instant", extra_args=["--enable-scale-out"],
    )  # fmt: skip
    fleet.launch()
    try:
        for engine in fleet.engines:
            engine.wait_healthy(120)
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def router(fleet: SimFleet, nats_server: NatsServer) -> Iterator[RouterProcess]:
    workers = {engine.source: engine.url for engine in fleet.engines}
    process = RouterProcess(fleet.data_dir, workers, "kv", nats_server.url, cli=True)
    process.launch()
    try:
        process.wait_ready(ENGINES, timeout=60)
        yield process
    finally:
        process.stop()


def metric(url: str, name: str) -> float:
    """The sum of ``name``'s samples (any labels) on ``url``'s /metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(router: RouterProcess, fleet: SimFleet, prompt: list[int]) -> tuple[str, int, int]:
    """A completion through the router: (worker, predicted cached, cached) tokens."""
    body = {"model": str(fleet.model), "prompt": prompt, "max_tokens": 2}
    status, headers, answer = post(f"{router.url}/v1/completions", body)
    assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return headers["x-kvbus-worker"], int(headers["x-kvbus-predicted-cached-tokens"]), cached


def engine_of(fleet: SimFleet, worker: str) -> SimEngine:
    return next(e for e in fleet.engines if f"{e.source}/dp0" == worker)


def test_health_shows_the_sim_engines_alive_from_their_load_records(
    fleet: SimFleet, router: RouterProcess
) -> None:
    health = router.health()
    assert health["ready"] and health["load"] and health["bus"] == "up"
    assert sorted(health["eligible"]) == sorted(f"{e.source}/dp0" for e in fleet.engines)
    # Alive on the bus's records, not on polls of the engines' own /metrics.
    assert health["engine_load"] == [] and health["routing"] == "full"


def test_requests_sharing_a_prefix_land_on_one_engine_cached_then_a_restart_and_a_reset_are_seen(
    fleet: SimFleet, router: RouterProcess
) -> None:
    # Empty caches, whatever ran before: each engine's AllBlocksCleared reaches the
    # router at once, with no request to make the idle engines step.
    for engine in fleet.engines:
        engine.reset_prefix_cache()
    router.wait(lambda: metric(router.url, "kvbus_router_indexed_blocks") == 0, 30)
    rng = random.Random(5)
    prefix = [rng.randrange(4, 1024) for _ in range(PREFIX_BLOCKS * BLOCK)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(4, 1024) for _ in range(40)]

    first, predicted, cached = complete(router, fleet, prompt())
    assert (predicted, cached) == (0, 0)
    # Its blocks reach the router as the engine's KV events, over the bus.
    router.wait(lambda: metric(router.url, "kvbus_router_indexed_blocks") >= PREFIX_BLOCKS, 30)
    for _ in range(4):
        worker, predicted, cached = complete(router, fleet, prompt())
        assert worker == first
        assert cached >= PREFIX_BLOCKS * BLOCK and predicted == cached

    engine = engine_of(fleet, first)
    assert engine.restart() == 1
    assert get_json(f"{engine.url}/sim/state")["restarts"] == 1
    # The old epoch's end and the new one's start reach the router: it forgets the
    # engine's blocks (the other engines held none).
    router.wait(lambda: metric(router.url, "kvbus_router_indexed_blocks") == 0, 30)
    worker, predicted, cached = complete(router, fleet, prompt())
    assert (predicted, cached) == (0, 0), worker
    # Blocks of the new epoch count: the restarted engine caches again, seen as such.
    router.wait(lambda: metric(router.url, "kvbus_router_indexed_blocks") >= PREFIX_BLOCKS, 30)
    again, predicted, cached = complete(router, fleet, prompt())
    assert again == worker and cached >= PREFIX_BLOCKS * BLOCK and predicted == cached
    # A cache reset of the idle engine (an RL weight sync's): the router forgets its
    # blocks with no request sent there, and predicts what the engine then finds.
    engine_of(fleet, again).reset_prefix_cache()
    router.wait(lambda: metric(router.url, "kvbus_router_indexed_blocks") == 0, 30)
    worker, predicted, cached = complete(router, fleet, prompt())
    assert (predicted, cached) == (0, 0), worker


def test_zmq_events_listen_on_the_port_and_replay(fleet: SimFleet) -> None:
    """vllm-router kv_aware connects a SUB socket to each engine's ``--zmq-port``: the
    sim binds it (vLLM would connect, not listen, on a named host) and answers replay
    requests on ``--zmq-replay-port`` as vLLM's publisher does."""
    engine = fleet.engines[-1]
    endpoint, replay_endpoint = engine.zmq_endpoints
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 2000)
    sub.connect(endpoint)
    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.RCVTIMEO, 30_000)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        stored: list[BlockStored] = []
        sent: list[list[int]] = []
        rng = random.Random(9)
        for _ in range(5):  # a SUB socket misses what is sent before it has connected
            prompt = [rng.randrange(4, 1024) for _ in range(2 * BLOCK + 3)]
            sent.append(prompt[:BLOCK])
            post(f"{engine.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
            with contextlib.suppress(zmq.Again):  # until 2 s pass without an event
                while True:
                    _topic, _seq, payload = sub.recv_multipart()
                    batch = decoder.decode(payload)
                    stored += [e for e in batch.events if isinstance(e, BlockStored)]
            if stored:
                break
        # One BlockStored may hold several blocks: its first block is a prompt's.
        assert any(e.token_ids[:BLOCK] in sent for e in stored)
        replay.connect(replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            _empty, _topic, _seq, payload = replay.recv_multipart()
            if not payload:  # the end marker
                break
            replayed.append(decoder.decode(payload))
        assert any(isinstance(e, BlockStored) for b in replayed for e in b.events)
    finally:
        context.destroy(linger=0)


def test_render_gives_the_prompts_token_ids_as_tokenize_does(fleet: SimFleet) -> None:
    """vllm-router reads a prompt's token ids from ``/v1/completions/render`` (a list of
    vLLM's GenerateRequest) and ``/v1/chat/completions/render`` (one)."""
    url, model = fleet.engines[0].url, str(fleet.model)
    text = {"model": model, "prompt": "w5 w6 w7 w8"}
    status, _, rendered = post(f"{url}/v1/completions/render", text)
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 1
    _, _, tokenized = post(f"{url}/tokenize", text)
    assert rendered[0]["token_ids"] == tokenized["tokens"] == [5, 6, 7, 8]
    assert rendered[0]["request_id"].startswith("cmpl-") and rendered[0]["model"] == model
    assert isinstance(rendered[0]["sampling_params"], dict)
    chat = {"model": model, "messages": [{"role": "user", "content": "w9 w10"}]}
    status, _, rendered = post(f"{url}/v1/chat/completions/render", chat)
    _, _, tokenized = post(f"{url}/tokenize", chat)
    assert status == 200 and rendered["token_ids"] == tokenized["tokens"]
    assert rendered["request_id"].startswith("chatcmpl-")
    status, _, error = post(f"{url}/v1/completions/render", {"model": model, "prompt": ""})
    assert status == 400 and error["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("run", list(PEERS))
def test_peer_routers_serve_in_front_of_the_sim(fleet: SimFleet, run: str) -> None:
    """The peers (sglang-router, vllm-router: `bash scripts/install.sh peers`) route to
    the sim's engines as to real ones: prompts sharing a prefix find it cached. A peer
    that is not installed is skipped, unless ``KVBUS_REQUIRE_PEERS`` is set (the test
    command installs them and sets it); kvbus's own router is never skipped."""
    kind, policy = PEERS[run]
    if kind not in find_peers():
        missing = f"{kind} is not installed (bash scripts/install.sh peers)"
        if os.environ.get("KVBUS_REQUIRE_PEERS"):
            pytest.fail(missing)
        pytest.skip(missing)
    for engine in fleet.engines:
        engine.reset_prefix_cache()
    workers = {engine.source: engine.url for engine in fleet.engines}
    # Only kv_aware reads vLLM's ZMQ events (the others are waited on for no socket).
    zmq = {e.source: e.zmq_endpoints for e in fleet.engines if policy == "kv_aware"}
    peer = PeerRouter(
        kind, policy, workers, str(fleet.model), fleet.data_dir,
        kv_sources={w: e[0] for w, e in zmq.items()},
        kv_replay={w: e[1] for w, e in zmq.items()},
        block_size=BLOCK, log_level="warning",
    )  # fmt: skip
    rng = random.Random(11)
    prefix = [f"w{rng.randrange(4, 1024)}" for _ in range(PREFIX_BLOCKS * BLOCK)]
    with peer:
        cached = []
        for _ in range(5):
            words = prefix + [f"w{rng.randrange(4, 1024)}" for _ in range(40)]
            body = {"model": str(fleet.model), "prompt": " ".join(words), "max_tokens": 2}
            status, _, answer = post(f"{peer.url}/v1/completions", body)
            assert status == 200, answer
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            if policy == "kv_aware":
                # Its ZMQ events race the next request: give them time to arrive (in
                # one CI run of five back-to-back requests, none found the prefix).
                time.sleep(0.5)
        lookups = peer.metrics()
    assert cached[0] == 0
    if policy == "kv_aware":
        # It routes on the engines' ZMQ events, which race the next request (no metric
        # says when they are applied): not every request need find the prefix.
        hits = lookups.get('vllm_router_kv_placement_lookups_total{result="hit"}', 0)
        assert hits >= 1 and sum(c >= PREFIX_BLOCKS * BLOCK for c in cached[1:]) >= 1
    else:  # its own tree of what it routed: every later request goes where the prefix is
        assert all(c >= PREFIX_BLOCKS * BLOCK for c in cached[1:]), cached


def test_a_router_with_no_worker_finds_the_sim_engines_on_the_bus(
    fleet: SimFleet, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Each simulated engine advertises its own port, as a vLLM server does its own."""
    process = RouterProcess(tmp_path, {}, "round_robin", nats_server.url, cli=True)
    process.launch()
    try:
        process.wait_ready(ENGINES, timeout=60)
        seen = {complete(process, fleet, list(range(7, 40)))[0] for _ in range(2 * ENGINES)}
        assert seen == {f"{engine.source}/dp0" for engine in fleet.engines}
    finally:
        process.stop()
