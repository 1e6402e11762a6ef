"""`RequestsInFlight`: this router's requests on each worker until they end, and the
prompt blocks they are about to cache there.

A request just routed counts on its worker as queued (its blocks still to prefill)
until it starts streaming, then as streaming (a decode slot) until it ends; for
``linger`` seconds after it ends it still counts as the worker's, since the engine's
next load record may predate its end, until a record made after its end arrives (one
that does not count it). Its prompt's block keys are *pending* on the
worker from the moment it is routed (``pending``, and ``pending_masks`` in the index's
holder-mask form, which `kvbus.routing.cost.CostModel` matches beside the index), so
that a burst of similar requests does not all miss before the engine's events arrive.
When it ends, the keys the engine's events already reported are the index's business;
the rest stay pending until the events report its last block (`RequestsInFlight.stored`),
for ``linger`` seconds at most, or until the engine's cache empties
(`RequestsInFlight.cleared`). Once reported, the index alone tells what the engine kept:
a hybrid model's sparse groups keep fewer states than the rule pending assumes, and an
engine may evict a block while the router still lingers on it.

`kvbus.routing.fleet_state.FleetState` owns one and turns these counts into each
worker's load cost; nothing here reads a clock but the caller's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvbus.routing.index import PrefixIndex


class Routed(Protocol):
    """A request counted on a worker (`kvbus.routing.cost.Decision` is one)."""

    worker: str
    number: int
    """The worker's number in the index."""
    keys: list[int]
    window_keys: list[int]
    """Of its blocks, those a hybrid model's sparse groups keep (set here)."""
    window_ends: list[int]
    """Where those groups keep state, in blocks (`kvbus.routing.cost.Decision`)."""
    prefill_blocks: float
    new_blocks: int
    streaming: bool
    ended: bool
    routed_at: float
    predicted_ttft: float
    peer: str
    """The replica that routed it ("" for this router)."""
    recompute_blocks: float
    """Blocks it computes again, streaming when its worker's cache was reset (set here)."""


class RequestsInFlight:
    """Per worker (by the index's number): this router's requests queued, streaming
    and just ended there, and their prompt blocks pending."""

    def __init__(self, index: PrefixIndex, clock: Callable[[], float], linger: float) -> None:
        self.index = index
        self.linger = linger
        self._clock = clock
        self._queued: dict[int, list[float]] = {}
        """worker -> [requests of this router not streaming yet, their blocks to prefill]"""
        self._streaming: dict[int, int] = {}
        """worker -> requests of this router streaming (decoding)"""
        self.pending: dict[int, dict[int, int]] = {}
        """worker -> {block key of a request in flight -> requests}"""
        self.pending_masks: dict[int, int] = {}
        """block key -> mask of the workers it is pending on (index-style, for matching)"""
        self.window_pending: dict[int, dict[int, int]] = {}
        self.window_pending_masks: dict[int, int] = {}
        """The same for hybrid models' sliding-window groups: a request leaves only its
        prompt's last window there (`kvbus.routing.index_window`)."""
        self._finishing: deque[tuple[float, Routed]] = deque()
        self._finishing_on: dict[int, int] = {}
        """worker -> its requests in ``_finishing`` (a clear of a worker with none is O(1))"""
        self._awaiting: dict[int, dict[int, dict[int, Routed]]] = index.awaited
        """worker -> {the last block key of a request in ``_finishing`` -> those requests
        (by ``id``)}: the index, which shares it, tells when the engine's events store
        it (`stored`)"""
        self._ended: deque[tuple[float, int, float]] = deque()
        """(until, worker, when it ended) of requests of this router that ended less than
        ``linger`` ago, oldest first"""
        self._ended_at: dict[int, deque[float]] = {}
        """worker -> when (clock) its requests in ``_ended`` ended, oldest first, less
        those that ended before its latest load record was made (`counted_until`): the
        record does not count them, so they are not what it counts"""
        self._exposed: dict[int, dict[int, Routed]] = {}
        """worker -> its requests in flight that a reset would make compute more (by
        ``id``): each one routed there since its latest reset"""
        self._recomputing: dict[int, tuple[float, list[Routed]]] = {}
        """worker -> (when its cache was reset, its requests that were streaming then):
        they compute their prompts again ahead of anything routed there after"""
        self._unstarted: dict[int, deque[Routed]] = {}
        """worker -> this router's own requests routed there, oldest first; those that
        started or ended are dropped when they reach the head. Not other replicas':
        their times are theirs, and a start or an end lost on the bus (or forged)
        would make one look late for as long as it counts."""

    # --- counts ----------------------------------------------------------------------

    def queued_blocks(self, number: int) -> float:
        """Blocks this router's requests not streaming yet still prefill on a worker."""
        queued = self._queued.get(number)
        return queued[1] if queued else 0.0

    def streaming(self, number: int) -> int:
        """This router's requests streaming (decoding) on a worker."""
        return self._streaming.get(number, 0)

    def ours(self, number: int) -> int:
        """This router's requests the worker's engine may be counting: queued,
        streaming, and ended within ``linger`` but after its latest load record."""
        queued = self._queued.get(number)
        count = int(queued[0]) if queued else 0
        return count + self._streaming.get(number, 0) + self.ended_since_record(number)

    def ended_since_record(self, number: int) -> int:
        """This router's requests on the worker that ended (within ``linger``) after its
        latest load record was made: the record still counts them."""
        ended = self._ended_at.get(number)
        return len(ended) if ended else 0

    def counted_until(self, number: int, made: float) -> None:
        """The worker's latest load record was made at ``made`` (this router's clock):
        its requests that ended before then are in no record from now on. Amortised
        O(1): each end is let go of once."""
        ended = self._ended_at.get(number)
        if ended is None:
            return
        while ended and ended[0] < made:
            ended.popleft()
        if not ended:
            del self._ended_at[number]

    def oldest_unstarted(self, number: int) -> Routed | None:
        """This router's request routed to a worker longest ago that has not started
        streaming (amortised O(1): requests start roughly in the order they were
        routed)."""
        waiting = self._unstarted.get(number)
        while waiting and (waiting[0].streaming or waiting[0].ended):
            waiting.popleft()
        if not waiting:
            self._unstarted.pop(number, None)
            return None
        return waiting[0]

    # --- a request's life ------------------------------------------------------------

    def assign(self, request: Routed) -> None:
        """Count ``request`` on its worker until it finishes: queued for prefill, its
        blocks about to be cached there."""
        number = request.number
        queued = self._queued.setdefault(number, [0, 0.0])
        queued[0] += 1
        queued[1] += request.prefill_blocks
        if not request.peer:
            self._unstarted.setdefault(number, deque()).append(request)
        self._exposed.setdefault(number, {})[id(request)] = request
        _add(self.pending, self.pending_masks, number, request.keys)
        width = self.index.window_blocks(number)
        if width:
            request.window_keys = kept_tails(request.keys, request.window_ends, width)
            _add(self.window_pending, self.window_pending_masks, number, request.window_keys)

    def prefilled_elsewhere(self, request: Routed) -> None:
        """``request`` (queued) has its prompt computed by another worker (P/D's prefill
        hop): its worker loads the KV, so it queues no prefill there."""
        queued = self._queued.get(request.number)
        if queued is not None and not request.streaming and not request.ended:
            queued[1] = max(0.0, queued[1] - request.prefill_blocks)
        request.prefill_blocks = 0.0

    def started(self, request: Routed) -> None:
        """``request`` started streaming (not yet marked so): its prefill is done."""
        request.streaming = True
        number = request.number
        queued = self._queued[number]
        queued[0] -= 1
        queued[1] = max(0.0, queued[1] - request.prefill_blocks)
        self._streaming[number] = self._streaming.get(number, 0) + 1
        recomputing = self._recomputing.get(number)
        if recomputing is not None and request.routed_at > recomputing[0]:
            # vLLM puts what a reset preempted at the head of its waiting queue: a request
            # routed after the reset that starts was computed after all of it.
            del self._recomputing[number]
            for preempted in recomputing[1]:
                queued[1] = max(0.0, queued[1] - preempted.recompute_blocks)
                preempted.recompute_blocks = 0.0

    def finished(self, request: Routed) -> None:
        """``request`` ended (any way): its prefix blocks the engine's events have not
        reported yet stay pending until they do (`stored`), ``linger`` seconds at most,
        or until its worker's cache empties (`cleared`)."""
        number = request.number
        request.ended = True
        exposed = self._exposed.get(number)
        if exposed is not None:
            exposed.pop(id(request), None)
        if request.streaming:
            self._streaming[number] -= 1
            if request.recompute_blocks:
                queued = self._queued[number]
                queued[1] = max(0.0, queued[1] - request.recompute_blocks)
                request.recompute_blocks = 0.0
        else:
            queued = self._queued[number]
            queued[0] -= 1
            queued[1] = max(0.0, queued[1] - request.prefill_blocks)
        now = self._clock()
        self._ended.append((now + self.linger, number, now))
        self._ended_at.setdefault(number, deque()).append(now)
        # Blocks the engine's events already reported are the index's business from now
        # on (they may be evicted as soon as the request ends); the rest linger.
        held: list[int] = []
        unconfirmed: list[int] = []
        for key in request.keys:
            (held if self.index.holds(request.worker, key) else unconfirmed).append(key)
        self._release(number, held)
        if unconfirmed:
            request.keys = unconfirmed  # its window keys linger with them
            self._finishing.append((now + self.linger, request))
            self._finishing_on[number] = self._finishing_on.get(number, 0) + 1
            # Its deepest block is stored in the step that ended its prefill, with (or
            # after) the states its sparse groups kept: until the events report it,
            # what it left pending stands for them. (Where another request stored that
            # block, whose events are late too, its batch may come first: this one's
            # states then count from its own batch, a step later.)
            key = unconfirmed[-1]
            waiting = self._awaiting.setdefault(number, {}).setdefault(key, {})
            waiting[id(request)] = request
        else:  # the engine's events told (the window group's came in the same batch)
            self._release_window(request)

    def stored(self, arrived: list[tuple[int, int]]) -> None:
        """The engine's events stored these ``(worker, key)`` (`PrefixIndex.take_arrived`):
        the requests that ended waiting for them leave their pending keys to the index,
        which now knows what the engine kept of them, and what it evicted since."""
        for number, key in arrived:
            waiting = self._awaiting.get(number)
            requests = waiting.pop(key, None) if waiting is not None else None
            if requests is None:
                continue
            if not waiting:
                del self._awaiting[number]
            for request in requests.values():
                self._release(number, request.keys)
                self._release_window(request)
                request.keys = []  # released: its linger's end finds nothing left

    def _unawait(self, request: Routed) -> None:
        """``request`` lets go of its pending keys otherwise (its linger ended, its
        worker's cache emptied): the index need not tell of its last block."""
        if not request.keys:
            return
        number, key = request.number, request.keys[-1]
        waiting = self._awaiting.get(number)
        if waiting is None:
            return
        requests = waiting.get(key)
        if requests is None or requests.pop(id(request), None) is None:
            return
        if not requests:
            del waiting[key]
            if not waiting:
                del self._awaiting[number]

    def expire(self, now: float) -> set[int]:
        """Let go of what ended more than ``linger`` seconds before ``now``; returns
        the workers whose count of requests just ended changed."""
        while self._finishing and self._finishing[0][0] <= now:
            _, request = self._finishing.popleft()
            left = self._finishing_on.get(request.number, 0) - 1
            if left > 0:
                self._finishing_on[request.number] = left
            else:
                self._finishing_on.pop(request.number, None)
            self._unawait(request)
            self._release(request.number, request.keys)
            self._release_window(request)
        changed: set[int] = set()
        while self._ended and self._ended[0][0] <= now:
            _, number, ended_at = self._ended.popleft()
            ended = self._ended_at.get(number)
            # Not there if a load record made since let go of it (`counted_until`).
            if ended and ended[0] <= ended_at:
                ended.popleft()
                if not ended:
                    del self._ended_at[number]
                changed.add(number)
        return changed

    def cleared(self, number: int, preempted: bool = False) -> None:
        """Worker ``number``'s engine emptied its cache: what its finished requests left
        pending there is gone. Requests still in flight keep theirs: they cache them
        after the clear. ``preempted``: the engine is still up, and its requests in flight
        compute their prompts again (`requeue`)."""
        if preempted:
            self.requeue(number)
        # A scan of the requests that ended within ``linger``, once per clear that finds
        # some: a flood of clears from one engine costs O(1) each after the first.
        if not self._finishing_on.pop(number, 0):
            return
        kept: deque[tuple[float, Routed]] = deque()
        for until, request in self._finishing:
            if request.number == number:
                self._unawait(request)
                self._release(number, request.keys)
                self._release_window(request)
            else:
                kept.append((until, request))
        self._finishing = kept

    def requeue(self, number: int) -> None:
        """Worker ``number``'s cache was reset while requests ran there: vLLM frees no
        block a request holds, so a reset that emptied the cache preempted every running
        request (``reset_running_requests``), and each computes its prompt again, at the
        head of the queue; those waiting lost the prefix they were to find. They count as
        queued again with their whole prompts until they start (those not started), or
        until they end or a request routed after the reset starts (those streaming).
        Each request in flight is counted at most once per reset: a flood of clears
        costs O(1) each after the first."""
        exposed = self._exposed.pop(number, None)
        if not exposed:
            return
        queued = self._queued.setdefault(number, [0, 0.0])
        recomputing: list[Routed] = []
        for request in exposed.values():
            whole = float(len(request.keys))
            if request.streaming:
                request.recompute_blocks = whole
                queued[1] += whole
                recomputing.append(request)
            else:
                queued[1] += max(0.0, whole - request.prefill_blocks)
                request.prefill_blocks = whole
        if recomputing:
            # Those of an earlier reset that ended since hold nothing: not kept.
            earlier = [r for r in self._recomputing.get(number, (0.0, []))[1] if r.recompute_blocks]
            self._recomputing[number] = (self._clock(), earlier + recomputing)

    def _release(self, number: int, keys: list[int]) -> None:
        _drop(self.pending, self.pending_masks, number, keys)

    def _release_window(self, request: Routed) -> None:
        if request.window_keys:
            _drop(
                self.window_pending, self.window_pending_masks, request.number, request.window_keys
            )
            request.window_keys = []


def kept_tails(keys: list[int], ends: list[int], width: int) -> list[int]:
    """Of a prompt's block ``keys``, the ``width`` blocks ending on each of ``ends``
    (blocks into the prompt; none given: its end), as vLLM's sparse retention keeps
    them in a hybrid model's sliding-window (mamba: ``width`` 1) groups. Ends out of
    range (a peer's, read off the bus) are clamped: O(width) per end, at most two."""
    if not ends:
        return keys[-width:]
    kept: dict[int, None] = {}
    for end in ends[:2]:
        end = min(max(end, 0), len(keys))
        kept.update(dict.fromkeys(keys[max(end - width, 0) : end]))
    return list(kept)


def _add(
    pending: dict[int, dict[int, int]], masks: dict[int, int], number: int, keys: list[int]
) -> None:
    """``keys`` pending once more on worker ``number``."""
    counts = pending.setdefault(number, {})
    bit = 1 << number
    for key in keys:
        count = counts.get(key, 0)
        if not count:
            masks[key] = masks.get(key, 0) | bit
        counts[key] = count + 1


def _drop(
    pending: dict[int, dict[int, int]], masks: dict[int, int], number: int, keys: list[int]
) -> None:
    """``keys`` pending once less on worker ``number``."""
    counts = pending.get(number)
    if counts is None:
        return
    bit = 1 << number
    for key in keys:
        left = counts.get(key, 0) - 1
        if left > 0:
            counts[key] = left
        elif counts.pop(key, None) is not None:
            mask = masks.get(key, 0) & ~bit
            if mask:
                masks[key] = mask
            else:
                masks.pop(key, None)
    if not counts:
        del pending[number]
