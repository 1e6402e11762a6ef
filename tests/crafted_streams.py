"""Crafted stored entries read through a whole subscription, for comparing the C and
Python kernels: `tests/test_subscribe_runs.py` (a property test) and the sanitizer fuzz
(`scripts/fuzz_kernels_sanitize.py`) share it. No pytest here: the fuzz imports it."""

from __future__ import annotations

import asyncio
import importlib
import itertools
from collections.abc import AsyncIterator, Sequence
from types import ModuleType
from typing import Any

from kvbus.transports import Entry
from kvbus.transports.memory import MemoryTransport

import kvbus
from kvbus.subscribe import Message

subscribe_module = importlib.import_module("kvbus.subscribe")  # kvbus.subscribe: the function
_buses = itertools.count()


class CraftedTransport(MemoryTransport):
    """Hands over crafted entries (senders included) in pages of the given sizes."""

    def __init__(self, entries: list[Entry], sizes: list[int]) -> None:
        super().__init__(f"memory://crafted{next(_buses)}")
        self.entries, self.sizes = entries, sizes

    async def read_pages(
        self, stream: str, after: Any = None, *, follow: bool = False
    ) -> AsyncIterator[Sequence[Entry]]:
        start = 0
        for size in itertools.cycle(self.sizes):
            if start >= len(self.entries):
                return
            yield self.entries[start : start + size]
            start += size


def delivered(
    kernels: ModuleType, entries: list[Entry], sizes: list[int], max_message_bytes: int
) -> tuple[list[Any], Any]:
    """What a subscription using ``kernels`` delivers of ``entries`` (messages as
    tuples, resyncs as they are) and its stats."""
    saved = subscribe_module.kernels
    subscribe_module.kernels = kernels
    try:

        async def read() -> tuple[list[Any], Any]:
            sub = kvbus.subscribe(
                "s", transport=CraftedTransport(entries, sizes), follow=False, gap_timeout=0,
                max_message_bytes=max_message_bytes,
            )  # fmt: skip
            items = [
                (i.source, i.epoch, i.seq, i.kind, i.ts, i.payload, i.position)
                if isinstance(i, Message)
                else i
                async for i in sub
            ]
            await sub.aclose()
            return items, sub.stats

        return asyncio.run(read())
    finally:
        subscribe_module.kernels = saved
