"""Issue 28, what is shown to people and how the commands stop: hostile names drawn by
``kvbus top`` and printed by ``kvbus tail``, the tail's cursor file, SIGTERM, and the
report files of ``KVBUS_METRICS_DIR``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvbus
import kvbus.metrics
from kvbus import cli
from kvbus.bus.subscription import Cursor, Message
from kvbus.cli import main
from kvbus.ops.top import MAX_SHOWN_NAME, Fleet, StreamView, TopReport, displayable, render
from kvbus.wire.envelope import Kind
from kvbus.wire.events import BlockStored, KVEventBatch, LoadMetrics, encode

from .conftest import append_raw, collect, envelope
from .servers import CuttableProxy, RedisServer

HOSTILE = [
    "evil[/bold]x",  # a markup closing tag: rich's MarkupError
    "[link=https://evil.example]click[/link]",
    "clip\x1b]52;c;ZWNobyBwd25lZA==\x07board",  # OSC 52: writes the clipboard
    "clear\x1b[2J\x1b[Hscreen",
    "title\x1b]0;owned\x07",
    "\x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\",  # OSC 8 hyperlink
    "hid\x1b[8mden\x1b[28m",
    "c1\x9b2Jcsi",  # the 8-bit CSI
    "bidi\u202egnp.exe",
    "zero\u200bwidth\u2060joiner",
    "tag\U000e0041s",
    ":smiley: emoji code",
    "long-" + "x" * 190,  # a subscriber takes up to 200 characters; 64 are drawn
]
HOSTILE_MEDIUM = "\x1b[2J\x9b"  # short enough to get a column of its own


def item(source: str, kind: Kind, body: object) -> Message:
    return Message(source, 1, 1, kind, time.time(), body, b"", 0)  # type: ignore[arg-type]


def hostile_report() -> TopReport:
    fleet = Fleet()
    for i, name in enumerate(HOSTILE):
        stored = BlockStored([i], None, list(range(16)), 16, None, HOSTILE_MEDIUM, None)
        fleet.apply_kv(item(name, Kind.KV, KVEventBatch(time.time(), [stored])))
        load = LoadMetrics(ts=time.time(), running=1, waiting=0, kv_cache_usage=0.5)
        fleet.apply_metrics(item(name, Kind.METRICS, load))
    streams = [StreamView(name=n, stats=kvbus.SubscriptionStats()) for n in ("kv", "metrics")]
    return fleet.report(*streams, url="redis://bus:6379?x=\x1b]0;x\x07")


def shown_as_text(text: str) -> None:
    """Nothing in ``text`` but printable characters and line ends."""
    bad = {c for c in text if not c.isprintable() and c != "\n"}
    assert not bad, f"control or format characters reach the terminal: {bad}"


_SGR = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize("terminal", [False, True])
def test_top_draws_hostile_names_as_inert_text(terminal: bool) -> None:
    from rich.console import Console

    out = io.StringIO()
    colours = "standard" if terminal else None
    console = Console(file=out, width=250, force_terminal=terminal, color_system=colours)
    console.print(render(hostile_report()))
    text = out.getvalue()
    if terminal:  # rich's own colours are the only escape sequences left
        text = _SGR.sub("", text)
    shown_as_text(text)
    rows = [line for line in text.splitlines()[3:] if line.strip()]
    assert len(rows) == len(HOSTILE)
    for name in HOSTILE:
        assert any(row.startswith(displayable(name)[:36]) for row in rows), name
    header = text.splitlines()[2]
    assert displayable(HOSTILE_MEDIUM) in header
    assert "redis://bus:6379?x=\\x1b]0;x\\x07" in text.splitlines()[0]


def test_displayable_is_bounded_and_keeps_names_apart() -> None:
    assert displayable("engine-12/dp0") == "engine-12/dp0"
    long = displayable("engine-" + "x" * 1_000_000 + "/dp7")
    assert len(long) == MAX_SHOWN_NAME and long.startswith("engine-") and long.endswith("/dp7")
    assert len(displayable("\x1b" * 1_000_000)) == MAX_SHOWN_NAME
    assert displayable("a\x1bb") != displayable("ab")


def test_top_starts_on_a_retained_hostile_name(
    memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message stays in the stream: every ``kvbus top`` started draws it."""
    payload = encode(KVEventBatch(time.time(), []))
    asyncio.run(append_raw(memory_url, [envelope(n, 1, 1, payload) for n in HOSTILE]))
    assert main(["top", "--url", memory_url, "--once", "--settle", "0"]) == 0
    out = capsys.readouterr().out
    shown_as_text(out)
    assert f"{len(HOSTILE)} workers" in out


def test_json_of_top_and_tail_holds_the_names_and_no_control_character(
    memory_url: str, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """JSON is for programs: the names come back exactly, each unprintable character
    as a \\u escape, so the same output on a terminal draws nothing."""
    payload = encode(KVEventBatch(time.time(), []))
    asyncio.run(append_raw(memory_url, [envelope(n, 1, 1, payload) for n in HOSTILE]))
    assert main(["top", "--url", memory_url, "--once", "--json", "--settle", "0"]) == 0
    out = capsysbinary.readouterr().out.decode()
    shown_as_text(out)
    report = msgspec.json.decode(out, type=TopReport)
    assert sorted(v.source for v in report.workers) == sorted(HOSTILE)

    assert main(["tail", "--url", memory_url, "--no-follow"]) == 0
    out = capsysbinary.readouterr().out.decode()
    shown_as_text(out)
    assert sorted(json.loads(line)["source"] for line in out.splitlines()) == sorted(HOSTILE)


# --- kvbus tail --cursor-file -----------------------------------------------------------


def test_tail_saves_its_cursor_once_not_per_item(
    memory_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    items = 300
    asyncio.run(
        append_raw(memory_url, [envelope(f"s{i % 30}", 1, 1 + i // 30) for i in range(items)])
    )
    cursor_file = tmp_path / "cursor.json"
    writes: list[Path] = []
    write_bytes = Path.write_bytes

    def counted(path: Path, data: bytes) -> int:
        writes.append(path)
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", counted)
    tail = ["tail", "--url", memory_url, "--no-follow", "--cursor-file", str(cursor_file)]
    assert main([*tail, "--cursor-interval", "3600"]) == 0
    assert len(capsysbinary.readouterr().out.splitlines()) == items
    assert len(writes) == 1  # at the end, not per item
    _, sub = asyncio.run(collect(memory_url))
    assert Cursor.from_bytes(cursor_file.read_bytes()) == sub.cursor
    assert not [p for p in tmp_path.iterdir() if p != cursor_file]  # no temporary left


def tail_args(url: str, cursor_file: Path, interval: float) -> argparse.Namespace:
    return argparse.Namespace(
        stream=None,
        url=url,
        source=None,
        latest=False,
        no_follow=False,
        cursor_file=str(cursor_file),
        cursor_interval=interval,
    )


async def until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def saved_seq(cursor_file: Path, source: str) -> int:
    try:
        cursor = Cursor.from_bytes(cursor_file.read_bytes())
    except FileNotFoundError:
        return 0
    at = cursor.sources.get(source)
    return 0 if at is None else at.seq


async def test_a_following_tail_saves_its_cursor_while_it_waits(
    memory_url: str, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    cursor_file = tmp_path / "cursor.json"
    await append_raw(memory_url, [envelope("a", 1, seq) for seq in (1, 2, 3)])
    tail = asyncio.create_task(cli._tail(tail_args(memory_url, cursor_file, 0.05)))
    try:
        await until(lambda: saved_seq(cursor_file, "a") == 3)
        await append_raw(memory_url, [envelope("a", 1, seq) for seq in (4, 5)])
        await until(lambda: saved_seq(cursor_file, "a") == 5)
        assert not tail.done()  # saved by the running tail, not at its exit
    finally:
        tail.cancel()
        await asyncio.gather(tail, return_exceptions=True)
    assert len(capsysbinary.readouterr().out.splitlines()) == 5


def test_a_corrupt_cursor_file_is_a_clear_error(memory_url: str, tmp_path: Path) -> None:
    cursor_file = tmp_path / "cursor.json"
    cursor_file.write_bytes(b'{"position": ')
    with pytest.raises(SystemExit, match="holds no cursor"):
        main(["tail", "--url", memory_url, "--no-follow", "--cursor-file", str(cursor_file)])


# --- SIGTERM -------------------------------------------------------------------------------


def kvbus_command(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvbus.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_stops_tail_with_its_cursor_saved(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    stream, cursor_file = "ops-sigterm-tail", tmp_path / "cursor.json"
    with kvbus.Publisher(redis_server.url, stream=stream, source="e") as publisher:
        for _ in range(20):
            publisher.publish(encode(KVEventBatch(time.time(), [])))
        assert publisher.flush()
    tail = kvbus_command(
        "tail", "--url", redis_server.url, "--stream", stream,
        "--cursor-file", str(cursor_file), "--cursor-interval", "3600",
    )  # fmt: skip
    assert tail.stdout is not None
    lines = [tail.stdout.readline() for _ in range(22)]  # started, 20 batches, stopped
    assert json.loads(lines[-1])["body"]["type"] == "SourceStopped"
    tail.send_signal(signal.SIGTERM)
    assert tail.wait(30) == cli.TERMINATED
    assert saved_seq(cursor_file, "e") == 22


STUBBORN = """
import asyncio, sys
from kvbus import cli

async def stubborn(args):
    print("ready", flush=True)
    while True:  # as a client library that swallows every cancellation
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

sys.exit(cli.run_command(stubborn, None))
"""


def test_sigterm_ends_a_command_that_swallows_its_cancellation() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == cli.TERMINATED
    assert child.stderr is not None and "after SIGTERM" in child.stderr.read()


@pytest.mark.parametrize("outage", ["refused", "stopped"])
async def test_sigterm_stops_compact_during_a_redis_outage(outage: str, tmp_path: Path) -> None:
    """Refused: connections fail at once, and the compactor stops cleanly (it says how
    many snapshots it wrote). Stopped (SIGSTOP): the client waits on a socket that
    never answers; the process ends all the same."""
    import redis.asyncio

    server = RedisServer(tmp_path)
    server.start()
    assert server.process is not None
    proxy = CuttableProxy(server.port)
    await proxy.start()
    stream = "ops-sigterm-compact"
    publisher = kvbus.Publisher(server.url, stream=stream, source="e")
    compact = kvbus_command(
        "compact", "--url", f"redis://127.0.0.1:{proxy.port}", "--stream", stream,
        "--interval", "0.1",
    )  # fmt: skip
    client = redis.asyncio.Redis(port=server.port)
    try:
        # Running: it has stored a snapshot (every --interval once something changed).
        deadline = time.monotonic() + 30
        while not await client.exists(f"kvbus:{stream}:snapshots"):
            assert time.monotonic() < deadline and compact.poll() is None, "compact never ran"
            publisher.publish(encode(KVEventBatch(time.time(), [])))
            await asyncio.sleep(0.2)
        if outage == "refused":
            proxy.cut()
        else:
            os.kill(server.process.pid, signal.SIGSTOP)
        await asyncio.sleep(0.5)  # into its retries, or its wait
        compact.send_signal(signal.SIGTERM)
        status = await asyncio.to_thread(compact.wait, 30)
        assert status == cli.TERMINATED
        assert compact.stdout is not None
        if outage == "refused":
            assert "snapshots written" in compact.stdout.read()
    finally:
        if compact.poll() is None:
            compact.kill()
        os.kill(server.process.pid, signal.SIGCONT)
        publisher.close()
        await client.aclose()
        await proxy.close()
        server.stop()


# --- KVBUS_METRICS_DIR --------------------------------------------------------------------


def publisher_sample(source: str, buckets: int) -> kvbus.metrics.PublisherSample:
    return kvbus.metrics.PublisherSample(
        stream="kv", source=source, published=7, sent=7, dropped=0, send_errors=0,
        reconnects=0, queue_messages=0, queue_bytes=0, append_counts=[1] * buckets,
        append_sum=0.1,
    )  # fmt: skip


def write_report(path: Path, pid: int, buckets: int, source: str) -> None:
    report = kvbus.metrics.Report(pid, [publisher_sample(source, buckets)], [])
    path.write_bytes(msgspec.msgpack.encode(report))


@pytest.fixture
def live_pids() -> Iterator[list[int]]:
    """Pids of live processes other than this one."""
    children = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    yield [c.pid for c in children]
    for child in children:
        child.kill()
        child.wait()


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(directory: Path) -> Series:
    """One scrape, in a thread: a hang fails the test instead of stopping it."""
    registry = CollectorRegistry()
    registry.register(kvbus.metrics.collector(directory))
    result: list[bytes | BaseException] = []

    def run() -> None:
        try:
            result.append(generate_latest(registry))
        except BaseException as error:
            result.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert result, "the scrape hangs"
    if isinstance(result[0], BaseException):
        raise result[0]
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(result[0].decode())
        for s in family.samples
    }


def skipped(series: Series, reason: str) -> float:
    return series.get(("kvbus_metrics_reports_skipped_total", frozenset({("reason", reason)})), 0)


def sent(series: Series, source: str) -> float | None:
    labels = frozenset({("stream", "kv"), ("source", source)})
    return series.get(("kvbus_publisher_sent_total", labels))


def other_buckets(path: Path, pid: int) -> None:
    write_report(path / f"{pid}.msgpack", pid, 3, "other-version")  # another kvbus version


def huge_name(path: Path, pid: int) -> None:
    (path / "99999999999999999999.msgpack").write_bytes(b"")  # os.kill: OverflowError


def fifo(path: Path, pid: int) -> None:
    os.mkfifo(path / f"{pid}.msgpack")  # open() waits for a writer


def link(path: Path, pid: int) -> None:
    (path / f"{pid}.msgpack").symlink_to("/dev/zero")


def oversized(path: Path, pid: int) -> None:
    (path / f"{pid}.msgpack").write_bytes(b"\x00" * (kvbus.metrics.MAX_REPORT_BYTES + 1))


def garbage(path: Path, pid: int) -> None:
    (path / f"{pid}.msgpack").write_bytes(b"\xc1 not msgpack")


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (other_buckets, "mismatched"),
        (huge_name, "name"),
        (fifo, "not_file"),
        (link, "not_file"),
        (oversized, "oversized"),
        (garbage, "malformed"),
    ],
)
def test_a_bad_report_file_is_skipped_and_counted(
    plant: Callable[[Path, int], None], reason: str, tmp_path: Path, live_pids: list[int]
) -> None:
    good, bad = live_pids
    write_report(tmp_path / f"{good}.msgpack", good, len(kvbus.metrics.APPEND_BUCKETS) + 1, "good")
    plant(tmp_path, bad)
    before = scrape(tmp_path / "none")  # no such directory: this process's series only
    try:
        after = scrape(tmp_path)
    finally:
        with contextlib.suppress(OSError):  # a reader stuck opening the FIFO is let go
            os.close(os.open(tmp_path / f"{bad}.msgpack", os.O_WRONLY | os.O_NONBLOCK))
    assert sent(after, "good") == 7  # the good report is read all the same
    assert sent(after, "other-version") is None
    assert skipped(after, reason) - skipped(before, reason) == 1


def test_a_limited_exception_line_carries_its_traceback_once_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvbus.logs import LimitedLog

    limited = LimitedLog(logging.getLogger("kvbus.test.limited"), interval=3600)
    with caplog.at_level(logging.ERROR, logger="kvbus.test.limited"):
        for _ in range(100):
            try:
                raise ValueError("bad item")
            except ValueError:
                limited.exception("apply", "could not apply item from %s", "'\\x1b[2J'")
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is not None
    assert "bad item" in caplog.text


def test_a_backend_that_keeps_failing_is_logged_once_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every retry against a refusing Redis logged a warning (about 20 a second)."""
    from kvbus.bus.retry import log_failure

    logger = logging.getLogger("kvbus.test.retry")
    with caplog.at_level(logging.WARNING, logger="kvbus.test.retry"):
        for _ in range(200):
            error = ConnectionError("refused by redis://:hunter2@127.0.0.1:1")
            log_failure(
                logger, "reading redis://127.0.0.1:1", error, "redis://:hunter2@127.0.0.1:1"
            )
    assert len(caplog.records) == 1
    assert "hunter2" not in caplog.text and "refused" in caplog.text
