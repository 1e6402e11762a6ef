"""Properties of `kvbus.bus.sequencer.Sequencer` alone: no transport, no event loop, no clock.

A model publisher writes a few sources' epochs of seqs, dropping some (announced by a
gap marker on the next message, or by a trailing loss notice) and sending some
malformed; a model store perturbs them (interleaves the sources, duplicates, swaps
neighbours); the live read loses some entries and history has lost some too. The test
drives the sequencer the way `kvbus.bus.subscription.Subscription` does, with its own clock,
and checks what comes out of it:

* per source (until it is forgotten: ``max_sources``) the items are contiguous: each
  message is the seq after the last one delivered or declared lost, each Resync's lost
  range starts there: so each seq is delivered at most once, in increasing order, and
  every seq up to the last one is either delivered or declared lost;
* at the end nothing received is left undelivered or unannounced, and nothing is held;
* no Resync without a cause: a NEW_EPOCH follows a message of that epoch, DROPPED
  covers only seqs the publisher dropped, MALFORMED only a malformed message, GAP and
  JOINED only seqs that never arrived; a stream with no loss gets no Resync but NEW_EPOCH;
* the state stays bounded after every step (``max_sources``, ``max_held``,
  ``max_held_bytes``), and its bookkeeping consistent.
"""

from __future__ import annotations

import ast
import importlib
import random
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus.bus.sequencer import (
    Outcome,
    Resync,
    ResyncReason,
    Sequencer,
    SourceState,
    SubscriptionStats,
)
from kvbus.wire.envelope import Envelope, Kind

MALFORMED = b"M"
LOSS_NOTICE = b"L"
EPOCH_STEP = 1_000


class Delivered(msgspec.Struct, frozen=True):
    source: str
    epoch: int
    seq: int


def open_message(envelope: Envelope, position: int | str) -> Delivered | Outcome:
    if envelope.payload == MALFORMED:
        return Outcome.MALFORMED
    if envelope.payload == LOSS_NOTICE:
        return Outcome.LOSS_NOTICE
    return Delivered(envelope.source, envelope.epoch, envelope.seq)


class Scenario(msgspec.Struct):
    store: list[Envelope]
    """The stream as stored, position ``i + 1`` for entry ``i``."""
    live: list[int]
    """Positions the live read brings, in order."""
    history: list[int]
    """Positions a history search still finds."""
    dropped: dict[str, set[int]]
    """By ``source:epoch``: the seqs the publisher announced lost (loss notices' too)."""
    malformed: dict[str, set[int]]


def key(source: str, epoch: int) -> str:
    return f"{source}:{epoch}"


def publish(
    rnd: random.Random, sources: int, epochs: int, length: int, p: dict[str, float]
) -> Scenario:
    """What a model publisher sends (see the module docstring), then what a store and a
    lossy live read make of it."""
    dropped: dict[str, set[int]] = defaultdict(set)
    malformed: dict[str, set[int]] = defaultdict(set)
    streams: list[list[Envelope]] = []
    for number in range(sources):
        name = f"s{number}"
        sent: list[Envelope] = []
        for epoch_number in range(1, 1 + rnd.randint(1, epochs)):
            epoch = epoch_number * EPOCH_STEP
            run: list[int] = []  # the dropped seqs not announced yet
            for seq in range(1, 1 + rnd.randint(1, length)):
                if rnd.random() < p["drop"]:
                    run.append(seq)
                    continue
                payload = b"x" * rnd.randint(1, 300)
                if rnd.random() < p["malformed"]:
                    payload = MALFORMED
                    malformed[key(name, epoch)].add(seq)
                lost_from = run[0] if run else 0
                dropped[key(name, epoch)].update(run)
                run = []
                sent.append(Envelope(1, Kind.KV, name, epoch, seq, 0.0, payload, lost_from))
            if run and rnd.random() < 0.5:  # trailing drops: a loss notice takes the last
                lost_from = run[0] if len(run) > 1 else 0
                dropped[key(name, epoch)].update(run)
                notice = Envelope(
                    1, Kind.CONTROL, name, epoch, run[-1], 0.0, LOSS_NOTICE, lost_from
                )
                sent.append(notice)
        streams.append(sent)
    store: list[Envelope] = []
    while any(streams):
        store.append(rnd.choice([s for s in streams if s]).pop(0))
    for index in range(len(store)):
        if rnd.random() < p["duplicate"]:
            store.insert(rnd.randint(index, len(store)), store[index])
    for index in range(len(store) - 1):
        if rnd.random() < p["swap"]:
            store[index], store[index + 1] = store[index + 1], store[index]
    positions = range(1, len(store) + 1)
    live = [i for i in positions if rnd.random() >= p["live_loss"]]
    history = [i for i in positions if rnd.random() >= p["history_loss"]]
    return Scenario(store, live, history, dict(dropped), dict(malformed))


class Checker:
    """Follows the items per source (per incarnation: a forgotten source starts over)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.at: dict[str, tuple[int | None, int]] = {}
        """Per source: the epoch of its items and the last seq delivered or declared lost."""
        self.received: dict[str, set[int]] = defaultdict(set)
        """By ``source:epoch``: the seqs received live since the source was last forgotten."""
        self.resyncs: list[Resync] = []
        self.delivered = 0

    def receive(self, envelope: Envelope) -> None:
        self.received[key(envelope.source, envelope.epoch)].add(envelope.seq)

    def forget(self, source: str) -> None:
        self.at.pop(source, None)
        for name in [k for k in self.received if k.rpartition(":")[0] == source]:
            del self.received[name]

    def check(self, items: Iterable[Delivered | Resync]) -> None:
        for item in items:
            epoch, last = self.at.get(item.source, (None, 0))
            if isinstance(item, Delivered):
                assert epoch in (None, item.epoch) and item.seq == last + 1, (item, epoch, last)
                assert item.seq not in self.scenario.malformed.get(key(item.source, item.epoch), ())
                self.at[item.source] = (item.epoch, item.seq)
                self.delivered += 1
                continue
            self.resyncs.append(item)
            name = key(item.source, item.epoch)
            if item.reason is ResyncReason.NEW_EPOCH:
                assert epoch is None or item.epoch > epoch, (item, epoch)
                assert item.previous_epoch is not None and item.previous_epoch < item.epoch
                assert item.lost is None and self.received[name], item
                self.at[item.source] = (item.epoch, 0)
                continue
            assert epoch in (None, item.epoch), (item, epoch)
            assert item.lost is not None and item.lost[0] == last + 1 <= item.lost[1], (item, last)
            lost = set(range(item.lost[0], item.lost[1] + 1))
            if item.reason is ResyncReason.DROPPED:
                assert lost <= self.scenario.dropped.get(name, set()), item
            elif item.reason is ResyncReason.MALFORMED:
                assert lost <= self.scenario.malformed.get(name, set()) and len(lost) == 1, item
            else:  # GAP or JOINED: only seqs that never arrived
                assert (item.reason is ResyncReason.JOINED) == (last == 0), (item, last)
                assert not lost & self.received[name], (item, self.received[name])
            self.at[item.source] = (item.epoch, item.lost[1])


def check_bounded(sequencer: Sequencer[Delivered], caps: dict[str, int]) -> None:
    states = sequencer.states
    assert len(states) <= caps["max_sources"]
    held_bytes = 0
    for state in states.values():
        # Live messages past max_held declare the gap lost; a history search may add
        # at most what it may read (its finds fill the gap: they are delivered next).
        assert len(state.held) <= caps["max_held"] + caps["repair_allowance"]
        assert sorted(state.held) == sorted(state.held_seqs)
        assert all(seq > state.seq for seq in state.held)
        assert bool(state.held) == (state in sequencer.gapped), state.name
        held_bytes += sum(len(h.envelope.payload) + 256 for h in state.held.values())
    assert held_bytes == sequencer.held_bytes.total <= caps["max_held_bytes"]
    assert all(states.get(s.name) is s for s in sequencer.gapped)
    assert sequencer.repair_due <= set(sequencer.gapped)


class Driver:
    """What `Subscription` does around the sequencer, with a model clock and store."""

    def __init__(self, scenario: Scenario, caps: dict[str, int], gap_timeout: float) -> None:
        self.scenario = scenario
        self.items: list[Delivered | Resync] = []
        self.checker = Checker(scenario)
        self.sequencer: Sequencer[Delivered] = Sequencer(
            open_message,
            SubscriptionStats(),
            gap_timeout=gap_timeout,
            max_sources=caps["max_sources"],
            max_held_bytes=caps["max_held_bytes"],
            max_held=caps["max_held"],
            repair_allowance=caps["repair_allowance"],
            on_forget=self.forget,
        )
        self.read_position: int | None = None
        self.now = 0.0

    def drain(self) -> None:
        ready = self.sequencer.ready
        items = [ready.popleft()[0] for _ in range(len(ready))]
        self.items += items
        self.checker.check(items)

    def forget(self, source: str) -> None:
        self.drain()  # what was queued before belongs to the source forgotten
        self.checker.forget(source)

    def search(self, states: Iterable[SourceState]) -> None:
        search = self.sequencer.search_history(list(states), self.read_position)
        if search is None:
            return
        for position in self.scenario.history:
            if search.after is not None and position <= int(search.after):
                continue
            envelope = self.scenario.store[position - 1]
            if not self.sequencer.receive_history(search, envelope, position):
                break
        self.sequencer.history_searched(search)

    def expire(self, *, force: bool) -> None:
        expired = self.sequencer.expiring(self.now, force=force)
        self.search(self.sequencer.unsearched(expired))
        for state in expired:
            self.sequencer.declare_lost(state)
        self.drain()

    def run(self, rnd: random.Random, caps: dict[str, int], steps: tuple[float, ...]) -> None:
        """Feed the live read, ``steps`` apart (drawn from), then end as after a replay."""
        sequencer = self.sequencer
        previous: int | None = None
        for order, position in enumerate(self.scenario.live):
            self.now += rnd.choice(steps)
            deadline = sequencer.next_deadline()
            if deadline is not None and deadline <= self.now:
                self.expire(force=False)
            envelope = self.scenario.store[position - 1]
            self.checker.receive(envelope)
            sequencer.receive(envelope, position, order, previous, self.now)
            sequencer.read_live(1)
            previous = self.read_position = position
            if sequencer.repair_due and rnd.random() < 0.3:  # caught up: search
                self.search(sequencer.repair_due)
            self.drain()
            check_bounded(sequencer, caps)
        if sequencer.repair_due:
            self.search(sequencer.repair_due)
        self.expire(force=True)
        self.drain()
        check_bounded(sequencer, caps)

    def check_complete(self) -> None:
        """Nothing held, and everything received is delivered or declared lost."""
        sequencer = self.sequencer
        assert not sequencer.gapped and sequencer.held_bytes.total == 0
        for name, state in sequencer.states.items():
            assert not state.held
            assert self.checker.at[name] == (state.epoch, state.seq), name
            received = self.checker.received[key(name, state.epoch)]
            assert max(received, default=0) <= state.seq, (name, received, state.seq)


probabilities = st.fixed_dictionaries(
    {
        "drop": st.sampled_from([0.0, 0.1, 0.3]),
        "malformed": st.sampled_from([0.0, 0.05]),
        "duplicate": st.sampled_from([0.0, 0.1, 0.3]),
        "swap": st.sampled_from([0.0, 0.1, 0.4]),
        "live_loss": st.sampled_from([0.0, 0.1, 0.4]),
        "history_loss": st.sampled_from([0.0, 0.2, 1.0]),
    }
)
limits = st.fixed_dictionaries(
    {
        "max_sources": st.sampled_from([1, 2, 3, 100]),
        "max_held": st.sampled_from([1, 3, 1 << 16]),
        "max_held_bytes": st.sampled_from([400, 2_000, 1 << 26]),
        "repair_allowance": st.sampled_from([16, 64, 1 << 16]),
    }
)
lossy_streams: dict[str, st.SearchStrategy[Any]] = {
    # What the publisher, the store and the live read may do (see `publish`), and the limits.
    "seed": st.integers(0, 2**32),
    "sources": st.integers(1, 4),
    "epochs": st.integers(1, 3),
    "length": st.integers(1, 30),
    "p": probabilities,
    "caps": limits,
    "gap_timeout": st.sampled_from([0.0, 1.0]),
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **lossy_streams,
    steps=st.sampled_from([(0.0,), (0.0, 0.3), (0.0, 0.3, 2.0)]),
)
def test_delivery_is_ordered_once_complete_and_every_resync_has_a_cause(
    seed: int,
    sources: int,
    epochs: int,
    length: int,
    p: dict[str, float],
    caps: dict[str, int],
    gap_timeout: float,
    steps: tuple[float, ...],
) -> None:
    rnd = random.Random(seed)
    scenario = publish(rnd, sources, epochs, length, p)
    driver = Driver(scenario, caps, gap_timeout)
    driver.run(rnd, caps, steps)
    driver.check_complete()
    stats = driver.sequencer.stats
    assert stats.delivered == driver.checker.delivered
    assert stats.resyncs == len(driver.checker.resyncs)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    sources=st.integers(1, 4),
    epochs=st.integers(1, 3),
    length=st.integers(1, 30),
    duplicate=st.sampled_from([0.0, 0.3]),
    swap=st.sampled_from([0.0, 0.4]),
)
def test_a_stream_with_no_loss_gets_no_resync_but_new_epochs(
    seed: int, sources: int, epochs: int, length: int, duplicate: float, swap: float
) -> None:
    """Duplicated and reordered, but nothing lost, nothing waited for too long and no cap
    reached: the only Resyncs are the restarts, and every message is delivered once."""
    rnd = random.Random(seed)
    p = {"drop": 0.0, "malformed": 0.0, "duplicate": duplicate, "swap": swap}
    scenario = publish(rnd, sources, epochs, length, p | {"live_loss": 0.0, "history_loss": 0.0})
    caps = {"max_sources": 100, "max_held": 1 << 16, "max_held_bytes": 1 << 26}
    caps["repair_allowance"] = 1 << 16
    driver = Driver(scenario, caps, gap_timeout=1.0)
    driver.run(rnd, caps, steps=(0.0,))
    driver.check_complete()
    assert {r.reason for r in driver.checker.resyncs} <= {ResyncReason.NEW_EPOCH}
    restarts = {(e.source, e.epoch) for e in scenario.store} - {
        (e.source, min(x.epoch for x in scenario.store if x.source == e.source))
        for e in scenario.store
    }
    assert len(driver.checker.resyncs) <= len(restarts)
    # The newest epoch of each source (older ones may be cut short by a reordered restart).
    newest = {
        e.source: max(x.epoch for x in scenario.store if x.source == e.source)
        for e in scenario.store
    }
    for source, epoch in newest.items():
        sent = {e.seq for e in scenario.store if (e.source, e.epoch) == (source, epoch)}
        got = [
            i.seq
            for i in driver.items
            if isinstance(i, Delivered) and (i.source, i.epoch) == (source, epoch)
        ]
        assert got == sorted(sent)


def test_the_sequencer_reads_no_clock() -> None:
    """A gap's deadline is the ``now`` it opened at plus ``gap_timeout``, whatever the time."""
    sequencer: Sequencer[Delivered] = Sequencer(
        open_message, SubscriptionStats(), gap_timeout=0.5, max_sources=10, max_held_bytes=1 << 20
    )
    envelope = Envelope(1, Kind.KV, "a", 1, 2, 0.0, b"x")
    sequencer.receive(envelope, 1, 0, None, now=-1000.0)
    assert sequencer.next_deadline() == -999.5
    assert sequencer.expiring(-999.6, force=False) == []
    (state,) = sequencer.expiring(-999.5, force=False)
    sequencer.declare_lost(state)
    items = [item for item, _, _ in sequencer.ready]
    assert items == [Resync("a", 1, ResyncReason.JOINED, (1, 1)), Delivered("a", 1, 2)]


def test_a_snapshot_that_covers_a_gap_replaces_what_is_missing() -> None:
    sequencer: Sequencer[Delivered | str] = Sequencer(
        open_message, SubscriptionStats(), gap_timeout=0.5, max_sources=10, max_held_bytes=1 << 20
    )
    for seq in (1, 5, 6):
        sequencer.receive(Envelope(1, Kind.KV, "a", 7, seq, 0.0, b"x"), seq, seq, None, 0.0)
    (state,) = sequencer.expiring(1.0, force=False)
    assert not sequencer.snapshot_covers(state, "a", 7, 3)  # seq 4 would still be missing
    assert sequencer.snapshot_covers(state, "a", 7, 4)
    sequencer.substitute(state, 4, "p", "snapshot of a at 4")
    items = [item for item, _, _ in sequencer.ready]
    assert items == [
        Delivered("a", 7, 1),
        Resync("a", 7, ResyncReason.GAP),
        "snapshot of a at 4",
        Delivered("a", 7, 5),
        Delivered("a", 7, 6),
    ]
    assert not sequencer.gapped and sequencer.stats.snapshots == 1


# --- arbitrary interleavings ---------------------------------------------------------
#
# `Driver` feeds the live read in one fixed rhythm. `ScheduledDriver` draws, step by
# step, what happens next as a subscription may make it happen: a live entry (or a run
# of a source's next seqs through the fast path, `accept_run` and `advance`, as
# `Subscription._ingest_page` does), time passing, the gaps due expiring, a history
# search for the new gaps (which may fail part way), the consumer draining what is
# ready. A `Ledger` keeps, per source incarnation and epoch, how often each seq was
# delivered or declared lost, and what was received live.


class Ledger:
    """Per (incarnation of a source, epoch): seq -> how many times it was delivered or
    covered by a Resync's lost range; and the seqs received live."""

    def __init__(self) -> None:
        self.incarnation: dict[str, int] = defaultdict(int)
        self.covered: dict[tuple[str, int, int], dict[int, int]] = defaultdict(
            lambda: defaultdict(int)
        )
        self.received: dict[tuple[str, int, int], set[int]] = defaultdict(set)
        self.gap_resyncs = 0
        """GAP and JOINED Resyncs seen: what declaring a gap lost early must produce."""

    def at(self, source: str, epoch: int) -> tuple[str, int, int]:
        return (source, self.incarnation[source], epoch)

    def receive(self, envelope: Envelope) -> None:
        self.received[self.at(envelope.source, envelope.epoch)].add(envelope.seq)

    def see(self, item: Delivered | Resync) -> None:
        covered = self.covered[self.at(item.source, item.epoch)]
        if isinstance(item, Delivered):
            covered[item.seq] += 1
        elif item.lost is not None:
            for seq in range(item.lost[0], item.lost[1] + 1):
                covered[seq] += 1
            if item.reason in (ResyncReason.GAP, ResyncReason.JOINED):
                self.gap_resyncs += 1

    def check_no_silent_drop(self, source: str, epoch: int) -> None:
        """Everything received live of ``source``'s current ``epoch`` is delivered or
        announced lost (a cap or an eviction declares, it never drops)."""
        at = self.at(source, epoch)
        missing = self.received[at] - set(self.covered[at])
        assert not missing, (at, sorted(missing))

    def forget(self, source: str, epoch: int) -> None:
        self.check_no_silent_drop(source, epoch)
        self.incarnation[source] += 1

    def check_exactly_once(self) -> None:
        """Each seq up to the last one reached is delivered or declared lost exactly once."""
        for at, covered in self.covered.items():
            assert all(count == 1 for count in covered.values()), (at, dict(covered))
            assert set(covered) == set(range(1, max(covered, default=0) + 1)), at


class ScheduledDriver(Driver):
    def __init__(self, scenario: Scenario, caps: dict[str, int], gap_timeout: float) -> None:
        self.ledger = Ledger()
        self.checked = 0
        """Items at the front of the sequencer's ``ready`` already checked."""
        super().__init__(scenario, caps, gap_timeout)
        self.order = 0
        self.previous: int | None = None
        self.live = list(scenario.live)

    def check_ready(self, *, drained: bool) -> None:
        """Check the items put out since the last check, as the original driver does
        after each step (a GAP or JOINED Resync is checked against what had arrived when
        it was put out), but leave them for the consumer to take (`drain`). A trailing
        DROPPED Resync may still grow (`Delivery._dropped_through`): checked later."""
        ready = self.sequencer.ready
        while self.checked < len(ready):
            item = ready[self.checked][0]
            trailing = self.checked == len(ready) - 1
            if not drained and trailing and isinstance(item, Resync):
                if item.reason is ResyncReason.DROPPED:
                    break
            self.ledger.see(item)
            self.checker.check([item])
            self.items.append(item)
            self.checked += 1

    def drain(self) -> None:
        """The consumer takes everything ready."""
        self.check_ready(drained=True)
        self.sequencer.ready.clear()
        self.checked = 0

    def forget(self, source: str) -> None:
        self.drain()
        # A source is forgotten only after its first message was delivered or announced.
        epoch = self.checker.at[source][0]
        assert epoch is not None
        self.ledger.forget(source, epoch)
        self.checker.forget(source)

    def search(self, states: Iterable[SourceState], fail_after: int | None = None) -> None:
        search = self.sequencer.search_history(list(states), self.read_position)
        if search is None:
            return
        for read, position in enumerate(self.scenario.history):
            if search.after is not None and position <= int(search.after):
                continue
            if fail_after is not None and read >= fail_after:
                break  # the backend failed part way: what was read still counts
            envelope = self.scenario.store[position - 1]
            if not self.sequencer.receive_history(search, envelope, position):
                break
        self.sequencer.history_searched(search)

    def run_of(self, rnd: random.Random) -> list[int]:
        """The next live entries that are one source's next plain KV seqs (up to a few)."""
        store = self.scenario.store
        first = store[self.live[0] - 1]
        run = [self.live[0]]
        for position in self.live[1 : rnd.randint(1, 8)]:
            envelope = store[position - 1]
            if (
                (envelope.source, envelope.epoch) != (first.source, first.epoch)
                or envelope.seq != store[run[-1] - 1].seq + 1
                or envelope.lost_from
                or envelope.payload in (MALFORMED, LOSS_NOTICE)
            ):
                break
            run.append(position)
        return run

    def feed(self, rnd: random.Random) -> None:
        """The next live entry, or a run of them through the fast path if it applies."""
        sequencer, store = self.sequencer, self.scenario.store
        run = self.run_of(rnd)
        first, last = store[run[0] - 1], store[run[-1] - 1]
        plain = not first.lost_from and first.payload not in (MALFORMED, LOSS_NOTICE)
        state = sequencer.accept_run(first.source, first.epoch, first.seq, last.seq)
        if plain and state is not None:
            for position in run:
                envelope = store[position - 1]
                self.checker.receive(envelope)
                self.ledger.receive(envelope)
                message = Delivered(envelope.source, envelope.epoch, envelope.seq)
                sequencer.ready.append((message, self.order, None))
                self.order += 1
            sequencer.advance(state, last.seq, self.order - 1, run[-1])
            sequencer.stats.delivered += len(run)
        else:
            run = run[:1]
            self.checker.receive(first)
            self.ledger.receive(first)
            sequencer.receive(first, run[0], self.order, self.previous, self.now)
            self.order += 1
        del self.live[: len(run)]
        sequencer.read_live(len(run))
        self.previous = self.read_position = run[-1]

    def step(self, rnd: random.Random, caps: dict[str, int]) -> None:
        sequencer = self.sequencer
        declared_early, gap_resyncs = sequencer.stats.gaps_declared_early, self.ledger.gap_resyncs
        action = rnd.choices(["live", "tick", "expire", "search", "drain"], [6, 2, 2, 2, 2])[0]
        if action == "live" and self.live:
            self.feed(rnd)
        elif action == "tick":
            self.now += rnd.choice([0.1, 0.6, 2.0])
        elif action == "expire":
            deadline = sequencer.next_deadline()
            if deadline is not None and deadline <= self.now:
                self.expire(force=False)
        elif action == "search" and sequencer.repair_due:
            self.search(sequencer.repair_due, rnd.choice([None, None, 0, 1, 5]))
        elif action == "drain":
            self.drain()
        self.check_ready(drained=False)
        check_bounded(sequencer, caps)
        # A gap declared lost early (max_held, max_held_bytes) is announced at once.
        early = sequencer.stats.gaps_declared_early - declared_early
        assert early <= self.ledger.gap_resyncs - gap_resyncs, early

    def finish(self, rnd: random.Random, caps: dict[str, int]) -> None:
        """The live read ends: as `Driver.run` ends."""
        while self.live:
            self.feed(rnd)
        if self.sequencer.repair_due:
            self.search(self.sequencer.repair_due)
        self.expire(force=True)
        self.drain()
        check_bounded(self.sequencer, caps)
        self.check_complete()
        for name, state in self.sequencer.states.items():
            self.ledger.check_no_silent_drop(name, state.epoch)
        self.ledger.check_exactly_once()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**lossy_streams)
def test_any_interleaving_delivers_each_seq_once_or_announces_it_once(
    seed: int,
    sources: int,
    epochs: int,
    length: int,
    p: dict[str, float],
    caps: dict[str, int],
    gap_timeout: float,
) -> None:
    """Live entries (one by one or as fast-path runs), time, expiries, history searches
    (some failing part way) and the consumer's reads, in any order: per source each seq
    is delivered at most once and in order, each seq up to the last reached is delivered
    or covered by exactly one Resync, nothing received live is dropped unannounced (not
    by ``max_held``, ``max_held_bytes`` nor ``max_sources``), and a gap declared lost
    early is announced at once."""
    rnd = random.Random(seed)
    scenario = publish(rnd, sources, epochs, length, p)
    driver = ScheduledDriver(scenario, caps, gap_timeout)
    while driver.live:
        driver.step(rnd, caps)
    for _ in range(rnd.randint(0, 10)):  # what may still happen before the read ends
        driver.step(rnd, caps)
    driver.finish(rnd, caps)
    stats = driver.sequencer.stats
    assert stats.delivered == driver.checker.delivered
    assert stats.resyncs == len(driver.checker.resyncs)


def test_the_sequencer_modules_read_no_clock() -> None:
    """No module of the sequencer imports a clock: time is always the caller's ``now``."""
    for name in ("sequencer", "delivery", "gap_repair", "hold_limits", "source_state"):
        module = importlib.import_module(f"kvbus.bus.{name}")
        assert module.__file__ is not None
        with open(module.__file__, encoding="utf-8") as file:
            tree = ast.parse(file.read())
        imported = {
            alias.name.partition(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in (
                node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
            )
        }
        assert not imported & {"time", "datetime", "asyncio"}, (name, imported)
