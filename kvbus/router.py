"""`Router`: picks the worker for each request from the prefix it holds and its load.

Feed it every item of two subscriptions, the kv stream (`Router.apply_kv`) and the
metrics stream (`Router.apply_metrics`); ask `Router.route` for a prompt's token ids. A
worker is a kvbus source (``NAME/dp<rank>`` for vLLM engines).

Cost of a worker for a request, in blocks of prefill (lowest wins, ties drawn at random)::

    prefill * blocks it would have to compute
  + waiting * requests queued there + running * requests running there
  + kv_usage * its KV cache usage (0..1)

Load comes from the worker's latest `LoadMetrics`, corrected by what this router itself
sent since: requests it has in flight there beyond those reported running count as
waiting. A request just routed adds its prompt's blocks to that worker's prefix at once
(until it finishes, plus ``linger`` seconds), so a burst of similar requests does not
all miss before the engine's events arrive. A worker stops receiving traffic when its
metrics are older than ``stale_after`` seconds (the stat logger beats every 2 s), when
it stops (`SourceStopped`), or for ``seconds`` after `mark_down`.

Requires numpy (the ``router`` extra): one vectorised pass over every worker keeps a
decision at a few tens of microseconds beyond the index lookup with 1,000 workers.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvbus.events import LoadMetrics, SourceStopped
from kvbus.index import DEFAULT_MEDIUM_WEIGHTS, PrefixIndex, mask_numbers
from kvbus.subscribe import Message, Resync

_MASK_CACHE: Final = 256
_FEW: Final = 64


class Policy(str, enum.Enum):
    KV = "kv"
    """Lowest cost: prefix held and load (see the module docstring)."""
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


class CostWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Weights of the routing cost, in blocks of prefill."""

    prefill: float = 1.0
    waiting: float = 4.0
    running: float = 2.0
    kv_usage: float = 8.0


class Decision(msgspec.Struct, kw_only=True):
    """Where one request goes and what the router expects the engine to find cached."""

    worker: str
    policy: Policy
    prompt_tokens: int
    matched_tokens: int
    """Prefix tokens the worker holds (by the index, plus requests just routed there)."""
    predicted_cached_tokens: int
    """What the engine should report as ``cached_tokens``: the matched full blocks, less
    the last one when the whole prompt matched (vLLM always computes one token)."""
    cost: float
    keys: list[int] = []
    """The prompt's block keys, added to the worker's prefix while the request runs."""
    number: int = -1


class Router:
    def __init__(
        self,
        policy: Policy | str = Policy.KV,
        weights: CostWeights | None = None,
        block_size: int | None = None,
        stale_after: float = 5.0,
        linger: float = 1.0,
        medium_weights: dict[str, float] | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = Policy(policy)
        self.weights = weights or CostWeights()
        self.index = PrefixIndex(block_size, medium_weights or DEFAULT_MEDIUM_WEIGHTS)
        self.stale_after = stale_after
        self.linger = linger
        self._rng = random.Random(seed)
        self._clock = clock
        # Per worker number (the index's), so the index's holder masks address these.
        self._load: npt.NDArray[np.float64] = np.full(16, np.inf)
        """load cost of each worker; inf: not eligible"""
        self._metrics: dict[int, LoadMetrics] = {}
        self._fresh_until: dict[int, float] = {}
        self._down_until: dict[int, float] = {}
        self._inflight: dict[int, int] = {}
        self._pending: dict[int, dict[int, int]] = {}
        """worker -> {block key of a request in flight -> requests}"""
        self._pending_masks: dict[int, int] = {}
        """block key -> mask of the workers it is pending on (index-style, for matching)"""
        self._finishing: deque[tuple[float, Decision]] = deque()
        self._members: dict[int, npt.NDArray[np.intp]] = {}
        self._turn = 0

    # --- feeding ---------------------------------------------------------------------

    def apply_kv(self, item: Message | Resync) -> None:
        """Apply one item of the kv stream (blocks held; restarts and losses clear)."""
        self.index.apply(item)
        if isinstance(item, Message) and isinstance(item.body, SourceStopped):
            self._stopped(item.source)

    def apply_metrics(self, item: Message | Resync) -> None:
        """Apply one item of the metrics stream (load; liveness)."""
        if not isinstance(item, Message):
            return  # lost load records: the next one replaces them anyway
        if isinstance(item.body, LoadMetrics):
            number = self.index.worker_number(item.source)
            self._metrics[number] = item.body
            self._fresh_until[number] = self._clock() + self.stale_after
            self._refresh(number)
        elif isinstance(item.body, SourceStopped):
            self._stopped(item.source)

    def _stopped(self, worker: str) -> None:
        number = self.index.worker_number(worker)
        self._fresh_until[number] = 0.0
        self._refresh(number)

    def mark_down(self, worker: str, seconds: float) -> None:
        """Send ``worker`` nothing for ``seconds`` (it refused a connection, say)."""
        number = self.index.worker_number(worker)
        self._down_until[number] = self._clock() + seconds
        self._refresh(number)

    def _refresh(self, number: int) -> None:
        """Recompute one worker's load cost (inf when it may not get traffic)."""
        if number >= len(self._load):
            grown = np.full(max(number + 1, 2 * len(self._load)), np.inf)
            grown[: len(self._load)] = self._load
            self._load = grown
        now = self._clock()
        metrics = self._metrics.get(number)
        if (
            metrics is None
            or self._fresh_until.get(number, 0.0) <= now
            or self._down_until.get(number, 0.0) > now
        ):
            self._load[number] = np.inf
            return
        w = self.weights
        waiting = max(metrics.waiting, self._inflight.get(number, 0) - metrics.running)
        self._load[number] = (
            w.waiting * waiting + w.running * metrics.running + w.kv_usage * metrics.kv_cache_usage
        )

    # --- routing ---------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        exclude: Collection[str] = (),
    ) -> Decision | None:
        """The worker for a prompt (``None``: no worker may get traffic). Call
        `finished` with the decision when the request ends."""
        now = self._clock()
        self._expire(now)
        keys = self.index.keys(token_ids, lora_name, extra_keys)
        load = self._load.copy()
        for name in exclude:
            number = self.index.worker_number(name)
            if number < len(load):
                load[number] = np.inf
        while True:
            number, cost, blocks = self._choose(load, keys)
            if number < 0:
                return None
            if self._fresh_until.get(number, 0.0) > now:
                break
            # Its metrics went stale since they arrived: out until the next ones.
            self._load[number] = load[number] = np.inf
        decision = self._decide(number, keys, blocks, len(token_ids), cost)
        self._inflight[number] = self._inflight.get(number, 0) + 1
        pending = self._pending.setdefault(number, {})
        masks, bit = self._pending_masks, 1 << number
        for key in keys:
            count = pending.get(key, 0)
            if not count:
                masks[key] = masks.get(key, 0) | bit
            pending[key] = count + 1
        self._refresh(number)
        return decision

    def _choose(self, load: npt.NDArray[np.float64], keys: list[int]) -> tuple[int, float, int]:
        """(worker number, cost, prefix blocks held) of the pick; number -1: none."""
        eligible = np.flatnonzero(np.isfinite(load))
        if not len(eligible):
            return -1, math.inf, 0
        if self.policy is Policy.ROUND_ROBIN:
            self._turn += 1
            number = int(eligible[self._turn % len(eligible)])
            return number, float(load[number]), self._depth(number, keys)
        if self.policy is Policy.RANDOM:
            number = int(self._rng.choice(eligible))
            return number, float(load[number]), self._depth(number, keys)
        depth = self._depths(keys, len(load))
        saved = self._weighted(depth, keys) if self.index.offloaded else depth
        cost = load + self.weights.prefill * (len(keys) - saved)
        best = float(cost.min())
        ties = np.flatnonzero(cost <= best + 1e-9)
        number = int(ties[0] if len(ties) == 1 else self._rng.choice(ties))
        return number, best, int(depth[number])

    def _depths(self, keys: list[int], size: int) -> npt.NDArray[np.float64]:
        """Leading blocks of ``keys`` each worker holds or is about to (requests just
        routed to it)."""
        depth = np.zeros(size)
        for mask, blocks in self.index.match_masks(keys, self._pending_masks):
            depth[self._numbers(mask)] = blocks  # shallowest first: deeper overwrite
        return depth

    def _weighted(self, depth: npt.NDArray[np.float64], keys: list[int]) -> npt.NDArray[np.float64]:
        """``depth`` with blocks held only off the GPU counted at their medium's weight,
        for the few deepest workers (enough to rank the best candidates)."""
        saved = depth.copy()
        top = int(depth.max())
        deepest = np.flatnonzero(depth == top)
        if top and len(deepest) <= _FEW:
            for number in deepest:
                pending = self._pending.get(int(number), {})
                name = self.index.worker_name(int(number))
                stored = [k for k in keys[:top] if k not in pending]
                saved[number] = top - len(stored) + self.index.weighted_blocks(name, stored)
        return saved

    def _depth(self, number: int, keys: list[int]) -> int:
        """Leading blocks of ``keys`` one worker holds or is about to."""
        groups = self.index.match_masks(keys, self._pending_masks)
        return next((blocks for mask, blocks in reversed(groups) if mask >> number & 1), 0)

    def _numbers(self, mask: int) -> npt.NDArray[np.intp]:
        """The worker numbers in a holder mask (large ones recur: cached)."""
        if mask.bit_count() <= _FEW:
            return np.array(mask_numbers(mask), dtype=np.intp)
        found = self._members.get(mask)
        if found is None:
            if len(self._members) >= _MASK_CACHE:
                self._members.clear()
            raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
            found = self._members[mask] = np.flatnonzero(np.unpackbits(raw, bitorder="little"))
        return found

    def _decide(
        self, number: int, keys: list[int], blocks: int, prompt_tokens: int, cost: float
    ) -> Decision:
        block_size = self.index.block_size or 0
        matched = int(blocks) * block_size
        # vLLM computes at least the last prompt token, so a fully cached prompt reports
        # its last block as computed (whole blocks only).
        cap = (prompt_tokens - 1) // block_size * block_size if block_size else 0
        return Decision(
            worker=self.index.worker_name(number),
            policy=self.policy,
            prompt_tokens=prompt_tokens,
            matched_tokens=matched,
            predicted_cached_tokens=min(matched, max(cap, 0)),
            cost=cost,
            keys=keys,
            number=number,
        )

    def finished(self, decision: Decision) -> None:
        """The request of ``decision`` ended (any way): its load goes now, its prefix
        blocks stay assumed for ``linger`` seconds, until the engine's events tell."""
        number = decision.number
        self._inflight[number] = max(0, self._inflight.get(number, 0) - 1)
        self._refresh(number)
        # Blocks the engine's events already reported are the index's business from now
        # on (they may be evicted as soon as the request ends); the rest linger.
        held: list[int] = []
        unconfirmed: list[int] = []
        for key in decision.keys:
            (held if self.index.holds(decision.worker, key) else unconfirmed).append(key)
        self._release(number, held)
        if unconfirmed:
            decision.keys = unconfirmed
            self._finishing.append((self._clock() + self.linger, decision))

    def _expire(self, now: float) -> None:
        while self._finishing and self._finishing[0][0] <= now:
            _, decision = self._finishing.popleft()
            self._release(decision.number, decision.keys)

    def _release(self, number: int, keys: list[int]) -> None:
        pending = self._pending.get(number)
        if pending is None:
            return
        masks, bit = self._pending_masks, 1 << number
        for key in keys:
            left = pending.get(key, 0) - 1
            if left > 0:
                pending[key] = left
            elif pending.pop(key, None) is not None:
                mask = masks.get(key, 0) & ~bit
                if mask:
                    masks[key] = mask
                else:
                    masks.pop(key, None)
        if not pending:
            del self._pending[number]

    # --- introspection ---------------------------------------------------------------

    def eligible(self) -> list[str]:
        """Workers that may get traffic now."""
        now = self._clock()
        return [
            self.index.worker_name(int(n))
            for n in np.flatnonzero(np.isfinite(self._load))
            if self._fresh_until.get(int(n), 0.0) > now
        ]
