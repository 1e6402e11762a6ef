"""The bus's own registry of what its publishers and subscriptions count.

Every `kvbus.Publisher` and `kvbus.Subscription` registers here (weakly) when it is made,
and what one had counted is kept here when it is garbage-collected, so that no counter
goes down when an object goes (the router's history read ends before its live read
begins). Operations code (`kvbus.metrics`, its Prometheus collector) reads from here:
the bus never imports it, whether or not metrics are ever served.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import msgspec

if TYPE_CHECKING:
    from kvbus.bus.publisher_stats import PublisherStats
    from kvbus.bus.subscription_stats import SubscriptionStats

_S = TypeVar("_S", bound=msgspec.Struct)

APPEND_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
"""Upper bounds (seconds) of the append latency histogram's buckets (+Inf is implied)."""


class LatencyHistogram:
    """Cumulative-at-read histogram with fixed buckets, cheap enough for a sender thread
    (one bisect and two adds per observation, no lock: one writer)."""

    def __init__(self, bounds: tuple[float, ...] = APPEND_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def add(self, other: LatencyHistogram) -> None:
        """Count ``other``'s observations here too (same bounds)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum


def add_counts(a: _S, b: _S) -> _S:
    """Field-wise sum of two structs of counters of the same type (samples,
    `SubscriptionStats`): numbers and per-key maps added, ``lag_*`` the larger."""
    values: dict[str, Any] = {}
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name.startswith("lag_"):
            values[name] = max(x, y)
        elif isinstance(x, str):
            values[name] = x
        elif isinstance(x, dict):
            values[name] = {k: x.get(k, 0) + y.get(k, 0) for k in {*x, *y}}
        elif isinstance(x, list):
            values[name] = [i + j for i, j in zip(x, y, strict=False)]
        else:
            values[name] = x + y
    return type(a)(**values)


class CountingPublisher(Protocol):
    """What the registry and its readers need of a publisher (`kvbus.Publisher` is one):
    the registry names no class of the bus, so it sits below all of them."""

    @property
    def stream(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def stats(self) -> PublisherStats: ...
    @property
    def append_latency(self) -> LatencyHistogram: ...
    @property
    def queue_messages(self) -> int: ...
    @property
    def queue_bytes(self) -> int: ...


class CountingSubscription(Protocol):
    """What the registry and its readers need of a subscription (`kvbus.Subscription`)."""

    @property
    def stream(self) -> str: ...
    @property
    def stats(self) -> SubscriptionStats: ...
    @property
    def backlog(self) -> int: ...
    @property
    def lag_seconds(self) -> float: ...


publishers: weakref.WeakSet[CountingPublisher] = weakref.WeakSet()
"""This process's live publishers."""
subscriptions: weakref.WeakSet[CountingSubscription] = weakref.WeakSet()
"""This process's live subscriptions."""
# What collected objects had counted, by their labels: (stream, source) for publishers,
# stream for subscriptions (two objects with the same labels are summed).
_retired_publishers: dict[tuple[str, str], tuple[PublisherStats, LatencyHistogram]] = {}
_retired_subscriptions: dict[str, SubscriptionStats] = {}
_retired_lock = threading.Lock()
# What finalizers hand over, merged by the next reader under the lock. A finalizer runs
# wherever the garbage collector happens to run, also inside a reader that holds the
# lock on the same thread: taking the lock there would deadlock, so a finalizer only
# appends (deque.append is atomic) and takes no lock.
_gone_publishers: deque[tuple[str, str, PublisherStats, LatencyHistogram]] = deque()
_gone_subscriptions: deque[tuple[str, SubscriptionStats]] = deque()


def track_publisher(publisher: CountingPublisher) -> None:
    publishers.add(publisher)
    labels_and_counts = (
        publisher.stream,
        publisher.source,
        publisher.stats,
        publisher.append_latency,
    )
    weakref.finalize(publisher, _gone_publishers.append, labels_and_counts)


def track_subscription(subscription: CountingSubscription) -> None:
    subscriptions.add(subscription)
    labels_and_counts = (subscription.stream, subscription.stats)
    weakref.finalize(subscription, _gone_subscriptions.append, labels_and_counts)


def _merge_gone() -> None:
    """Fold what finalizers handed over into the retired counts (the lock held)."""
    while _gone_publishers:
        stream, source, stats, latency = _gone_publishers.popleft()
        # New objects (never changed once stored): what the object counted when it went.
        seen_stats, seen_latency = _retired_publishers.get((stream, source), (type(stats)(), None))
        merged = LatencyHistogram(latency.bounds)
        for counted in (seen_latency, latency):
            if counted is not None:
                merged.add(counted)
        _retired_publishers[stream, source] = (add_counts(seen_stats, stats), merged)
    while _gone_subscriptions:
        stream, counted_stats = _gone_subscriptions.popleft()
        seen = _retired_subscriptions.get(stream) or type(counted_stats)()
        _retired_subscriptions[stream] = add_counts(seen, counted_stats)


def retired_publishers() -> list[tuple[str, str, PublisherStats, LatencyHistogram]]:
    """What collected publishers counted: (stream, source, stats, append latency)."""
    with _retired_lock:
        _merge_gone()
        return [(*labels, *counted) for labels, counted in _retired_publishers.items()]


def retired_subscriptions() -> list[tuple[str, SubscriptionStats]]:
    """What collected subscriptions counted: (stream, stats)."""
    with _retired_lock:
        _merge_gone()
        return list(_retired_subscriptions.items())
