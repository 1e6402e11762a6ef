"""Subscriber hot path: 16-block batches/s through ``kvbus.subscribe()`` beside the
baselines, in one run (print a table of medians over repeats and ratios).

Baselines: vLLM's own decoder (``msgspec`` decode of ``vllm.distributed.kv_events.
KVEventBatch`` from the same bytes, nothing else) and the raw redis-py client (``XRANGE``
pages of 512 entries, one batch per entry, each decoded with vLLM's decoder).

kvbus rows, on ``memory://`` and ``redis://`` (a real redis-server on a free port):

* ``Transport.read()`` alone: envelopes out of the transport, not decoded;
* ``subscribe(follow=False)``: replay of the retained history, ordered, deduplicated,
  each batch checked to decode (the body itself is decoded when first read);
* the same with the consumer reading every ``item.body`` (most consumers) or
  ``item.packed_events`` (as the prefix index does);
* live following: ``subscribe()`` on the live tail while the stream is appended to in
  the same event loop (512 envelopes per append, as a publisher's sender under load).

The stream is what a publisher stores: one source, seqs 1..N, 512 envelopes per append
(a pack of 512 per Redis entry), as a sender under load hands them over; ``--per-append 1``
stores one per entry, as a publisher at production rates does (one batch per wake-up).

Run: python bench/bench_subscribe.py [--repeats 5] [--batches 50000] [--per-append 512]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbus.transports import Record, open_transport

import kvbus
from bench.bench_core import batch16
from bench.bench_transports import _VolatileRedis, repeat
from kvbus.wire.envelope import Envelope, Kind, encode_envelope
from kvbus.wire.events import encode

CHUNK = 512
OLD_FIGURE = 166_000
"""subscribe(follow=False) over redis:// before issue 14 (BENCHMARKS.md, issue 3)."""


def records_of(payloads: list[bytes]) -> list[Record]:
    epoch = time.time_ns()
    out = []
    for seq, payload in enumerate(payloads, 1):
        envelope = Envelope(1, Kind.KV, "bench", epoch, seq, time.time(), payload)
        out.append(Record("bench", envelope.msg_id, encode_envelope(envelope)))
    return out


async def fill(url: str, stream: str, records: list[Record], per_append: int = CHUNK) -> None:
    """Store ``records`` as a publisher would, ``per_append`` at a time: a publisher's
    sender hands over what is queued when it wakes, up to 512, and a Redis entry holds
    one append. At production rates (an engine step every 10-50 ms) that is 1."""
    transport = open_transport(url)
    for first in range(0, len(records), per_append):
        await transport.append(stream, records[first : first + per_append])
    await transport.aclose()


class Rate(NamedTuple):
    wall: float
    """Batches per second of wall-clock time."""
    cpu: float
    """Batches per second of this process's CPU time: what the path costs, even on a
    machine shared with other jobs (the Redis server's own CPU is not in it)."""


class Stopwatch:
    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rate(self, count: int) -> Rate:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        return Rate(count / wall, count / max(cpu, 1e-9))


def vllm_decode(payloads: list[bytes]) -> Rate:
    from vllm.distributed.kv_events import KVEventBatch as VBatch

    decoder = msgspec.msgpack.Decoder(VBatch)
    watch = Stopwatch()
    for payload in payloads:
        decoder.decode(payload)
    return watch.rate(len(payloads))


async def redis_raw_replay(url: str, payloads: list[bytes]) -> Rate:
    """redis-py as one would use it: one entry per batch, XRANGE pages, decode each."""
    import redis.asyncio as redis
    from vllm.distributed.kv_events import KVEventBatch as VBatch

    client = redis.Redis.from_url(url)
    key = f"raw{time.monotonic_ns()}"
    pipe = client.pipeline(transaction=False)
    for payload in payloads:
        pipe.xadd(key, {"d": payload})
    await pipe.execute()
    decoder = msgspec.msgpack.Decoder(VBatch)
    watch, last, count = Stopwatch(), b"-", 0
    while entries := await client.xrange(key, last, "+", count=CHUNK):
        count += len([decoder.decode(fields[b"d"]) for _, fields in entries])
        last = b"(" + entries[-1][0]
    rate = watch.rate(count)
    await client.delete(key)
    await client.aclose()
    return rate


async def transport_read(url: str, stream: str, expected: int) -> Rate:
    transport = open_transport(url)
    watch = Stopwatch()
    count = sum([1 async for _ in transport.read(stream)])
    rate = watch.rate(count)
    await transport.aclose()
    assert count == expected, count
    return rate


async def consume(sub: kvbus.Subscription, expected: int, read: str) -> int:
    """Take ``expected`` messages, reading each one's ``read``: "" (nothing), "body"
    (decoded events, as most consumers), "packed" (``packed_events``, as the prefix index)."""
    count = events = 0
    async for item in sub:
        if isinstance(item, kvbus.Message):
            count += 1
            if read == "body":
                events += len(item.body.events)  # type: ignore[union-attr]
            elif read == "packed":
                events += len(item.packed_events or ())
            if count == expected:
                break
    assert count == expected, count
    assert not read or events == expected, events
    assert sub.stats.resyncs == 0, sub.stats
    return count


async def subscribe_replay(url: str, stream: str, expected: int, read: str) -> Rate:
    watch = Stopwatch()
    async with kvbus.subscribe(stream, url, follow=False) as sub:
        await consume(sub, expected, read)
    return watch.rate(expected)


async def subscribe_live(url: str, records: list[Record], read: str) -> Rate:
    """From the first append until the subscriber following the live tail has every
    message: appends of 512 envelopes interleaved with the subscriber in one loop."""
    stream = f"live{time.monotonic_ns()}"
    transport = open_transport(url)
    await transport.append(stream, records[:1])  # the subscriber's start position
    async with kvbus.subscribe(stream, url) as sub:
        async for _first in sub:
            break

        async def produce() -> None:
            for first in range(1, len(records), CHUNK):
                await transport.append(stream, records[first : first + CHUNK])
                await asyncio.sleep(0)

        watch = Stopwatch()
        producer = asyncio.create_task(produce())
        await consume(sub, len(records) - 1, read)
        rate = watch.rate(len(records) - 1)
        await producer
    await transport.aclose()
    return rate


def table(title: str, rows: dict[str, list[Rate]], baseline: str) -> None:
    """Medians (wall clock and CPU time), their ratios to ``baseline``'s, and the wall
    rate's to the subscriber's before issue 14."""
    wall = {name: statistics.median(r.wall for r in rates) for name, rates in rows.items()}
    cpu = {name: statistics.median(r.cpu for r in rates) for name, rates in rows.items()}
    print(f"\n{title}")
    print(f"{'path':58} {'wall /s':>9} {'CPU /s':>9} {'x base':>7} {'x b.CPU':>7} {'x 166k':>7}")
    for name in rows:
        ratios = wall[name] / wall[baseline], cpu[name] / cpu[baseline], wall[name] / OLD_FIGURE
        print(f"{name:58} {wall[name]:9.0f} {cpu[name]:9.0f}", *(f"{r:7.2f}" for r in ratios))


def kvbus_rows(
    rows: dict[str, list[Rate]], url: str, records: list[Record], name: str, per_append: int
) -> None:
    n = len(records)
    stream = f"replay{time.monotonic_ns()}"
    asyncio.run(fill(url, stream, records, per_append))
    repeat(
        rows,
        f"kvbus {name} Transport.read() (not decoded)",
        lambda: asyncio.run(transport_read(url, stream, n)),
    )
    reads = (("", ""), ("body", " + item.body"), ("packed", " + item.packed_events"))
    for read, suffix in reads:
        repeat(
            rows,
            f"kvbus {name} subscribe(follow=False){suffix}",
            lambda r=read: asyncio.run(subscribe_replay(url, stream, n, r)),
        )
    for read, suffix in reads:
        repeat(
            rows,
            f"kvbus {name} subscribe() live{suffix}",
            lambda r=read: asyncio.run(subscribe_live(url, records, r)),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["memory", "redis"], help="skip the other backend")
    parser.add_argument(
        "--per-append",
        type=int,
        default=CHUNK,
        help="envelopes per stored append (a Redis entry): 512 as under load, 1 as a "
        "publisher at production rates writes them",
    )
    args = parser.parse_args()
    n = args.batches
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"
    )
    payloads = [encode(batch16(i)) for i in range(n)]
    records = records_of(payloads)

    if args.only != "redis":
        rows: dict[str, list[Rate]] = {}
        for r in range(args.repeats):
            repeat(rows, "vLLM decoder alone (baseline)", lambda: vllm_decode(payloads))
            kvbus_rows(
                rows, f"memory://bench{r}?maxlen={n + 10}", records, "memory://", args.per_append
            )
        table(f"memory://, {n} batches, median of {args.repeats}", rows, next(iter(rows)))

    if args.only != "memory":
        with tempfile.TemporaryDirectory() as tmp:
            server = _VolatileRedis(Path(tmp))
            server.start()
            rows = {}
            url = server.url + "?maxlen=0"
            for _ in range(args.repeats):
                repeat(rows, "vLLM decoder alone", lambda: vllm_decode(payloads))
                repeat(
                    rows,
                    "raw redis-py XRANGE pages + vLLM decoder (baseline)",
                    lambda: asyncio.run(redis_raw_replay(server.url, payloads)),
                )
                kvbus_rows(rows, url, records, "redis://", args.per_append)
            server.stop()
        title = f"redis://, {n} batches, {args.per_append} per entry, median of {args.repeats}"
        table(title, rows, list(rows)[1])


if __name__ == "__main__":
    main()
