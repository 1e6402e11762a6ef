"""`WorkerPace`: how fast each worker gets to a request's first token, as this router
sees it, relative to the fleet.

The cost model counts work in blocks of prefill; an engine on a slower GPU, a busier
host or a larger model pays more seconds for each. Every request this router sent that
starts streaming is one observation: the seconds from routing to its first token, and
the blocks of prefill ahead of that token on its worker (its own uncached blocks plus
those of this router's requests queued there before it, plus one for the token vLLM
always computes).

One fleet-wide fit, ``seconds = overhead + per_block * blocks`` (least squares over
exponentially decayed sums), says what an average worker would take for that work; a
worker's *speed reading* is its observed seconds over that expectation, summed over its
recent observations (the overhead term keeps short, cache-hit requests from reading
slow). Its *pace* is its reading over the fastest worker's: a worker twice as slow as
the rest reads 2 whatever mix of hits and misses it was sent, and the cost model
multiplies its cost by that.

Pace is 1 for a worker with fewer than ``min_samples`` observations or within
``deadband`` of the fastest (noise must not move traffic on a uniform fleet), and at
most ``limit``. Everything is from the caller's observations: the same observations
give the same paces.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import numpy.typing as npt

HALF_LIFE: Final = 64.0
"""Observations after which one counts half (per worker, and for the fleet-wide fit)."""


class WorkerPace:
    """Each worker's pace (1: as fast as the fastest), from time-to-first-token
    observations (`observe`)."""

    def __init__(
        self,
        half_life: float = HALF_LIFE,
        min_samples: int = 4,
        deadband: float = 1.25,
        limit: float = 4.0,
    ) -> None:
        self.min_samples = min_samples
        self.deadband = deadband
        self.limit = limit
        self._decay = 0.5 ** (1.0 / half_life)
        # Fleet-wide decayed sums for the fit: n, sum b, sum t, sum b*b, sum b*t.
        self._fit = [0.0, 0.0, 0.0, 0.0, 0.0]
        # Per worker (by the index's number) decayed sums: observations, blocks, seconds;
        # and how many observations (a worker's expected seconds are n*overhead +
        # per_block*blocks under the fit as it is now, not as it was at each one).
        self._n = np.zeros(16)
        self._blocks = np.zeros(16)
        self._seconds = np.zeros(16)
        self._count = np.zeros(16)
        self.paces: npt.NDArray[np.float64] = np.ones(16)
        """Each worker's pace, by the index's number (1 where unknown)."""

    def fit(self) -> tuple[float, float]:
        """The fleet's ``(overhead, per_block)`` seconds to a first token."""
        n, sb, st, sbb, sbt = self._fit
        if n <= 0:
            return 0.0, 0.0
        spread = n * sbb - sb * sb
        if spread > 1e-9 * max(1.0, n * sbb):
            per_block = max(0.0, (n * sbt - sb * st) / spread)
            return max(0.0, (st - per_block * sb) / n), per_block
        # Every observation had the same work: no overhead can be told apart.
        return (0.0, st / sb) if sb > 0 else (st / n, 0.0)

    def observe(self, number: int, seconds: float, blocks: float) -> None:
        """Worker ``number`` reached a request's first token ``seconds`` after it was
        routed there with ``blocks`` of prefill ahead (its own included)."""
        if not (math.isfinite(seconds) and math.isfinite(blocks)) or seconds < 0 or blocks < 0:
            return
        d = self._decay
        fit = self._fit
        for i, value in enumerate((1.0, blocks, seconds, blocks * blocks, blocks * seconds)):
            fit[i] = fit[i] * d + value
        self._grow(number)
        self._n[number] = self._n[number] * d + 1.0
        self._blocks[number] = self._blocks[number] * d + blocks
        self._seconds[number] = self._seconds[number] * d + seconds
        self._count[number] += 1
        self._update()

    def forget(self, number: int) -> None:
        """Worker ``number`` restarted or left: what it was is no evidence of what it is."""
        if number < len(self._count) and self._count[number]:
            for sums in (self._n, self._blocks, self._seconds, self._count):
                sums[number] = 0.0
            self._update()

    def _grow(self, number: int) -> None:
        size = len(self._n)
        if number < size:
            return
        more = max(number + 1, 2 * size) - size
        self._n, self._blocks, self._seconds, self._count, self.paces = (
            np.concatenate([a, np.full(more, fill)])
            for a, fill in (
                (self._n, 0.0),
                (self._blocks, 0.0),
                (self._seconds, 0.0),
                (self._count, 0.0),
                (self.paces, 1.0),
            )
        )

    def _update(self) -> None:
        """Every worker's pace under the fit as it is now (O(workers), vectorised)."""
        overhead, per_block = self.fit()
        expected = self._n * overhead + self._blocks * per_block
        known = (self._count >= self.min_samples) & (expected > 0)
        paces = np.ones(len(self._n))
        if known.any():
            readings = self._seconds[known] / expected[known]
            fastest = float(readings.min())
            if fastest > 0:
                paces[known] = np.minimum(readings / fastest, self.limit)
        paces[paces <= self.deadband] = 1.0
        self.paces = paces

    def of(self, size: int) -> npt.NDArray[np.float64]:
        """The paces of workers ``0..size-1``."""
        if size > len(self.paces):
            return np.concatenate([self.paces, np.ones(size - len(self.paces))])
        return self.paces[:size]
