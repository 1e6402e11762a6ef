"""`SubscriptionStats`: the counters a subscription and its sequencer keep, one struct
that every part of the sequencer (`kvbus.bus.delivery`, `kvbus.bus.gap_repair`,
`kvbus.bus.hold_limits`) and `kvbus.bus.subscription.Subscription` add to."""

from __future__ import annotations

import msgspec


class SubscriptionStats(msgspec.Struct):
    delivered: int = 0
    resyncs: int = 0
    resyncs_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    duplicates: int = 0
    """Copies dropped, including live copies of messages already repaired from history."""
    stale: int = 0
    """Messages of an epoch older than the newest seen for their source."""
    gaps_repaired: int = 0
    gaps_lost: int = 0
    malformed: int = 0
    oversized: int = 0
    future_version: int = 0
    unknown_kind: int = 0
    skipped_events: int = 0
    """Events inside otherwise good KV batches whose type is unknown or malformed
    (counted when the batch is decoded: when its ``Message.body`` is first read)."""
    implausible: int = 0
    """Envelopes rejected for an epoch ahead of the clock or an unreachable seq."""
    forged: int = 0
    """Envelopes that claim a source other than the one the transport authenticated."""
    evicted_sources: int = 0
    """Sources forgotten because more than ``max_sources`` were tracked."""
    gaps_declared_early: int = 0
    """Gaps declared lost before ``gap_timeout`` because what was held back for them
    exceeded a limit: 65,536 messages for one source, or ``max_held_bytes`` in all."""
    repair_entries: int = 0
    """History entries read searching for missing seqs."""
    repairs_limited: int = 0
    """History searches cut short or skipped because the subscription had read as many
    history entries as it may (one per entry read live, beyond 65,536)."""
    snapshot_reads: int = 0
    """Times the stored snapshots were read (``snapshot=True``)."""
    snapshots: int = 0
    """Snapshots delivered (``snapshot=True``)."""
    transport_errors: int = 0


__all__ = ["SubscriptionStats"]
