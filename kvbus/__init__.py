"""kvbus: an ordered, deduplicated, replayable bus for vLLM KV-cache events and load.

Publish from engine code with `Publisher` (never blocks the caller), consume with
``async for item in kvbus.subscribe(...)``. The transport is chosen by URL
(``memory://``, ``zmq://``, ``nats://``, ``redis://``; default ``$KVBUS_URL``) and its
client library is imported only when first used.
"""

import importlib
from typing import Any

from kvbus import _moved
from kvbus._version import __version__
from kvbus.bus.publisher import Publisher, PublisherStats
from kvbus.bus.subscription import (
    Cursor,
    Message,
    Resync,
    ResyncReason,
    Subscription,
    SubscriptionStats,
    subscribe,
)
from kvbus.wire.envelope import SCHEMA_VERSION, Envelope, Kind
from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LoadMetrics,
    LossNotice,
    SourceStarted,
    SourceStopped,
)

__all__ = [
    "SCHEMA_VERSION",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Cursor",
    "Envelope",
    "KVEventBatch",
    "Kind",
    "LoadMetrics",
    "LossNotice",
    "Message",
    "Publisher",
    "PublisherStats",
    "Resync",
    "ResyncReason",
    "SourceStarted",
    "SourceStopped",
    "Subscription",
    "SubscriptionStats",
    "__version__",
    "subscribe",
]


def __getattr__(name: str) -> Any:
    """``kvbus.metrics`` after a bare ``import kvbus`` (as the README writes it), imported
    on first use: the bus itself never imports its operations code (`kvbus.bus.instruments`)."""
    if name == "metrics":
        return importlib.import_module("kvbus.metrics")
    raise AttributeError(f"module 'kvbus' has no attribute {name!r}")


_moved.install()
