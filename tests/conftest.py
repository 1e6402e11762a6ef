from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import pytest
from kvbus.transports import Record
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus.envelope import SCHEMA_VERSION, Envelope, Kind, encode_envelope
from kvbus.events import BlockStored, KVEventBatch, encode

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


def seqs(items: Iterable[object], source: str | None = None) -> list[int]:
    return [
        i.seq
        for i in items
        if isinstance(i, kvbus.Message) and (source is None or i.source == source)
    ]
