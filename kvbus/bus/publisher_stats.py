"""`PublisherStats`: what a publisher counts, one struct that `kvbus.bus.publisher.Publisher`,
its queue (`kvbus.bus.publisher_queue`) and its sender (`kvbus.bus.publisher_sender`) add
to, and `kvbus.bus.instruments` keeps for the metrics."""

from __future__ import annotations

import msgspec


class PublisherStats(msgspec.Struct):
    published: int = 0
    """Messages accepted by ``publish()``."""
    sent: int = 0
    """Messages the transport accepted."""
    dropped: int = 0
    """Messages lost: queue full, publisher closed, oversized, or unsent at close."""
    send_errors: int = 0
    """Failed append attempts (each is retried)."""
    reconnects: int = 0
    """Appends that succeeded after failed attempts: the backend came back."""
