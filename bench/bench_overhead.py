"""Router overhead: the latency each router adds per request over a zero-delay stub.

One stub OpenAI server process (raw asyncio on uvloop, httptools parsing) listens on two
ports: two "workers" that answer ``/v1/completions`` and ``/v1/chat/completions`` at
once (a fixed completion with usage, or, streamed, five SSE events and ``[DONE]``),
plus ``/health``, ``/v1/models``, ``/tokenize`` and vLLM's ``/v1/*/render`` (the token
ids vllm-router cache_aware asks every worker for). The same stub serves every router:

* ``direct``: the client straight to one stub worker (the baseline);
* ``kvbus``: ``kvbus router --policy kv`` (tokenizing with the tiny word-level
  tokenizer of examples/cluster.py, the index, the cost pass), on memory:// with no
  engine publishing KV events; a stand-in stat logger in the router's process sends
  each worker's load every second (without load no worker is eligible). ``kvbus-asyncio``
  is the same router on the stock asyncio loop;
* when installed (examples/peers.py, ``scripts/install.sh peers``): sglang-router 0.3.2
  ``cache_aware``, vllm-router 0.1.17 ``round_robin`` and ``cache_aware``.

Each router is a process of its own in front of the same two stub workers. One
sequential client (keep-alive, ``http.client``) sends, per repeat, per router, per
variant (completion, streamed completion): a warm-up, then ``--requests`` timed
requests, the routers taking turns within a repeat. A request's latency is from the
send to the last byte of the response. Added = router p50 (p99) less direct's p50 (p99)
of the same repeat; the table shows the median over repeats and each added p50 as a
multiple of sglang-router's. CPU µs/request: the CPU time all threads of the router's
processes spent per timed request (the stub's, for direct), which other load on the
machine disturbs less than latency.

    python bench/bench_overhead.py [--repeats 5] [--requests 300] [--warmup 50]
        [--routers direct,kvbus,kvbus-asyncio,sglang-cache_aware,...] [--prompt-words 200]
        [--unique-words N]
        [--stream-events N] [--json FILE]

``--stream-events N``: the streamed variant has N token events, 1 ms apart, each read
and relayed apart (the router's cost per token an engine streams).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "examples")]

from cluster import free_port, make_model  # noqa: E402
from peers import PeerRouter, find_peers  # noqa: E402

MODEL = "m"
PROMPT_WORDS = 200  # tokens (``--prompt-words``)


def prompt(words: int, unique: int = 0, number: int = 0) -> str:
    """A prompt of ``words`` tokens of examples/cluster.py's word-level tokenizer, its
    last ``unique`` drawn for request ``number`` (the rest the same in every prompt)."""
    own = random.Random(number)
    shared = (f"w{3 + i % 1000}" for i in range(words - unique))
    return " ".join([*shared, *(f"w{own.randrange(3, 1024)}" for _ in range(unique))])


def variants(words: int) -> dict[str, dict[str, Any]]:
    """The requests timed: a completion, and the same streamed."""
    completion = {"model": MODEL, "prompt": prompt(words), "max_tokens": 4}
    stream = {**completion, "stream": True, "stream_options": {"include_usage": True}}
    return {"completion": completion, "stream": stream}


PEER_RUNS = {
    "sglang-cache_aware": ("sglang", "cache_aware"),
    "vllm-router-round_robin": ("vllm-router", "round_robin"),
    "vllm-router-cache_aware": ("vllm-router", "cache_aware"),
}
KVBUS_RUNS = {"kvbus": "uvloop", "kvbus-asyncio": "asyncio"}
ROUTERS = ["direct", *KVBUS_RUNS, *PEER_RUNS]


# --- the stub worker -----------------------------------------------------------------

_USAGE = {"prompt_tokens": 200, "completion_tokens": 4, "total_tokens": 204}
_USAGE["prompt_tokens_details"] = {"cached_tokens": 0}  # type: ignore[assignment]
_COMPLETION = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": " w1 w2 w3 w4", "finish_reason": "length"}],
        "usage": _USAGE,
    }
).encode()
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL, "parent": None}]}
).encode()


def _event(text: str, usage: dict[str, Any] | None = None) -> bytes:
    chunk: dict[str, Any] = {"id": "cmpl-stub", "object": "text_completion", "model": MODEL}
    chunk["choices"] = [{"index": 0, "text": text, "finish_reason": None}] if text else []
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


_STREAM = [*(_event(f" w{i}") for i in range(1, 5)), _event("", _USAGE), b"data: [DONE]\n\n"]
EVENT_GAP = 0.001  # s between the token events of ``--stream-events`` (libuv: ms timers)


def _token_stream(events: int) -> list[bytes]:
    """``events`` token events, the usage and ``[DONE]`` (``--stream-events``)."""
    return [*(_event(f" w{3 + i % 1000}") for i in range(events)), *_STREAM[-2:]]


def _token_ids(body: bytes) -> list[int]:
    """Stand-in token ids (a word's number) for /tokenize and /render."""
    request = json.loads(body or b"{}")
    text = request.get("prompt") or json.dumps(request.get("messages", ""))
    if isinstance(text, list):
        text = str(text[0])
    return [3 + len(word) for word in str(text).split()] or [3]


def _stub_answer(
    method: bytes, path: bytes, body: bytes, stream: list[bytes]
) -> tuple[bytes, bytes | list[bytes]]:
    """(content type, body or SSE events) of the stub's answer to one request."""
    json_type = b"application/json"
    if path in (b"/v1/completions", b"/v1/chat/completions"):
        if json.loads(body).get("stream"):
            return b"text/event-stream", stream
        return json_type, _COMPLETION
    if path == b"/v1/models":
        return json_type, _MODELS
    if path == b"/tokenize":
        tokens = _token_ids(body)
        return json_type, json.dumps({"count": len(tokens), "tokens": tokens}).encode()
    if path.endswith(b"/render"):
        rendered: Any = {"request_id": "r", "token_ids": _token_ids(body)}
        rendered = [rendered] if path == b"/v1/completions/render" else rendered
        return json_type, json.dumps(rendered).encode()
    return json_type, b"{}"  # /health, /readiness and whatever a router probes


class _StubProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, parsed by httptools (uvicorn's parser). A stream goes in
    one write, or with ``stream_events``, an event a write, `EVENT_GAP` apart (as an
    engine sends a token at a time: the router relays each)."""

    stream_events = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import httptools

        self.transport: Any = transport  # uvloop's is no asyncio.Transport subclass
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # not HTTP: hang up
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, path = self.parser.get_method(), self.url.split(b"?")[0]
        events = self.stream_events
        stream = _token_stream(events) if events else _STREAM
        kind, answer = _stub_answer(method, path, b"".join(self.body), stream)
        self.url, self.body = b"", []
        head = b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\n"
        if isinstance(answer, list):  # streamed: one chunk per event
            chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in answer]
            chunks[0] = head + b"transfer-encoding: chunked\r\n\r\n" + chunks[0]
            chunks[-1] += b"0\r\n\r\n"
            if not events:
                self.transport.write(b"".join(chunks))
                return
            self.transport.write(chunks[0])
            loop = asyncio.get_running_loop()
            for i, chunk in enumerate(chunks[1:], 1):  # (timers of one ms run in order)
                loop.call_later(i * EVENT_GAP, self.transport.write, chunk)
        else:
            self.transport.write(head + b"content-length: %d\r\n\r\n" % len(answer) + answer)


async def _serve_stub(ports: list[int], stream_events: int) -> None:
    _StubProtocol.stream_events = stream_events
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_StubProtocol, "127.0.0.1", p) for p in ports]
    await _until_signalled()
    for server in servers:
        server.close()


async def _until_signalled() -> None:
    stopping = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stopping.set)
    await stopping.wait()


# --- kvbus router on memory://, with a stand-in stat logger --------------------------


async def _serve_kvbus(port: int, workers: dict[str, str], tokenizer: str) -> None:
    import kvbus
    from kvbus import Kind, LoadMetrics
    from kvbus.routing.router import Router
    from kvbus.service.gateway import RouterApp, start, stop

    url = f"memory://overhead-{os.getpid()}"
    publishers = [kvbus.Publisher(url, stream="metrics", source=f"{n}/dp0") for n in workers]

    async def beat() -> None:
        while True:
            for publisher in publishers:
                load = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
                publisher.publish(load, Kind.METRICS)
            await asyncio.sleep(1)

    beating = asyncio.create_task(beat())
    app = RouterApp(workers, Router("kv"), url, tokenizer)
    served = await start(app, "127.0.0.1", port)
    await _until_signalled()
    beating.cancel()
    await stop(*served)


# --- the client ----------------------------------------------------------------------


def cpu_seconds(session: int) -> float:
    """CPU time of every thread of every process in ``session`` (Linux /proc): a
    router's cost, which other processes on a shared machine disturb less than its
    latency."""
    total_ns = 0
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if (
                proc.name.isdigit()
                and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3]) == session
            ):
                for task in (proc / "task").iterdir():
                    total_ns += int((task / "schedstat").read_text().split()[0])
    return total_ns / 1e9


class Target:
    """A router (or a stub worker, for ``direct``) the client measures; ``session``:
    the process session whose CPU time it costs."""

    def __init__(self, name: str, port: int, session: int, stop: Any = None) -> None:
        self.name, self.port, self.session, self._stop = name, port, session, stop
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(self, body: bytes) -> float:
        """Seconds from the send to the last byte of the answer."""
        headers = {"content-type": "application/json", "content-length": str(len(body))}
        started = time.perf_counter()
        self.connection.request("POST", "/v1/completions", body, headers)
        response = self.connection.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200 or b"usage" not in data:
            raise RuntimeError(f"{self.name}: {response.status} {data[:200]!r}")
        return elapsed

    def reconnect(self) -> None:
        """A fresh keep-alive connection: a router may close one that sat idle while
        the others were measured (one did, mid-run: a broken pipe in the second repeat)."""
        self.connection.close()
        self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def close(self) -> None:
        self.connection.close()
        if self._stop is not None:
            self._stop()


def _child(mode: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, __file__, *mode],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a session of its own: its CPU time (cpu_seconds)
        )


def _stop_child(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_serving(port: int, body: bytes, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"exited ({process.returncode}): {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, RuntimeError, http.client.HTTPException):
            probe = Target("probe", port, process.pid)
            probe.request(body)
            probe.close()
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} never served: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def _wait_healthy(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(600):
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        if response.status == 200:
            break
        time.sleep(0.1)
    connection.close()


@contextlib.contextmanager
def targets(names: list[str], log_dir: Path, stream_events: int = 0) -> Iterator[list[Target]]:
    ports = [free_port(), free_port()]
    workers = {"a": f"http://127.0.0.1:{ports[0]}", "b": f"http://127.0.0.1:{ports[1]}"}
    probe = json.dumps(variants(PROMPT_WORDS)["completion"]).encode()
    stub_args = ["--stub", *map(str, ports), "--stream-events", str(stream_events)]
    stub = _child(stub_args, log_dir / "stub.log")
    started: list[Target] = []
    try:
        for port in ports:
            _wait_serving(port, probe, stub, log_dir / "stub.log")
        peers = find_peers()
        for name in names:
            if name == "direct":
                started.append(Target(name, ports[0], stub.pid))
            elif name in KVBUS_RUNS:
                port, log = free_port(), log_dir / f"{name}.log"
                tokenizer = log_dir / "tokenizer"
                if not tokenizer.exists():
                    make_model(tokenizer)
                worker_args = [f"--worker={w}={u}" for w, u in workers.items()]
                mode = ["--kvbus", str(port), str(tokenizer), KVBUS_RUNS[name], *worker_args]
                process = _child(mode, log)
                started.append(Target(name, port, process.pid, lambda p=process: _stop_child(p)))
                _wait_serving(port, probe, process, log)
                _wait_healthy(port)  # tokenizer loaded: until then it routes by load alone
            elif PEER_RUNS[name][0] in peers:
                kind, policy = PEER_RUNS[name]
                peer = PeerRouter(kind, policy, workers, MODEL, log_dir, log_level="warning")
                peer.start()
                assert peer.process is not None  # in a session of its own
                started.append(Target(name, peer.port, peer.process.pid, peer.stop))
            else:
                print(f"{name}: not installed (examples/peers.py), skipped", file=sys.stderr)
        yield started
    finally:
        for target in started:
            target.close()
        _stop_child(stub)


def measure(target: Target, bodies: list[bytes], warmup: int) -> tuple[list[float], float]:
    """Each request's latency past the first ``warmup`` of ``bodies``, and the target's
    CPU seconds per request."""
    target.reconnect()  # opened in the warm-up, not in the timed requests
    for body in bodies[:warmup]:
        target.request(body)
    cpu = cpu_seconds(target.session)
    latencies = [target.request(body) for body in bodies[warmup:]]
    return latencies, (cpu_seconds(target.session) - cpu) / len(latencies)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """{variant: {router: {p50, p99, added_p50, added_p99, cpu_us}}} (ms; cpu: µs per
    request), medians over repeats."""
    samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    unique = args.prompt_words if args.unique_words is None else args.unique_words
    with (
        tempfile.TemporaryDirectory() as tmp,
        targets(args.routers, Path(tmp), args.stream_events) as started,
    ):
        for repeat in range(args.repeats):
            for v, (variant, request) in enumerate(variants(args.prompt_words).items()):
                first = (2 * repeat + v) * (args.warmup + args.requests)
                bodies = [  # the same for every router
                    json.dumps(request | {"prompt": prompt(args.prompt_words, unique, n)}).encode()
                    for n in range(first, first + args.warmup + args.requests)
                ]
                for target in started:
                    latencies, cpu = measure(target, bodies, args.warmup)
                    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
                    samples.setdefault((variant, target.name), []).append((p50, p99, cpu))
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for (variant, name), runs in samples.items():
        pairs = list(zip(runs, samples[(variant, "direct")], strict=True))
        table.setdefault(variant, {})[name] = {
            "p50": 1e3 * statistics.median(r[0] for r in runs),
            "p99": 1e3 * statistics.median(r[1] for r in runs),
            "added_p50": 1e3 * statistics.median(r[0] - d[0] for r, d in pairs),
            "added_p99": 1e3 * statistics.median(r[1] - d[1] for r, d in pairs),
            "cpu_us": 1e6 * statistics.median(r[2] for r in runs),
        }
    return table


def print_table(table: dict[str, dict[str, dict[str, float]]]) -> None:
    print(
        "| variant | router | p50 ms | p99 ms | added p50 ms | added p99 ms | x sglang "
        "| CPU µs/request |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant, rows in table.items():
        base = rows.get("sglang-cache_aware", {}).get("added_p50")
        for name, row in rows.items():
            ratio = f"{row['added_p50'] / base:.2f}" if base and name != "direct" else "-"
            print(
                f"| {variant} | {name} | {row['p50']:.3f} | {row['p99']:.3f} | "
                f"{row['added_p50']:.3f} | {row['added_p99']:.3f} | {ratio} | "
                f"{row['cpu_us']:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--unique-words",
        type=int,
        help="each request's last N tokens its own, the rest the same in every prompt "
        "(default: --prompt-words, every prompt its own; 0: every prompt the same)",
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--routers", type=lambda s: s.split(","), default=ROUTERS)
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument(
        "--prompt-words", type=int, default=PROMPT_WORDS, help="the prompt's length in tokens"
    )
    parser.add_argument(
        "--stream-events",
        type=int,
        default=0,
        help="token events a stream has, each written apart (default: 4, written at once)",
    )
    # The child processes: the stub, and a kvbus router with its stand-in stat logger.
    parser.add_argument("--stub", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--kvbus", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.unique_words is not None and not 0 <= args.unique_words <= args.prompt_words:
        parser.error("--unique-words must be between 0 and --prompt-words")
    import uvloop

    if args.stub:
        uvloop.run(_serve_stub(args.stub, args.stream_events))
    elif args.kvbus:
        port, tokenizer, loop = args.kvbus
        workers = dict(w.split("=", 1) for w in args.worker)
        serving = _serve_kvbus(int(port), workers, tokenizer)
        if loop == "uvloop":
            from kvbus.service.gateway import run as run_router  # as `kvbus router` runs

            run_router(serving)
        else:
            asyncio.run(serving)
    else:
        table = run(args)
        print_table(table)
        if args.json:
            args.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
