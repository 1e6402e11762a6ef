"""Property: whatever order, duplication or loss the transport shows, subscribe() yields
each source's present seqs once, in order, and declares exactly the missing ones lost."""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus import Message, Resync, ResyncReason

from .conftest import append_raw, collect, envelope

_buses = itertools.count()


@st.composite
def arrivals(draw: st.DrawFn) -> tuple[list[tuple[str, int]], dict[str, set[int]]]:
    """Per source: seqs 1..n minus some, each shown once or twice, locally shuffled."""
    shown: list[tuple[str, int]] = []
    present: dict[str, set[int]] = {}
    for source in ("a", "b"):
        n = draw(st.integers(1, 30))
        kept = {s for s in range(1, n + 1) if draw(st.integers(0, 9)) > 0 or s == 1}
        present[source] = kept
        shown += [(source, s) for s in sorted(kept) for _ in range(draw(st.integers(1, 2)))]
    keys = [i + draw(st.floats(0, 6)) for i in range(len(shown))]  # bounded displacement
    return [x for _, x in sorted(zip(keys, shown, strict=True))], present


@settings(max_examples=60, deadline=None)
@given(arrivals())
def test_order_dedup_and_exact_loss(
    case: tuple[list[tuple[str, int]], dict[str, set[int]]],
) -> None:
    shown, present = case
    url = f"memory://prop{next(_buses)}"
    asyncio.run(append_raw(url, [envelope(src, 7, seq) for src, seq in shown]))
    items, sub = asyncio.run(collect(url, gap_timeout=60))
    for source, kept in present.items():
        mine = [i for i in items if i.source == source]
        delivered = [i.seq for i in mine if isinstance(i, Message)]
        assert delivered == sorted(kept)
        lost = {
            s
            for i in mine
            if isinstance(i, Resync) and i.lost
            for s in range(i.lost[0], i.lost[1] + 1)
        }
        assert lost == set(range(1, max(kept) + 1)) - kept
        assert all(i.reason is ResyncReason.GAP for i in mine if isinstance(i, Resync))
    # Every extra copy is dropped (a live copy of a message already repaired from
    # history counts too).
    assert sub.stats.duplicates >= len(shown) - sum(len(k) for k in present.values())
