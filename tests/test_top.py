"""``kvbus top``: known traffic from real publishers, read back as a user would."""

from __future__ import annotations

import asyncio
import io
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from kvbus.transports import Record, open_transport

import kvbus
from kvbus.bus.subscription import Message, Resync, ResyncReason
from kvbus.cli import main
from kvbus.ops.top import Fleet, StreamView, TopReport, WorkerView, render
from kvbus.wire.envelope import Kind
from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LoadMetrics,
)

from .conftest import envelope
from .servers import RedisServer, free_port

A, B, C = "engine-a/dp0", "engine-a/dp1", "engine-b/dp0"
_streams = iter(range(1_000_000))


def stored(hashes: list[int | bytes], medium: str = "GPU", block_size: int = 16) -> BlockStored:
    """Blocks stored with their tokens, or (block_size 0) an offloaded copy of them
    named by hash only, as vLLM's offloading connector sends it."""
    tokens = list(range(len(hashes) * block_size))
    return BlockStored(hashes, None, tokens, block_size, None, medium, None)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(time.time(), list(events))  # type: ignore[arg-type]


def load(running: int, waiting: int, usage: float, queries: int, hits: int) -> LoadMetrics:
    return LoadMetrics(
        ts=time.time(),
        running=running,
        waiting=waiting,
        kv_cache_usage=usage,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        kv_cache_blocks=1000,
    )


class Traffic:
    """Three workers with known blocks per medium, load and one announced loss; A and
    B stay open (their publishers are up), C closes (it stopped cleanly)."""

    def __init__(self, url: str, kv: str, metrics: str) -> None:
        self.started = time.time()
        """Before every timestamp the traffic carries."""
        a_kv, b_kv = (kvbus.Publisher(url, stream=kv, source=s) for s in (A, B))
        a_load, b_load = (kvbus.Publisher(url, stream=metrics, source=s) for s in (A, B))
        self.open = [a_kv, b_kv, a_load, b_load]
        a_kv.publish(batch(stored([1, 2, 3, 4, 5])))
        a_kv.publish(batch(stored([1, 2, 3], "CPU", block_size=0)))
        a_kv.publish(batch(BlockRemoved([5], "GPU")))
        a_load.publish(load(5, 1, 0.25, 100, 40), Kind.METRICS)
        a_load.publish(load(3, 2, 0.5, 100, 60), Kind.METRICS)
        b_kv.publish(batch(stored([10, 11])))
        b_kv.publish(batch(stored([10, 11], "STORAGE", block_size=0)))
        b_load.publish(load(0, 0, 0.0, 50, 0), Kind.METRICS)
        with kvbus.Publisher(url, stream=kv, source=C) as c_kv:
            c_kv.publish(batch(stored([20])))
            c_kv.announce_loss()
            c_kv.publish(batch(stored([21])))
        for publisher in self.open:
            assert publisher.flush()

    def close(self) -> None:
        for publisher in self.open:
            publisher.close()


def check_report(report: TopReport, elapsed: float) -> None:
    """Every value the known traffic determines."""
    rows = {v.source: v for v in report.workers}
    assert list(rows) == [A, B, C]  # sorted by source
    a, b, c = rows[A], rows[B], rows[C]
    assert (a.blocks, a.blocks_exact) == ({"GPU": 4, "CPU": 3}, True)
    assert (b.blocks, b.blocks_exact) == ({"GPU": 2, "STORAGE": 2}, True)
    assert (c.blocks, c.blocks_exact) == ({"GPU": 2}, False)  # a kv batch was lost
    assert (a.running, a.waiting, a.kv_cache_usage, a.kv_cache_blocks) == (3, 2, 0.5, 1000)
    assert (a.prefix_cache_queries, a.prefix_cache_hits, a.hit_rate) == (200, 100, 0.5)
    assert (b.running, b.waiting, b.kv_cache_usage, b.hit_rate) == (0, 0, 0.0, 0.0)
    assert (c.running, c.hit_rate, c.heartbeat_age_s) == (None, None, None)
    assert [(v.drops, v.resyncs) for v in (a, b, c)] == [(0, 0), (0, 0), (1, 1)]
    assert [v.state for v in (a, b, c)] == ["up", "up", "stopped"]
    for view in (a, b, c):
        assert view.event_lag_s is not None and 0 <= view.event_lag_s <= elapsed
    for view in (a, b):
        assert view.heartbeat_age_s is not None and 0 <= view.heartbeat_age_s <= elapsed
    totals = report.totals
    assert totals.workers == 3 and totals.stale == 1
    assert totals.blocks == {"GPU": 8, "CPU": 3, "STORAGE": 2}
    assert (totals.running, totals.waiting, totals.drops) == (3, 2, 1)
    assert (totals.prefix_cache_queries, totals.prefix_cache_hits, totals.hit_rate) == (
        250,
        100,
        0.4,
    )
    assert totals.newest_event_age_s == min(v.event_lag_s or 0 for v in (a, b, c))


def names() -> tuple[str, str]:
    n = next(_streams)
    return f"topkv{n}-{time.monotonic_ns()}", f"topm{n}-{time.monotonic_ns()}"


@pytest.fixture
def redis_traffic(redis_server: RedisServer) -> Iterator[tuple[str, str, str, Traffic]]:
    kv, metrics = names()
    traffic = Traffic(redis_server.url, kv, metrics)
    yield redis_server.url, kv, metrics, traffic
    traffic.close()


def test_once_json_from_redis_as_a_user_runs_it(
    redis_traffic: tuple[str, str, str, Traffic],
) -> None:
    """The console script, in its own process, against a real redis-server; with a
    malformed entry on the kv stream, which is counted and skipped."""
    url, kv, metrics, traffic = redis_traffic
    transport = open_transport(url)

    async def garbage() -> None:
        await transport.append(kv, [Record("x", "x:1:1", b"\xc1 not an envelope")])
        await transport.aclose()

    asyncio.run(garbage())
    script = Path(sys.executable).with_name("kvbus")
    command = [str(script), "top", "--url", url, "--kv-stream", kv, "--metrics-stream", metrics]
    command += ["--once", "--json", "--stale-after", "3600"]
    out = subprocess.run(command, capture_output=True, check=True, timeout=120).stdout
    report = msgspec.json.decode(out, type=TopReport)
    check_report(report, time.time() - traffic.started + 0.001)
    assert (report.kv.name, report.metrics.name) == (kv, metrics)
    assert report.kv.stats.malformed == 1 and report.metrics.stats.malformed == 0
    # Three SourceStarted, seven batches and C's SourceStopped; not the garbage.
    assert report.kv.stats.delivered == 11
    assert report.url == url and report.bad_items == 0


def test_once_json_in_process_on_memory(
    memory_url: str, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    traffic = Traffic(memory_url, "kv", "metrics")
    try:
        argv = ["top", "--url", memory_url, "--once", "--json", "--stale-after", "3600"]
        assert main([*argv, "--settle", "0"]) == 0
        report = msgspec.json.decode(capsysbinary.readouterr().out, type=TopReport)
        check_report(report, time.time() - traffic.started + 0.001)
        # --sort and --rows: the most GPU blocks first, one row, totals still over all.
        assert main([*argv, "--settle", "0", "--sort", "gpu", "--rows", "1"]) == 0
        report = msgspec.json.decode(capsysbinary.readouterr().out, type=TopReport)
        assert [v.source for v in report.workers] == [A] and report.totals.workers == 3
    finally:
        traffic.close()


def test_once_table_shows_every_column(memory_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    traffic = Traffic(memory_url, "kv", "metrics")
    try:
        assert main(["top", "--url", memory_url, "--once", "--settle", "0"]) == 0
    finally:
        traffic.close()
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("worker"))
    for column in ("GPU", "CPU", "STORAGE", "hit", "run", "wait", "KV use", "lag", "drops"):
        assert column in header
    row = next(line for line in lines if line.startswith(C)).split()
    assert row[1:3] == ["2~", "0~"] and row[-1] == "stopped"


def test_json_needs_no_rich(memory_url: str) -> None:
    code = (
        "import sys; from kvbus.cli import main; "
        f"main(['top', '--url', '{memory_url}', '--once', '--json', '--settle', '0']); "
        "print('rich' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "False"


def test_schema_describes_the_report(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    assert main(["top", "--schema"]) == 0
    schema = json.loads(capsysbinary.readouterr().out)
    worker = schema["$defs"]["WorkerView"]["properties"]
    for field in ("source", "blocks", "hit_rate", "running", "event_lag_s", "drops"):
        assert field in worker


# --- the fold, item by item (crafted items: logic alone) ---------------------------------


def message(source: str, body: object, *, seq: int = 1, ts: float | None = None) -> Message:
    kind = Kind.METRICS if isinstance(body, LoadMetrics) else Kind.KV
    return Message(source, 1, seq, kind, ts or time.time(), body, b"", 0)  # type: ignore[arg-type]


def views(fleet: Fleet, now: float | None = None) -> dict[str, WorkerView]:
    empty = kvbus.SubscriptionStats()
    streams = StreamView(name="kv", stats=empty), StreamView(name="metrics", stats=empty)
    return {v.source: v for v in fleet.report(*streams, now=now).workers}


def test_losses_make_blocks_inexact_until_the_cache_is_known_again() -> None:
    fleet = Fleet()
    fleet.apply_kv(message(A, batch(stored([1, 2, 3]))))
    fleet.apply_kv(Resync(A, 1, ResyncReason.GAP, (2, 4)))
    fleet.apply_kv(message(A, batch(BlockRemoved([1], "GPU")), seq=5))
    row = views(fleet)[A]
    assert (row.blocks, row.blocks_exact, row.drops) == ({"GPU": 2}, False, 3)
    fleet.apply_kv(message(A, batch(AllBlocksCleared(), stored([7])), seq=6))
    row = views(fleet)[A]
    assert (row.blocks, row.blocks_exact) == ({"GPU": 1}, True)
    # Joining late loses nothing that was sent to this view: no drop, but inexact.
    fleet.apply_kv(Resync(B, 1, ResyncReason.JOINED, (1, 99)))
    fleet.apply_kv(message(B, batch(BlockRemoved([1, 2], "GPU")), seq=100))
    row = views(fleet)[B]
    assert (row.blocks, row.blocks_exact, row.drops) == ({"GPU": 0}, False, 0)
    # A restart: exact and empty again.
    fleet.apply_kv(Resync(B, 2, ResyncReason.NEW_EPOCH))
    row = views(fleet)[B]
    assert (row.blocks, row.blocks_exact, row.resyncs) == ({}, True, 2)


async def test_blocks_are_counted_from_batches_left_packed(memory_url: str) -> None:
    """From a real subscription: batches of the current dialect are counted without
    decoding their bodies (no int per token id); vLLM's older array dialect is decoded
    and counted the same; the engine's batch timestamp is the event lag's."""
    older = ["BlockStored", [8, 9], None, list(range(32)), 16, None, "CPU", None]
    with kvbus.Publisher(memory_url, source=A) as publisher:
        publisher.publish(batch(stored([1, 2, 3, 4])))
        publisher.publish(batch(stored([1, 2], "CPU", block_size=0), BlockRemoved([4], "GPU")))
        publisher.publish(msgspec.msgpack.encode([123.0, [older], None]))
    fleet, delivered = Fleet(), []
    async with kvbus.subscribe("kv", memory_url, follow=False) as items:
        async for item in items:
            fleet.apply_kv(item)
            if isinstance(item, Message) and item.kind == Kind.KV:
                delivered.append(item)
    assert [item.decoded for item in delivered] == [False, False, True]
    view = views(fleet, now=124.0)[A]
    assert view.blocks == {"GPU": 3, "CPU": 4} and view.blocks_exact
    assert view.event_lag_s == pytest.approx(1.0)


def test_hit_rate_covers_the_window_only() -> None:
    fleet = Fleet(window=60)
    now = time.time()
    old, recent = load(1, 0, 0.1, 1000, 1000), load(2, 0, 0.2, 100, 25)
    fleet.apply_metrics(message(A, msgspec.structs.replace(old, ts=now - 120)))
    fleet.apply_metrics(message(A, msgspec.structs.replace(recent, ts=now - 10), seq=2))
    row = views(fleet, now=now)[A]
    assert (row.hit_rate, row.prefix_cache_queries, row.running) == (0.25, 100, 2)
    row = views(fleet, now=now + 100)[A]
    assert (row.hit_rate, row.prefix_cache_queries, row.state) == (None, 0, "stale")


def test_forged_numbers_cost_nothing_and_show_sane() -> None:
    fleet = Fleet(max_workers=100)
    forged = LoadMetrics(
        ts=math.nan,
        running=-5,
        waiting=2**63 - 1,
        kv_cache_usage=math.inf,
        prefix_cache_queries=-10,
        prefix_cache_hits=10**18,
        kv_cache_blocks=-1,
    )
    fleet.apply_metrics(message(A, forged, ts=math.nan))
    row = views(fleet)[A]
    assert (row.running, row.waiting, row.kv_cache_usage, row.kv_cache_blocks) == (
        0,
        2**63 - 1,
        None,
        None,
    )
    assert (row.hit_rate, row.heartbeat_age_s, row.state) == (None, None, "no-load")
    # Medium names from the network: at most a few per worker, the rest under OTHER.
    media = [stored([i], medium=f"M{i}") for i in range(20)] + [stored([99], "X" * 10_000)]
    fleet.apply_kv(message(B, KVEventBatch(math.inf, media)))  # type: ignore[arg-type]
    row = views(fleet)[B]
    assert len(row.blocks) == 9 and row.blocks["OTHER"] == 13
    assert row.event_lag_s is None
    # Sources beyond max_workers: the idlest are forgotten, the view stays bounded.
    for i in range(1000):
        fleet.apply_kv(message(f"w{i}", batch(stored([i]))))
    assert len(fleet.workers) <= 100 and "w999" in fleet.workers


def test_malformed_messages_are_counted_and_skipped(
    memory_url: str, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Garbage on the stream, a payload that does not decode inside a good envelope,
    and a good message after them: the view carries on and says what it skipped."""
    from .conftest import append_raw, kv_payload

    good = envelope(A, 5, 1, kv_payload(1, blocks=3))
    bad_payload = envelope(A, 5, 2, b"\xc1\xc1")
    after = envelope(A, 5, 3, kv_payload(10, blocks=2))
    metrics_garbage = envelope(B, 5, 1, b"\x93\x01", kind=Kind.METRICS)
    asyncio.run(append_raw(memory_url, [b"garbage", good, b"\x00" * 64, bad_payload, after]))
    asyncio.run(append_raw(memory_url, [metrics_garbage], stream="metrics"))
    assert main(["top", "--url", memory_url, "--once", "--json", "--settle", "0"]) == 0
    report = msgspec.json.decode(capsysbinary.readouterr().out, type=TopReport)
    rows = {v.source: v for v in report.workers}
    assert rows[A].blocks == {"GPU": 5} and not rows[A].blocks_exact and rows[A].drops == 1
    assert rows[B].drops == 1 and rows[B].running is None
    assert report.kv.stats.malformed == 3 and report.metrics.stats.malformed == 1


# --- drawing -----------------------------------------------------------------------------


def test_render_shows_columns_rows_and_what_is_left_out() -> None:
    from rich.console import Console

    fleet = Fleet()
    for i in range(300):
        source = f"engine-{i}/dp0"
        fleet.apply_kv(message(source, batch(stored(list(range(i))), stored([0], "CPU", 0))))
        fleet.apply_metrics(message(source, load(i % 7, i % 3, i / 300, 100, i % 100)))
    streams = (
        StreamView(name="kv", stats=kvbus.SubscriptionStats(malformed=2)),
        StreamView(name="metrics", stats=kvbus.SubscriptionStats()),
    )
    url = "redis://user:secret@bus:6379"
    report = fleet.report(*streams, url=url, sort="gpu", rows=5)
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(report))
    text = console.export_text()
    lines = text.splitlines()
    assert "redis://user:***@bus:6379" in lines[0] and "secret" not in text
    assert "300 workers" in lines[0] and "malformed 2" in lines[0]
    assert "running 897 waiting 300" in lines[1]  # sum(i % 7), sum(i % 3) over 300
    assert lines[2].split() == [
        "worker", "GPU", "CPU", "hit", "run", "wait", "KV", "use", "lag", "drops", "beat", "state",
    ]  # fmt: skip
    first = lines[3].split()
    # The most GPU blocks first: engine-299 holds 299, CPU 1, hit 99%, 299 % 7 running.
    assert first[:7] == ["engine-299/dp0", "299", "1", "99%", "5", "2", "100%"]
    assert first[-1] == "up"
    assert sum(line.startswith("engine-") for line in lines) == 5
    assert "295 more workers" in lines[-1]
    # By name, digit runs as numbers.
    names = [v.source for v in fleet.report(*streams, rows=4).workers]
    assert names == ["engine-0/dp0", "engine-1/dp0", "engine-2/dp0", "engine-3/dp0"]


# --- failures --------------------------------------------------------------------------


def test_once_gives_up_on_a_bus_that_does_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["top", "--url", url, "--once", "--json", "--timeout", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"no history from {url}" in captured.err


def test_a_bad_stream_name_is_a_usage_error() -> None:
    with pytest.raises(SystemExit, match="invalid stream name"):
        main(["top", "--once", "--kv-stream", "a b"])


def test_an_item_the_view_fails_on_is_counted_and_the_rest_shown(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    traffic = Traffic(memory_url, "kv", "metrics")
    traffic.close()
    apply_kv = Fleet.apply_kv

    def fails_on_b(fleet: Fleet, item: Message | Resync, from_snapshot: bool = False) -> None:
        if item.source == B:
            raise RuntimeError("a bug")
        apply_kv(fleet, item, from_snapshot)

    monkeypatch.setattr(Fleet, "apply_kv", fails_on_b)
    assert main(["top", "--url", memory_url, "--once", "--json", "--settle", "0"]) == 0
    report = msgspec.json.decode(capsysbinary.readouterr().out, type=TopReport)
    rows = {v.source: v for v in report.workers}
    assert report.bad_items == 4  # B's SourceStarted, two batches, SourceStopped
    assert rows[A].blocks == {"GPU": 4, "CPU": 3} and rows[B].blocks == {}
