"""What publishing costs the engine's process (issue 34): its whole CPU per KV batch,
every thread counted, beside vLLM's own ``ZmqEventPublisher`` in the same run.

vLLM's EngineCore is one Python loop; whatever else runs in its process (a sender
thread, an asyncio loop, a client library, ZeroMQ's I/O thread) takes CPU and GIL time
from scheduling the next step. Each row here runs in a process of its own, publishing
vLLM ``KVEventBatch`` objects (``--blocks`` blocks of 16 tokens, token ids spread over a
128k vocabulary) at ``--rates`` batches a second, sleeping between them as an engine
between steps, and reports the process's CPU (``getrusage``: all its threads) per batch,
less what the same pacing costs with no publisher. Rows alternate within each round;
the table shows medians of ``--repeats`` rounds and the ratio to vLLM's row.

Rows:

- ``vLLM ZmqEventPublisher``: the baseline (its own thread encodes and sends each batch
  on a PUB socket bound to ipc://).
- ``kvbus memory:// | zmq:// | nats:// | redis://``: `kvbus.Publisher` as the vLLM plugin
  drives it (``publish(batch, Kind.KV)``; encoding, the sender thread and the transport
  client all in the engine's process), against nats-server and redis-server started here.
- ``kvbus RelayPublisher``: `kvbus.bus.relay`, the design chosen from the two rows
  below: the engine encodes and sends each batch on a Unix SEQPACKET socket to a relay
  process it started, which owns the transport's client. The relay's own CPU per batch
  is shown apart (it runs beside the engine, not in its process).
- ``hand-off: unix seqpacket`` and ``hand-off: zmq push``: the candidates for a relay
  (the engine encodes each batch and passes it, without waiting, to another process that
  owns the transport client): one non-blocking ``send`` on a Unix SEQPACKET socket, or a
  ZeroMQ PUSH over ipc:// (ZeroMQ's I/O thread runs in the engine's process). A process
  of their own drains them; its CPU is not counted, as a relay's would not be.

Run: python bench/bench_engine_cost.py [--rates 20,100,1000] [--blocks 16,128]
    [--rows vllm,memory,zmq,nats,redis,relay-zmq,relay-nats,relay-redis,seqpacket,push]
    [--repeats 3] [--seconds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from bench.bench_core import paced_cpu  # noqa: E402

VOCAB = 128_000
ROWS = {
    "vllm": "vLLM ZmqEventPublisher (baseline)",
    "memory": "kvbus Publisher, memory://",
    "zmq": "kvbus Publisher, zmq://",
    "nats": "kvbus Publisher, nats://",
    "redis": "kvbus Publisher, redis://",
    "seqpacket": "hand-off: unix seqpacket send",
    "push": "hand-off: zmq push (ipc://)",
    "relay-zmq": "kvbus RelayPublisher, zmq://",
    "relay-nats": "kvbus RelayPublisher, nats://",
    "relay-redis": "kvbus RelayPublisher, redis://",
}


def vllm_batch(i: int, blocks: int) -> Any:
    """One engine step storing ``blocks`` blocks of 16 tokens, as vLLM builds it."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    hashes = [(i * blocks + b) * 0x9E3779B97F4A7C15 % 2**64 for b in range(blocks)]
    tokens = [(i * blocks * 16 + t) * 0x9E3779B1 % VOCAB for t in range(blocks * 16)]
    stored = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16,
        lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    return KVEventBatch(ts=time.time(), events=[stored], data_parallel_rank=0)


def _drain_seqpacket(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    peer, _ = server.accept()
    while peer.recv(1 << 22):
        pass


def _drain_push(endpoint: str) -> None:
    import zmq

    pull = zmq.Context().socket(zmq.PULL)
    pull.bind(endpoint)
    while True:
        pull.recv_multipart()


def _drainer(target: Callable[[str], None], address: str) -> multiprocessing.Process:
    process = multiprocessing.Process(target=target, args=(address,), daemon=True)
    process.start()
    time.sleep(0.3)
    return process


RELAY_CPU: list[float] = []


def _process_cpu(pid: int) -> float:
    """Seconds of CPU process ``pid`` used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(row: str, rate: float, blocks: int, count: int, url: str, scratch: str) -> float:
    """µs of this process's CPU per batch for ``row`` (run in a process of its own)."""
    import msgspec

    import kvbus

    items = [vllm_batch(i, blocks) for i in range(count)]
    if row == "vllm":
        from vllm.distributed.kv_events import ZmqEventPublisher

        vllm_pub = ZmqEventPublisher(0, endpoint=f"ipc://{scratch}/vllm-{os.getpid()}")
        try:
            return paced_cpu(vllm_pub.publish, items, rate)
        finally:
            vllm_pub.shutdown()
    if row.startswith("relay-"):
        from kvbus.bus.relay import RelayPublisher

        with RelayPublisher(url, stream="cost", source=f"r{os.getpid()}") as relay:
            pid = relay.relay_pid
            assert pid is not None
            relay.publish(items[0], kvbus.Kind.KV)  # its start-up is not counted
            relay.flush(30)
            before = _process_cpu(pid)
            engine = paced_cpu(lambda b: relay.publish(b, kvbus.Kind.KV), items, rate, relay.flush)
            RELAY_CPU.append((_process_cpu(pid) - before) / count * 1e6)
            return engine
    if row in ("memory", "zmq", "nats", "redis"):
        with kvbus.Publisher(url, stream="cost", source=f"e{os.getpid()}") as pub:
            return paced_cpu(lambda b: pub.publish(b, kvbus.Kind.KV), items, rate, pub.flush)
    encoder = msgspec.msgpack.Encoder()
    if row == "seqpacket":
        path = f"{scratch}/s-{os.getpid()}"
        drain = _drainer(_drain_seqpacket, path)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sender.connect(path)
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        sender.setblocking(False)
        try:
            return paced_cpu(lambda b: sender.send(encoder.encode(b)), items, rate)
        finally:
            drain.terminate()
    import zmq

    endpoint = f"ipc://{scratch}/p-{os.getpid()}"
    drain = _drainer(_drain_push, endpoint)
    push = zmq.Context().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 100_000)
    push.connect(endpoint)
    try:
        return paced_cpu(lambda b: push.send(encoder.encode(b), zmq.NOBLOCK), items, rate)
    finally:
        drain.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rates", default="20,100,1000")
    parser.add_argument("--blocks", default="16,128")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="of publishing per row")
    parser.add_argument("--one", nargs=6, metavar=("ROW", "RATE", "BLOCKS", "N", "URL", "DIR"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.one:
        row, rate, blocks, count, url, scratch = args.one
        value = measure(row, float(rate), int(blocks), int(count), url, scratch)
        print(value, *RELAY_CPU)
        return
    from tests.servers import NatsServer, RedisServer, free_port

    rows = [r for r in args.rows.split(",") if r]
    with tempfile.TemporaryDirectory(prefix="kvbus-cost-") as scratch:
        servers: list[Any] = []
        zmq_url = f"zmq://127.0.0.1:{free_port(pair=True)}"
        urls = {"memory": "memory://cost", "zmq": zmq_url, "relay-zmq": zmq_url}
        if "nats" in rows or "relay-nats" in rows:
            (Path(scratch) / "nats").mkdir()
            servers.append(NatsServer(Path(scratch) / "nats"))
            servers[-1].start()
            urls["nats"] = urls["relay-nats"] = servers[-1].url
        if "redis" in rows or "relay-redis" in rows:
            (Path(scratch) / "redis").mkdir()
            servers.append(RedisServer(Path(scratch) / "redis"))
            servers[-1].start()
            urls["redis"] = urls["relay-redis"] = servers[-1].url
        try:
            results = run(rows, args, urls, scratch)
        finally:
            for server in servers:
                server.stop()
    print(f"\npython {platform.python_version()}, {os.cpu_count()} cores; medians of "
          f"{args.repeats} alternating rounds, {args.seconds:g} s of each row")  # fmt: skip
    for blocks in (int(b) for b in args.blocks.split(",")):
        for rate in (float(r) for r in args.rates.split(",")):
            print(f"\n{blocks}-block batches at {rate:g}/s: engine process CPU per batch\n")
            print("| publisher | CPU µs per batch | vs vLLM | relay process's CPU µs |")
            print("| --- | ---: | ---: | ---: |")
            base = statistics.median(results.get(("vllm", rate, blocks), [float("nan")]))
            for row in rows:
                value = statistics.median(results[(row, rate, blocks)])
                relay = results.get((row + " relay", rate, blocks))
                beside = f"{statistics.median(relay):.1f}" if relay else ""
                print(f"| {ROWS[row]} | {value:.1f} | {value / base:.2f}x | {beside} |")


def run(
    rows: list[str], args: argparse.Namespace, urls: dict[str, str], scratch: str
) -> dict[tuple[str, float, int], list[float]]:
    results: dict[tuple[str, float, int], list[float]] = {}
    for round_ in range(args.repeats):
        for blocks in (int(b) for b in args.blocks.split(",")):
            for rate in (float(r) for r in args.rates.split(",")):
                count = max(50, int(rate * args.seconds))
                order = rows[round_ % len(rows) :] + rows[: round_ % len(rows)]
                for row in order:
                    one = [sys.executable, __file__, "--one", row, str(rate), str(blocks),
                           str(count), urls.get(row, "-"), scratch]  # fmt: skip
                    done = subprocess.run(one, capture_output=True, text=True, cwd=ROOT)
                    if done.returncode:
                        raise SystemExit(f"{row}: {done.stderr[-2000:]}")
                    value, *relay = map(float, done.stdout.strip().splitlines()[-1].split())
                    results.setdefault((row, rate, blocks), []).append(value)
                    if relay:
                        results.setdefault((row + " relay", rate, blocks), []).append(relay[0])
                    print(f"round {round_ + 1}: {ROWS[row]}, {blocks} blocks at {rate:g}/s: "
                          f"{value:.1f} µs", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    main()
