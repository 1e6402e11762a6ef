"""`WorkerPace`: how fast each worker gets to a request's first token, as this router
sees it, relative to the fleet.

The cost model counts work in blocks of prefill; an engine on a slower GPU, a busier
host or a larger model pays more seconds for each. Every request this router sent that
starts streaming is one observation: the seconds from routing to its first token, the
blocks of prefill ahead of that token on its worker (its own uncached blocks plus those
of this router's requests queued there before it, plus one for the token vLLM always
computes), the prompt's blocks (attention over a cached prefix costs too), and how many
requests its steps were shared with (this router's streaming there and everyone
else's: a step that also decodes them takes longer).

One fleet-wide fit, ``seconds = overhead + per_block * blocks + per_prompt_block *
prompt_blocks + per_busy * busy`` (least squares over exponentially decayed sums), says
what an average worker would take; a worker's *reading* is its observed seconds over
the fit's for the same observations (the overhead and prompt terms keep cache-hit
requests from reading slow; the busy term keeps a worker that holds popular prefixes,
and so decodes many requests, from reading slow for it). Its *pace* is its reading
over the median worker's: a worker twice as slow as the rest reads 2 (one twice as
fast, 0.5, only with ``read_fast``: 1 by default), and the cost model multiplies its
cost by that. The lower median, not the fastest: on a uniform fleet the fastest reading
is the luckiest, and every other worker would read slow against it.

Pace is 1 for a worker with fewer than ``min_samples`` observations or within a factor
``deadband`` of the median (noise must not move traffic on a uniform fleet), and
within a factor ``limit``. Two observations are enough: a fleet's first requests (one
per new prefix) are where a slow worker is given the prefixes it keeps, so its pace must
be known by then. With 8, an engine twice as slow was still read at the fleet's pace
after the warm-up of the fleet bench's (f) (it had served 3-4 requests), kept the
prefixes it got there and queued their traffic (`BENCHMARKS.md`). A worker read from
few observations must stray further than the deadband when the fleet's seconds are
noisy: past twice the fit's residual spread over the square root of their number
(tests/test_pace.py). A reading moves from 1 only as far as the lower median of the
worker's last `RECENT` first tokens agrees (each over the fit's seconds for it, relative
to the median worker's): the decayed sums are a mean, and one or two first tokens a
second late (a hiccup: two vLLM CPU engines on a shared 2-core host stalled 0.6-1 s
where 20 ms was usual) read a worker four times as slow from its first few, and sent a
prompt it held elsewhere. A worker slow in most of its recent first tokens is slow.
No worker reads *fast* (under 1) unless asked (``read_fast``), and then only from
``min_fast`` observations: a fast reading draws traffic, and on a saturated fleet first
tokens that came quickly are as often a lull in its queue, or a mix of prompts the fit
prices high, as speed. The Mooncake scenario (b) lost goodput when two could read a
worker fast; from eight, an engine of its uniform fleet still read 0.65 and drew four
long prompts (638 blocks to compute) within half a second, then shed what came after
them. A faster engine needs no reading: it empties its queue sooner, and the load terms
send it more. A worker's observations are dropped ``stale_after`` seconds after its
latest: a worker read slow draws little traffic, so nothing would read it again. Once
settled, the fit and the paces are computed every ``settled_every`` observations
(`SETTLED_EVERY`), not after each. Everything is from the caller's observations, reads
and clock: the same observations and reads at the same times give the same paces.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

_TERMS: Final = 4
_DIAGONAL: Final = np.eye(_TERMS)
_NOISE_SIGMAS: Final = 2.0
"""How many spreads of the fit's residuals a reading must stray to count (`_update`)."""
HALF_LIFE: Final = 64.0
"""Observations after which one counts half (per worker, and for the fleet-wide fit)."""
SETTLED_EVERY: Final = 8
"""Observations between two computations of the fit and the paces once both have
settled (the fit on ``min_fit`` observations, the worker observed more than
``min_fast`` times): eight observations are an eighth of a `HALF_LIFE`, and computing
them (a 4x4 solve and the per-worker readings, ~40 µs) after every first token was a
tenth of the router's CPU per request. Until then, after each: a worker's first
readings decide where new prefixes go."""
RECENT: Final = 5
"""First tokens per worker whose median bounds its reading (`WorkerPace`): the lower
median, so one of two, or two of five, cannot make a worker slow (or fast) alone."""
STALE_AFTER: Final = 10.0
"""Seconds after its latest observation that a worker's observations are dropped."""


class WorkerPace:
    """Each worker's pace (1: as fast as the median worker), from time-to-first-token
    observations (`observe`)."""

    def __init__(
        self,
        half_life: float = HALF_LIFE,
        min_samples: int = 2,
        min_fast: int = 8,
        deadband: float = 1.4,
        limit: float = 4.0,
        min_fit: float = 32.0,
        settled_every: int = SETTLED_EVERY,
        stale_after: float = STALE_AFTER,
        clock: Callable[[], float] = time.monotonic,
        read_fast: bool = False,
    ) -> None:
        """``read_fast``: paces under 1 allowed (from ``min_fast`` observations); by
        default a worker reads 1 or slower (see the module docstring)."""
        self.read_fast = read_fast
        self.min_samples = min_samples
        self.min_fast = min_fast
        self.min_fit = min_fit
        self.settled_every = max(1, settled_every)
        self.deadband = deadband
        self.limit = limit
        self.stale_after = stale_after
        self._clock = clock
        self._decay = 0.5 ** (1.0 / half_life)
        # The fleet-wide fit's decayed normal equations over
        # x = (1, blocks, prompt_blocks, busy).
        self._xx = np.zeros((_TERMS, _TERMS))
        self._xy = np.zeros(_TERMS)
        self._yy = 0.0
        """Decayed sum of squared seconds: with the two above, the fit's residuals."""
        # Per worker (by the index's number): decayed sums of x and of seconds (its
        # expected seconds are those sums times the fit as it is now, not as it was at
        # each observation), and how many observations.
        self._x = np.zeros((16, _TERMS))
        self._seconds = np.zeros(16)
        self._count = np.zeros(16)
        self._last = np.zeros(16)
        """when (clock) each worker's latest observation came"""
        self._expires = math.inf
        """when the stalest worker's observations are dropped"""
        self._busiest = 0.0
        """The most busy requests the fit has seen one observation share steps with
        (decayed as the fit's sums are)."""
        self._recent_x = np.zeros((16, RECENT, _TERMS))
        self._recent_seconds = np.zeros((16, RECENT))
        """Each worker's last `RECENT` observations (a ring: ``_count`` tells where the
        next goes and how many are held)."""
        self.paces: npt.NDArray[np.float64] = np.ones(16)
        """Each worker's pace, by the index's number (1 where unknown)."""
        self._fitted = np.zeros(_TERMS)
        """`fit` as of the latest `_update`."""
        self._fitted_busiest = 0.0
        """``_busiest`` as of the latest `_update`: the bound of ``_fitted``'s busy term.
        Taken with the fit, not as observed since: between two updates of a settled fit
        a surge's first busy observations raise ``_busiest`` (1 -> 9), and the fit's busy
        term, learned from calm ones (1.4 s a busy request), would be carried nine times
        as far: every worker predicted 8-14 s late where 3 s was right, and shed."""
        self._since_update = 0

    def fit(self) -> npt.NDArray[np.float64]:
        """The fleet's seconds to a first token per (request, block ahead, prompt
        block, busy request): ``seconds = fit @ (1, blocks, prompt_blocks, busy)``."""
        xx = self._xx
        if xx[0, 0] <= 0:
            return np.zeros(_TERMS)
        # A little ridge: while every observation had the same blocks or busy count the
        # equations are singular; the fit then leans on the terms that did vary.
        ridged = xx + _DIAGONAL * (1e-6 * float(np.trace(xx)))
        # Not clipped at 0: terms that move together (a new prompt's blocks ahead and
        # its prompt blocks) may split with one negative, their sum still right; clipping
        # one would skew every prediction by the mix of work each worker was sent.
        solved: npt.NDArray[np.float64] = np.asarray(
            np.linalg.solve(ridged, self._xy), dtype=np.float64
        )
        return solved

    def observe(
        self,
        number: int,
        seconds: float,
        blocks: float,
        busy: float = 0.0,
        prompt_blocks: float = 0.0,
    ) -> None:
        """Worker ``number`` reached a request's first token ``seconds`` after it was
        routed there with ``blocks`` of prefill ahead (its own included), ``busy`` other
        requests on it, for a prompt of ``prompt_blocks``."""
        values = (seconds, blocks, busy, prompt_blocks)
        if not all(math.isfinite(v) and 0 <= v < 1e12 for v in values):
            return
        x = np.array([1.0, blocks, prompt_blocks, busy])
        d = self._decay
        self._xx = self._xx * d + np.outer(x, x)
        self._xy = self._xy * d + x * seconds
        self._yy = self._yy * d + seconds * seconds
        self._busiest = max(busy, self._busiest * d)
        self._grow(number)
        self._x[number] = self._x[number] * d + x
        self._seconds[number] = self._seconds[number] * d + seconds
        slot = int(self._count[number]) % RECENT
        self._recent_x[number, slot] = x
        self._recent_seconds[number, slot] = seconds
        self._count[number] += 1
        self._last[number] = self._clock()
        self._since_update += 1
        if (
            self._since_update >= self.settled_every
            or self._xx[0, 0] < self.min_fit
            or self._count[number] <= self.min_fast
        ):
            self._update()

    def predict(self, number: int, blocks: float, prompt_blocks: float, busy: float) -> float:
        """Seconds worker ``number`` should take to a first token for a request with
        ``blocks`` of prefill ahead, a prompt of ``prompt_blocks`` and ``busy`` other
        requests on it (the fleet's fit times the worker's pace, ``busy`` at most the
        most the fit has seen); NaN until the fit rests on ``min_fit`` observations
        (decayed)."""
        if self._xx[0, 0] < self.min_fit:
            return math.nan
        # Not past the busiest observation the fit has: a fit that has seen only a few
        # busy requests puts the whole residual of those few (a surge's queueing, on the
        # first requests routed as a burst started streaming) on the busy term, and
        # extrapolated to a busier worker that was 1.2 s a busy request where 0.1 was
        # right: a surge's traffic shed as 10-24 s late that started in 2-4 s
        # (BENCHMARKS.md, (e)).
        pace = float(self.of(number + 1)[number])  # first: its expiry may update the fit
        busy = min(busy, self._fitted_busiest)
        f = self._fitted
        seconds = float(f[0] + f[1] * blocks + f[2] * prompt_blocks + f[3] * busy)
        return max(0.0, seconds) * pace

    def forget(self, number: int) -> None:
        """Worker ``number`` restarted or left: what it was is no evidence of what it is."""
        if number < len(self._count) and self._count[number]:
            self._x[number] = 0.0
            self._seconds[number] = self._count[number] = 0.0
            self._update()

    def _grow(self, number: int) -> None:
        size = len(self._count)
        if number < size:
            return
        more = max(number + 1, 2 * size) - size
        self._x = np.concatenate([self._x, np.zeros((more, _TERMS))])
        self._seconds = np.concatenate([self._seconds, np.zeros(more)])
        self._count = np.concatenate([self._count, np.zeros(more)])
        self._last = np.concatenate([self._last, np.zeros(more)])
        self._recent_x = np.concatenate([self._recent_x, np.zeros((more, RECENT, _TERMS))])
        self._recent_seconds = np.concatenate([self._recent_seconds, np.zeros((more, RECENT))])
        self.paces = np.concatenate([self.paces, np.ones(more)])

    def _noise(self, beta: npt.NDArray[np.float64]) -> float:
        """How far one observation strays from the fit ``beta``, relative to the mean
        one: the fit's residual spread (its decayed sums; the fit's four terms take four
        degrees of freedom) over the mean seconds. Infinite until there are more
        observations than terms."""
        n = float(self._xx[0, 0])
        if n <= _TERMS + 1 or self._xy[0] <= 0:
            return math.inf
        residual = self._yy - 2.0 * float(beta @ self._xy) + float(beta @ self._xx @ beta)
        return math.sqrt(max(residual, 0.0) / (n - _TERMS)) / (float(self._xy[0]) / n)

    def _update(self) -> None:
        """Every worker's pace under the fit as it is now (O(workers), vectorised)."""
        self._since_update = 0
        fit = self._fitted = self.fit()
        self._fitted_busiest = self._busiest
        expected = self._x @ fit
        known = (self._count >= self.min_samples) & (expected > 0)
        paces = np.ones(len(self._count))
        if known.any():
            paces[known] = _relative(self._seconds[known] / expected[known])
        # A reading counts once it is past what noise explains: the deadband, or twice
        # the observations' spread shrunk by how many the worker's reading rests on,
        # whichever is wider (a worker read from its first two requests must stray
        # further than one read from a hundred).
        spread = _NOISE_SIGMAS * self._noise(fit) / np.sqrt(np.maximum(self._count, 1.0))
        band = np.exp(np.maximum(math.log(self.deadband), np.minimum(spread, 50.0)))
        explained = (paces <= band) & (paces >= 1.0 / band)
        if not explained.all():
            # Only as far from 1 as its recent first tokens' median agrees (see the
            # module docstring); on a fleet read uniform, nothing to check.
            recent = np.ones(len(paces))
            recent[known] = _relative(self._recent_medians(fit, known))
            paces = np.where(
                paces > 1.0,
                np.minimum(paces, np.maximum(recent, 1.0)),
                np.maximum(paces, np.minimum(recent, 1.0)),
            )
            explained = (paces <= band) & (paces >= 1.0 / band)
        paces[explained] = 1.0
        min_fast = self.min_fast if self.read_fast else math.inf
        paces[(paces < 1.0) & (self._count < min_fast)] = 1.0
        self.paces = np.clip(paces, 1.0 / self.limit, self.limit)
        held = self._count > 0
        self._expires = float(self._last[held].min()) + self.stale_after if held.any() else math.inf

    def _recent_medians(
        self, fit: npt.NDArray[np.float64], known: npt.NDArray[np.bool_]
    ) -> npt.NDArray[np.float64]:
        """Each worker's lower median of its recent observations' seconds over the fit's
        (NaN where none has an expected time), for the workers ``known`` selects;
        O(workers x `RECENT`)."""
        held = np.minimum(self._count[known], RECENT)[:, None] > np.arange(RECENT)
        expected = self._recent_x[known] @ fit
        valid = held & (expected > 0)
        ratios = np.where(
            valid, self._recent_seconds[known] / np.where(valid, expected, 1.0), np.inf
        )
        counts = valid.sum(axis=1)
        middle = np.maximum(counts - 1, 0) // 2
        medians = np.take_along_axis(np.sort(ratios, axis=1), middle[:, None], axis=1)[:, 0]
        return np.where(counts > 0, medians, np.nan)

    def _expire(self, now: float) -> None:
        """Drop the observations of workers observed last ``stale_after`` ago or earlier:
        a worker read slow gets no traffic, so nothing would ever read it again (and the
        fleet's fit moves on without it), while the slowness may have passed (a noisy
        neighbour gone, a host less loaded)."""
        stale = (self._count > 0) & (self._last <= now - self.stale_after)
        self._x[stale] = 0.0
        self._seconds[stale] = self._count[stale] = 0.0
        self._update()

    def of(self, size: int) -> npt.NDArray[np.float64]:
        """The paces of workers ``0..size-1`` (O(1) but when observations go stale)."""
        now = self._clock()
        if self._expires <= now:
            self._expire(now)
        if size > len(self.paces):
            return np.concatenate([self.paces, np.ones(size - len(self.paces))])
        return self.paces[:size]


def _relative(readings: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Each reading over the lower median of those known (NaN: unknown, read as 1). The
    lower median: with an even count the middle two's mean would make any gap between
    two workers read as one slow *and one fast* (a 1.8x gap puts the faster past the
    deadband's 1/1.4, and every request goes to it); with the lower one, the faster of
    two reads 1 and the slower its ratio."""
    relative = np.ones(len(readings))
    known = np.isfinite(readings)
    if not known.any():
        return relative
    typical = float(np.sort(readings[known])[(int(known.sum()) - 1) // 2])
    if typical > 0:
        relative[known] = readings[known] / typical
    return relative
