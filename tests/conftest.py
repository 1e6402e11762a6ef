from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from kvbus.transports import Record
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus.wire.envelope import SCHEMA_VERSION, Envelope, Kind, encode_envelope
from kvbus.wire.events import BlockStored, KVEventBatch, encode

from .servers import NatsServer, RedisServer, free_port

try:
    from kvbus.routing import _ckernels as ckernels
except ImportError:  # no C compiler at install
    ckernels = None  # type: ignore[assignment]

needs_c = pytest.mark.skipif(ckernels is None, reason="kvbus.routing._ckernels did not build")
subscribe_module = importlib.import_module(
    "kvbus.bus.subscription"
)  # kvbus.subscribe: the function


@contextlib.contextmanager
def scoped_env(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def in_process_engine_env(url: str, source: str) -> contextlib.AbstractContextManager[None]:
    """Environment for a vLLM engine run in this process (tests read its scheduler),
    with the kvbus plugins publishing to ``url``; restored afterwards."""
    return scoped_env(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "KVBUS_URL": url,
            "KVBUS_SOURCE": source,
        }
    )


Item = kvbus.Message | kvbus.Resync

_names = itertools.count()


@pytest.fixture
def memory_url() -> str:
    """A memory:// bus of this test's own."""
    return f"memory://t{next(_names)}-{time.monotonic_ns()}"


def kv_payload(first_hash: int, blocks: int = 1, block_size: int = 16) -> bytes:
    hashes = list(range(first_hash, first_hash + blocks))
    return encode(
        KVEventBatch(
            time.time(),
            [
                BlockStored(
                    hashes, None, list(range(blocks * block_size)), block_size, None, "GPU", None
                )
            ],
        )
    )


def envelope(
    source: str,
    epoch: int,
    seq: int,
    payload: bytes | None = None,
    *,
    kind: Kind = Kind.KV,
    lost_from: int = 0,
    version: int = SCHEMA_VERSION,
) -> bytes:
    return encode_envelope(
        Envelope(
            version,
            kind,
            source,
            epoch,
            seq,
            time.time(),
            payload if payload is not None else kv_payload(seq),
            lost_from,
        )
    )


async def append_raw(url: str, items: Iterable[bytes], stream: str = "kv") -> None:
    """Append already-encoded messages straight to the transport (crafted scenarios)."""
    await MemoryTransport(url).append(stream, [Record("x", str(i), d) for i, d in enumerate(items)])


async def collect(
    url: str, **options: object
) -> tuple[list[kvbus.Message | kvbus.Resync], kvbus.Subscription]:
    """Everything a non-following subscription yields."""
    sub = kvbus.subscribe(url=url, follow=False, **options)  # type: ignore[arg-type]
    items = [item async for item in sub]
    await sub.aclose()
    return items, sub


async def take_then_close(
    sub: kvbus.Subscription, count: int
) -> tuple[list[kvbus.Message | kvbus.Resync], kvbus.Cursor]:
    """The first ``count`` items of ``sub`` and its cursor right after them."""
    items: list[kvbus.Message | kvbus.Resync] = []
    async for item in sub:
        items.append(item)
        if len(items) == count:
            break
    cursor = sub.cursor
    await sub.aclose()
    return items, cursor


def seqs(items: Iterable[object], source: str | None = None) -> list[int]:
    return [
        i.seq
        for i in items
        if isinstance(i, kvbus.Message) and (source is None or i.source == source)
    ]


# --- transports under test: every backend, against real servers ----------------------


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


class Bus:
    """One backend as a test sees it: a URL for publishers and subscribers, and a
    stream name of the test's own."""

    def __init__(self, scheme: str, base: str, retention: str) -> None:
        self.scheme = scheme
        self.base = base
        self.retention = retention
        """The URL option that caps how many messages the backend keeps."""
        self.stream = f"s{next(_names)}"

    def url(self, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"{self.base}{'&' if '?' in self.base else '?'}{query}" if query else self.base

    def publisher(self, source: str, url: str | None = None, **options: Any) -> kvbus.Publisher:
        return kvbus.Publisher(url or self.base, stream=self.stream, source=source, **options)

    def subscribe(self, url: str | None = None, **options: Any) -> kvbus.Subscription:
        return kvbus.subscribe(self.stream, url or self.base, **options)

    def __repr__(self) -> str:
        return self.scheme


BACKENDS = ["memory", "zmq", "nats", "redis"]


@pytest.fixture(params=BACKENDS)
def bus(request: pytest.FixtureRequest) -> Bus:
    scheme = request.param
    if scheme == "memory":
        return Bus(scheme, f"memory://t{next(_names)}-{time.monotonic_ns()}", "maxlen")
    if scheme == "zmq":
        # A short replay timeout: a history read with no publisher up ends after it.
        return Bus(scheme, f"zmq://127.0.0.1:{free_port(pair=True)}?timeout=1", "ring")
    if scheme == "nats":
        server: NatsServer | RedisServer = request.getfixturevalue("nats_server")
        return Bus(scheme, server.url, "max_msgs")
    server = request.getfixturevalue("redis_server")
    return Bus(scheme, server.url, "maxlen")


async def read_until(
    sub: kvbus.Subscription, done: Callable[[list[Item]], bool], timeout: float = 30
) -> list[Item]:
    """Items of a following subscription until ``done(items)``."""
    items: list[Item] = []
    async with asyncio.timeout(timeout):  # not wait_for: see the subscriber's inbox wait
        async for item in sub:
            items.append(item)
            if done(items):
                break
    return items


def last_seq_is(source: str, seq: int) -> Callable[[list[Item]], bool]:
    return lambda items: any(
        isinstance(i, kvbus.Message) and i.source == source and i.seq >= seq for i in items
    )


def lost_seqs(items: Iterable[object]) -> set[int]:
    """Every seq some Resync declared lost."""
    out: set[int] = set()
    for i in items:
        if isinstance(i, kvbus.Resync) and i.lost:
            out.update(range(i.lost[0], i.lost[1] + 1))
    return out


class BatchRecorder:
    """An event publisher standing in for vLLM's own ZMQ one: keeps what it is given."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass
