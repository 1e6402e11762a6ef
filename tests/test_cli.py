"""The kvbus command, run as a user would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvbus
from kvbus.cli import main

from .conftest import envelope, kv_payload
from .servers import RedisServer


def test_import_kvbus_pulls_in_no_backend_or_engine() -> None:
    code = (
        "import sys, kvbus; heavy = [m for m in ('zmq', 'nats', 'redis', 'torch', 'vllm', "
        "'prometheus_client') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_demo_console_script_prints_what_arrives() -> None:
    script = Path(sys.executable).with_name("kvbus")  # the installed console script
    out = subprocess.run(
        [str(script), "demo", "--steps", "5"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    lines = out.splitlines()
    assert lines[1].startswith("control  demo-engine seq=1") and "SourceStarted" in lines[1]
    assert sum("events=BlockStored" in line for line in lines) == 5
    assert "AllBlocksCleared cached_blocks=0" in out
    assert "delivered 8 messages, 0 resyncs" in lines[-1]


def test_tail_prints_json_lines_and_resumes_from_cursor_file(
    memory_url: str, tmp_path: object, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    import asyncio

    from .conftest import append_raw

    asyncio.run(append_raw(memory_url, [envelope("a", 5, 1), envelope("a", 5, 3)]))
    cursor_file = f"{tmp_path}/cursor.json"
    assert main(["tail", "--url", memory_url, "--no-follow", "--cursor-file", cursor_file]) == 0
    rows = [json.loads(line) for line in capsysbinary.readouterr().out.splitlines()]
    assert [r["type"] for r in rows] == ["message", "resync", "message"]
    assert rows[0]["body"]["events"][0]["type"] == "BlockStored"
    assert rows[1]["reason"] == "gap" and rows[1]["lost"] == [2, 2]
    assert (rows[2]["source"], rows[2]["epoch"], rows[2]["seq"]) == ("a", 5, 3)
    asyncio.run(append_raw(memory_url, [envelope("a", 5, 4)]))
    assert main(["tail", "--url", memory_url, "--no-follow", "--cursor-file", cursor_file]) == 0
    rows = [json.loads(line) for line in capsysbinary.readouterr().out.splitlines()]
    assert [(r["type"], r["seq"]) for r in rows] == [("message", 4)]
    assert kvbus.Cursor.from_bytes(open(cursor_file, "rb").read()).sources["a"].seq == 4


def test_bridge_command_forwards_a_stock_publisher(tmp_path: Path) -> None:
    """``kvbus bridge`` as an operator runs it, against vLLM's own ZmqEventPublisher,
    onto zmq:// (no server), read back with subscribe()."""
    import asyncio
    import time
    import urllib.request

    from vllm.distributed.kv_events import ZmqEventPublisher

    from .servers import free_port
    from .test_conformance import kv_messages

    engine_port, bus_port = free_port(pair=True), free_port(pair=True)
    metrics_port = free_port()
    stock = ZmqEventPublisher(
        0,
        endpoint=f"tcp://*:{engine_port}",
        replay_endpoint=f"tcp://*:{engine_port + 1}",
        topic="",
    )
    script = Path(sys.executable).with_name("kvbus")
    bus = f"zmq://127.0.0.1:{bus_port}"
    bridge = subprocess.Popen(
        [str(script), "bridge", "--from", f"tcp://127.0.0.1:{engine_port}",
         "--replay", f"tcp://127.0.0.1:{engine_port + 1}", "--source", "engine-a", "--to", bus,
         "--metrics-port", str(metrics_port)],
    )  # fmt: skip
    try:
        from vllm.distributed.kv_events import BlockStored as VStored
        from vllm.distributed.kv_events import KVEventBatch as VBatch

        for i in range(5):
            stored = VStored([i], None, list(range(16)), 16, None, "GPU", None)
            stock.publish(VBatch(ts=time.time(), events=[stored]))
        time.sleep(2)  # the bridge replays the engine's buffer on start

        async def read() -> list[kvbus.Message | kvbus.Resync]:
            sub = kvbus.subscribe(url=bus, follow=False)
            return [i async for i in sub]

        items = asyncio.run(read())
        hashes = [m.body.events[0].block_hashes for m in kv_messages(items)]  # type: ignore[union-attr]
        assert hashes == [[0], [1], [2], [3], [4]]
        assert {m.source for m in kv_messages(items)} == {"engine-a"}
        # Its /metrics: the five batches and SourceStarted, all sent.
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
        sent = 'kvbus_publisher_sent_total{source="engine-a",stream="kv"} 6.0'
        dropped = 'kvbus_publisher_dropped_total{source="engine-a",stream="kv"} 0.0'
        assert sent in scraped.decode().splitlines()
        assert dropped in scraped.decode().splitlines()
    finally:
        bridge.terminate()
        bridge.wait(10)
        stock.shutdown()


def test_compact_stores_snapshots_a_late_consumer_starts_from(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvbus compact --once`` on a real Redis, then a consumer with snapshot=True."""
    url = f"{redis_server.url}?maxlen=5"
    with kvbus.Publisher(url, stream="compacted", source="engine", max_batch=1) as publisher:
        publisher.publish(kv_payload(1, blocks=4))
        assert publisher.flush()
        assert main(["compact", "--url", url, "--stream", "compacted", "--once"]) == 0
        for i in range(10):  # enough to trim the first batch away
            publisher.publish(kv_payload(100 + i))
            assert publisher.flush()
        assert main(["compact", "--url", url, "--stream", "compacted", "--once"]) == 0
    # Each run stores the one source's snapshot (the second from the first's and the
    # ten batches since) and says so on success.
    summary = (
        "kvbus compact: snapshots written: 1 (1 source folded); capped: 0 block copies "
        "over --max-copies, 0 sources over --max-blocks (no snapshot)"
    )
    assert capsys.readouterr().out.splitlines() == [summary, summary]

    async def read() -> list[kvbus.Message | kvbus.Resync]:
        sub = kvbus.subscribe("compacted", url, follow=False, snapshot=True)
        return [item async for item in sub]

    items = asyncio.run(read())
    assert not [i for i in items if isinstance(i, kvbus.Resync)]
    first = items[0]
    assert isinstance(first, kvbus.Message) and isinstance(first.body, kvbus.KVEventBatch)
    stored = [
        h for e in first.body.events if isinstance(e, kvbus.BlockStored) for h in e.block_hashes
    ]
    assert stored[:4] == [1, 2, 3, 4]  # the trimmed first batch, from the snapshot


def test_compact_on_zmq_says_it_keeps_no_snapshots() -> None:
    assert main(["compact", "--url", "zmq://127.0.0.1:1", "--once"]) == 2
