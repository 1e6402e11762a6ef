"""One bus for every command run from a shell, what the commands say about it, the
lag ``kvbus top`` shows after a compaction, and a vLLM server stopped cleanly ending
its engines' epochs (issue 29)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from cluster import VllmServer, make_model

import kvbus
from kvbus import BlockStored, Kind, KVEventBatch, Message, Resync, SourceStopped
from kvbus.cli import main
from kvbus.config import DEFAULT_COMMAND_URL, DEFAULT_URL, resolve_command_url
from kvbus.ops.top import TopReport

from .servers import RedisServer, free_port

SOURCE = "stop-test"


# --- one default bus for the commands --------------------------------------------------


def test_commands_default_to_the_local_nats_and_the_library_to_the_embedded_bus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVBUS_URL", raising=False)
    assert resolve_command_url(None) == (DEFAULT_COMMAND_URL, "default")
    assert DEFAULT_COMMAND_URL == "nats://127.0.0.1:4222"
    monkeypatch.setenv("KVBUS_URL", "redis://bus:6379")
    assert resolve_command_url(None) == ("redis://bus:6379", "KVBUS_URL")
    assert resolve_command_url("nats://other:4222") == ("nats://other:4222", "--url")
    # The library keeps the embedded bus: a publisher and a subscriber in one process.
    monkeypatch.delenv("KVBUS_URL")
    with kvbus.Publisher(source="lib") as publisher:
        assert publisher.url == DEFAULT_URL == "memory://"


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvbus.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def stderr_lines_until(process: subprocess.Popen[str], wanted: str) -> list[str]:
    """Lines of ``process``'s stderr up to one containing ``wanted`` (bounded: 60 s)."""
    assert process.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if wanted in line:
            return lines
    raise AssertionError(f"no {wanted!r} on stderr: {lines}")


@pytest.mark.parametrize("origin", ["default", "KVBUS_URL"])
def test_tail_says_what_it_reads_and_that_the_bus_does_not_answer(origin: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KVBUS_URL", "KVBUS_STREAM")}
    port = free_port()  # nothing listens there
    if origin == "KVBUS_URL":
        env["KVBUS_URL"] = f"redis://:secret@127.0.0.1:{port}"
    tail = run_cli(["tail", "--no-follow"], env)
    try:
        lines = stderr_lines_until(tail, "kvbus tail: reading")
        if origin == "default":
            assert lines[-1].strip() == (
                "kvbus tail: reading stream kv from nats://127.0.0.1:4222 "
                "(the default: set --url or KVBUS_URL)"
            )
            return  # a NATS server may run on this machine: no failure to wait for
        assert lines[-1].strip() == (
            f"kvbus tail: reading stream kv from redis://:***@127.0.0.1:{port} (from KVBUS_URL)"
        )
        lines = stderr_lines_until(tail, "kvbus tail: cannot read")
        assert f"redis://:***@127.0.0.1:{port}" in lines[-1] and "secret" not in "".join(lines)
        assert tail.poll() is None  # still trying: the bus may come up
    finally:
        tail.terminate()
        tail.communicate(timeout=30)


def test_top_and_compact_say_which_bus_they_read(
    memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compact", "--url", memory_url, "--once"]) == 0
    assert main(["top", "--url", memory_url, "--once", "--json", "--settle", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0]
        == f"kvbus compact: folding stream kv of {memory_url} (from --url), snapshots stored once"
    )
    assert err[1] == f"kvbus top: reading streams kv and metrics from {memory_url} (from --url)"


# --- top's lag after a compaction -------------------------------------------------------


def publish_batch(publisher: kvbus.Publisher, stamped: float, first: int) -> None:
    batch = KVEventBatch(
        stamped, [BlockStored([first, first + 1], None, [1] * 32, 16, None, "GPU", None)]
    )
    assert publisher.publish(batch) and publisher.flush()


def top_report(url: str, capsys: pytest.CaptureFixture[bytes]) -> TopReport:
    assert main(["top", "--url", url, "--once", "--json", "--settle", "0"]) == 0
    return msgspec.json.decode(capsys.readouterr().out, type=TopReport)


def test_lag_is_measured_from_the_stream_not_from_a_snapshot(
    memory_url: str, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    publisher = kvbus.Publisher(memory_url, source="lagging")
    try:
        publish_batch(publisher, time.time() - 1000, 1)
        assert main(["compact", "--url", memory_url, "--once"]) == 0
        capsysbinary.readouterr()
        # Only the snapshot stands for the batch now: the compactor stamped it, not the
        # engine, so it tells nothing of the engine's lag.
        (view,) = top_report(memory_url, capsysbinary).workers
        assert view.blocks == {"GPU": 2} and view.event_lag_s is None
        publish_batch(publisher, time.time() - 500, 3)
        (view,) = top_report(memory_url, capsysbinary).workers
        assert view.blocks == {"GPU": 4}
        assert view.event_lag_s is not None and view.event_lag_s >= 500
    finally:
        publisher.close()


# --- a vLLM server stopped cleanly ends its engines' epochs -----------------------------


async def last_items(url: str, stream: str, source: str) -> list[Message | Resync]:
    sub = kvbus.subscribe(stream, url, follow=False, sources=[source])
    items = [item async for item in sub]
    await sub.aclose()
    return items


PUBLISH_THEN_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from kvbus import BlockStored, KVEventBatch
    from kvbus.connectors.vllm_events import KvbusEventPublisher
    publisher = KvbusEventPublisher(0)
    for n in range(3):
        stored = BlockStored([n], None, [1] * 32, 32, None, "GPU", None)
        publisher.publish(KVEventBatch(0.0, [stored]))
    assert publisher.publisher.flush()
    if sys.argv[1] == "clean":
        publisher.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("relay", ["relay", "no-relay"])
@pytest.mark.parametrize("ending", ["killed", "clean"])
async def test_an_engine_killed_on_shutdown_has_its_epoch_ended(
    ending: str, relay: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    """vLLM stops its engine-core processes with SIGKILL. Through a relay (the default on
    Linux), the relay ends the engine's epoch when the engine's end of its socket closes;
    without one (``KVBUS_RELAY=0``), the first vLLM process does, from the engine's
    `Handoff`. Either way exactly one ``SourceStopped`` ends it."""
    from kvbus.connectors.vllm_events import HANDOFF_DIR, stop_for_engines, unstopped_engines

    stream = f"handoff-{ending}-{relay}"
    env = os.environ | {
        "KVBUS_URL": redis_server.url,
        "KVBUS_STREAM": stream,
        "KVBUS_SOURCE": f"engine-{ending}",
        "KVBUS_METRICS_DIR": str(tmp_path),
        "KVBUS_RELAY": "1" if relay == "relay" else "0",
    }
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PUBLISH_THEN_DIE, ending, env=env
    )
    assert await asyncio.wait_for(engine.wait(), 120) == -signal.SIGKILL
    pending = unstopped_engines(tmp_path / HANDOFF_DIR, wait=5)
    assert await stop_for_engines(pending, redis_server.url) == len(pending)
    deadline = time.monotonic() + 30
    while True:  # a relay sends it as it sees the engine gone
        items = await last_items(redis_server.url, stream, f"engine-{ending}/dp0")
        ended = items and isinstance(items[-1], Message) and items[-1].kind == Kind.CONTROL
        if ended or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert not any(isinstance(i, Resync) for i in items)  # SourceStopped follows on: no gap
    assert [type(i.body).__name__ for i in items if isinstance(i, Message)] == [
        "SourceStarted", "KVEventBatch", "KVEventBatch", "KVEventBatch", "SourceStopped"
    ]  # fmt: skip
    # Never a second SourceStopped: the first process ends only what a relay did not.
    assert len(pending) == (1 if ending == "killed" and relay == "no-relay" else 0)


STAT_LOGGER_AND_CONNECTOR_THEN_DIE = textwrap.dedent(
    """
    import os, signal
    from vllm.config import VllmConfig
    from vllm.v1.metrics.stats import SchedulerStats
    from kvbus.connectors.vllm_connector_parts import Faults
    from kvbus.connectors.vllm_connector_records import StepRecords
    from kvbus.connectors.vllm_stats import KvbusStatLogger
    from kvbus.wire.events import BlockDigest
    logger = KvbusStatLogger(VllmConfig())
    logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1), None)
    records = StepRecords({}, 0, Faults("inner"))
    records.digests = [BlockDigest("r", "save", 0, 0, b"d")]
    records.publish_step(1, [])
    for publisher in (logger.publisher, records.publisher):
        assert type(publisher).__name__ == "RelayPublisher", publisher
        assert publisher.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


async def test_the_stat_logger_and_connector_records_of_a_killed_process_end_their_epochs(
    redis_server: RedisServer,
) -> None:
    """vLLM's front end (the stat logger's process) and its engine core (the connector's
    records) publish through relays on a networked bus, as the KV events do: a process
    killed with SIGKILL has each epoch ended by its relay, after what it sent."""
    env = os.environ | {
        "KVBUS_URL": redis_server.url,
        "KVBUS_SOURCE": "killed-front",
        "KVBUS_METRICS_STREAM": "killed-metrics",
    }
    env.pop("KVBUS_RELAY", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STAT_LOGGER_AND_CONNECTOR_THEN_DIE, env=env
    )
    assert await asyncio.wait_for(process.wait(), 120) == -signal.SIGKILL
    expected = {"killed-metrics": "LoadMetrics", "connector": "ConnectorBatch"}
    for stream, body in expected.items():
        deadline = time.monotonic() + 30
        while True:  # the relay sends it as it sees its process gone
            items = await last_items(redis_server.url, stream, "killed-front/dp0")
            last = items[-1] if items else None
            ended = isinstance(last, Message) and isinstance(last.body, SourceStopped)
            if ended or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert not any(isinstance(i, Resync) for i in items), (stream, items)
        names = [type(i.body).__name__ for i in items if isinstance(i, Message)]
        assert names[0] == "SourceStarted" and names[-1] == "SourceStopped", (stream, names)
        assert body in names, (stream, names)


@pytest.fixture
def stopped_server(tmp_path: Path, redis_server: RedisServer) -> Iterator[VllmServer]:
    make_model(tmp_path)
    server = VllmServer(tmp_path, tmp_path, SOURCE, redis_server.url)
    server.launch({"KVBUS_STREAM": "stop-kv", "KVBUS_METRICS_STREAM": "stop-metrics"})
    try:
        server.wait_healthy()
        server.complete(" ".join(f"w{i}" for i in range(100, 180)), 2)
        time.sleep(1)  # a load record after the request
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)  # what `kill` and a supervisor send
        assert server.process.wait(60) == 0, server.log_tail()
        yield server
    finally:
        server.stop()


async def test_a_vllm_server_stopped_with_sigterm_is_shown_stopped(
    stopped_server: VllmServer,
    redis_server: RedisServer,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    for stream in ("stop-kv", "stop-metrics"):
        items = await last_items(redis_server.url, stream, f"{SOURCE}/dp0")
        assert isinstance(items[-1], Message) and isinstance(items[-1].body, SourceStopped), (
            stream,
            items[-3:],
        )
    argv = ["top", "--url", redis_server.url, "--kv-stream", "stop-kv"]
    argv += ["--metrics-stream", "stop-metrics", "--once", "--json", "--settle", "0"]
    assert await asyncio.to_thread(main, argv) == 0
    report = msgspec.json.decode(capsysbinary.readouterr().out, type=TopReport)
    assert [(v.source, v.state) for v in report.workers] == [(f"{SOURCE}/dp0", "stopped")]
