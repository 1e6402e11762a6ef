"""Prefill/decode disaggregation through the router, on two real vLLM CPU engines whose
KV connector (KvbusConnector around tests/kv_inner.py's HandoffConnector) moves KV
through shared storage the way NIXL does, by the request's ``kv_transfer_params``: the
prefill engine stores a prompt's KV and names it in its answer, and the decode engine
loads only what a request hands it. Each engine advertises its role (``KVBUS_ROLE``);
the router is given them as plain ``--worker``s."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import BLOCK, RouterProcess, VllmServer, make_model
from cluster import post_json as post

from kvbus import Kind, Message
from kvbus.wire.events import ConnectorBatch

from .conftest import collect
from .servers import NatsServer

ROOT = Path(__file__).resolve().parent.parent
ROLES = {"p": "prefill", "d": "decode"}


def transfer_config(role: str, storage: Path) -> str:
    return json.dumps(
        {
            "kv_connector": "KvbusConnector",
            "kv_connector_module_path": "kvbus.connectors.vllm_connector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "inner": {
                    "kv_connector": "HandoffConnector",
                    "kv_connector_module_path": "tests.kv_inner",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                }
            },
        }
    )


class Fleet:
    def __init__(self, directory: Path, nats: NatsServer) -> None:
        self.model = directory / "model"
        self.model.mkdir()
        make_model(self.model)
        storage = directory / "kv"
        storage.mkdir()
        self.engines = {
            name: VllmServer(
                directory,
                self.model,
                name,
                nats.url,
                blocks=64,
                extra_args=["--kv-transfer-config", transfer_config(role, storage)],
            )
            for name, role in (("p", "kv_producer"), ("d", "kv_consumer"))
        }
        self.router = RouterProcess(
            directory,
            {name: engine.url for name, engine in self.engines.items()},
            "kv",
            nats.url,
            ["--connector-stream", "connector"],
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("pd"), nats_server)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        for name, engine in fleet.engines.items():
            engine.launch({**env, "KVBUS_ROLE": ROLES[name]})
        for engine in fleet.engines.values():
            engine.wait_healthy(300)
        fleet.router.launch()
        fleet.router.wait_ready(2, timeout=60)
        yield fleet
    finally:
        fleet.router.stop()
        for engine in fleet.engines.values():
            engine.stop()


def prompt(seed: int, length: int = 150) -> list[int]:
    """Token ids (the tiny model's words are ids 3..1023) of a prompt of its own."""
    return [3 + (seed * 977 + i * 31) % 1000 for i in range(length)]


def complete(
    url: str, tokens: list[int], model: str, **more: Any
) -> tuple[int, dict[str, str], Any]:
    body = {"model": model, "prompt": tokens, "max_tokens": 6, "temperature": 0.0}
    return post(f"{url}/v1/completions", {**body, "ignore_eos": True, **more})


def counters(router: RouterProcess) -> dict[str, float]:
    """The router's ``kvbus_router_pd_*`` and ``requests`` samples, by name and labels."""
    with urllib.request.urlopen(f"{router.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        if re.match(r"kvbus_router_(pd_\w+|requests)_total\{", line):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def streamed_text(url: str, tokens: list[int], model: str) -> str:
    body = {"model": model, "prompt": tokens, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    text = ""
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["x-kvbus-worker"] == "d/dp0"
        for line in response.read().decode().splitlines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


async def test_prefill_then_decode_gives_the_aggregated_output(
    fleet: Fleet, nats_server: NatsServer
) -> None:
    model = str(fleet.model)
    router = fleet.router
    prompts = [prompt(seed) for seed in range(4)]
    whole = (len(prompts[0]) - 1) // BLOCK * BLOCK  # what the connector moves
    before = counters(router)

    routed = []
    for tokens in prompts:
        status, headers, answer = complete(router.url, tokens, model)
        assert status == 200, answer
        assert headers["x-kvbus-worker"] == "d/dp0"  # the decode hop's worker answers
        # The decode engine loaded the prompt's KV: handed over, not computed again.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
        assert int(headers["x-kvbus-predicted-cached-tokens"]) == whole
        routed.append(answer["choices"][0]["text"])
    after = counters(router)
    prefills = 'kvbus_router_pd_prefills_total{code="200",worker="p/dp0"}'
    assert after[prefills] - before.get(prefills, 0) == 4
    decodes = 'kvbus_router_requests_total{code="200",policy="kv",worker="d/dp0"}'
    assert after[decodes] - before.get(decodes, 0) == 4
    assert not any("p/dp0" in k for k in after if k.startswith("kvbus_router_requests"))

    # The same prompts on the prefill engine alone (aggregated: its connector loads
    # nothing it was not handed, and its prefix cache is emptied first) give the same.
    assert fleet.engines["p"].reset_prefix_cache()
    for tokens, text in zip(prompts, routed, strict=True):
        status, _, direct = complete(fleet.engines["p"].url, tokens, model)
        assert status == 200 and direct["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert direct["choices"][0]["text"] == text

    # Each transfer is on the connector stream: a save by p, a load by d, per prompt.
    items, _ = await collect(nats_server.url, stream="connector")
    finished = [
        (item.source, transfer.direction, transfer.tokens)
        for item in items
        if isinstance(item, Message) and item.kind == Kind.CONNECTOR
        and isinstance(item.body, ConnectorBatch)
        for transfer in item.body.transfers
        if transfer.phase == "finished" and transfer.tokens
    ]  # fmt: skip
    assert finished.count(("p/dp0", "save", whole)) >= 4
    assert finished.count(("d/dp0", "load", whole)) == 4


def test_a_stream_is_disaggregated_too(fleet: Fleet) -> None:
    model = str(fleet.model)
    tokens = prompt(40)
    text = streamed_text(fleet.router.url, tokens, model)
    status, _, direct = complete(fleet.engines["p"].url, tokens, model)
    assert status == 200 and direct["choices"][0]["text"] == text != ""


def test_the_prefill_hop_is_skipped_when_the_decode_worker_holds_the_prompt(
    fleet: Fleet,
) -> None:
    model = str(fleet.model)
    tokens = prompt(50)
    status, _, first = complete(fleet.router.url, tokens, model)
    assert status == 200
    before = counters(fleet.router)
    status, headers, again = complete(fleet.router.url, tokens, model)
    assert status == 200 and headers["x-kvbus-worker"] == "d/dp0"
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    after = counters(fleet.router)
    held = 'kvbus_router_pd_prefill_skipped_total{reason="held"}'
    assert after[held] - before.get(held, 0) == 1
    prefills = 'kvbus_router_pd_prefills_total{code="200",worker="p/dp0"}'
    assert after[prefills] == before[prefills]


def test_a_request_the_prefill_engine_refuses_gets_its_error(fleet: Fleet) -> None:
    status, _, answer = complete(fleet.router.url, prompt(60, 2000), str(fleet.model))
    assert status == 400 and "error" in answer, answer


def test_without_its_prefill_engine_the_fleet_serves_aggregated(fleet: Fleet) -> None:
    """The prefill engine dies (its load records still fresh): each request whose
    prefill hop fails goes to the decode engine whole, and none is lost."""
    model = str(fleet.model)
    prompts = [prompt(100 + seed) for seed in range(12)]
    expected = []
    for tokens in prompts:
        status, _, direct = complete(fleet.engines["p"].url, tokens, model)
        assert status == 200
        expected.append(direct["choices"][0]["text"])
    before = counters(fleet.router)
    fleet.engines["p"].kill()
    for tokens, text in zip(prompts, expected, strict=True):
        status, headers, answer = complete(fleet.router.url, tokens, model)
        assert status == 200 and headers["x-kvbus-worker"] == "d/dp0", answer
        assert answer["choices"][0]["text"] == text
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed
    after = counters(fleet.router)
    fallback = 'kvbus_router_pd_prefill_skipped_total{reason="no_prefill_worker"}'
    assert after[fallback] - before.get(fallback, 0) == len(prompts)
