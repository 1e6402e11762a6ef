"""`Admission`: whether the router sends a request on or refuses it at once (shed),
from when its worker should give its first token and its last.

Past saturation every request admitted takes engine time from the others: one that will
miss its client's timeout anyway only makes the next ones miss theirs. Two limits:

- ``shed_after`` (the router's ``--shed-after``): the worker's predicted time to the
  first token (`kvbus.routing.pace`) over it;
- a *deadline* (``--deadline``, or the request's own ``X-Kvbus-Deadline``): the
  predicted time to the *last* token over it, ``predicted_ttft + (output - 1) * the
  worker's seconds per output token``. The first token alone does not say whether a
  request completes in time: a saturated engine's every step carries a chunk of some
  prompt's prefill, so its decode slows too. On the fleet bench's Mooncake trace at
  300 req/s (about 1.5 times what the fleet serves), 96% of the requests that timed out
  (the client's 1.5 s) had their first token within the 1 s SLO (`BENCHMARKS.md`).

Only the chosen worker is checked: the cost model picks it, and a request it would shed
is shed, as with ``shed_after``. Sending it to the runner-up when that one should be in
time was tried on the fleet bench's Mooncake trace at 300 req/s: 2% more in time (within
the noise), a fifth fewer shed but a third more timed out (the runner-up's prediction,
of an engine with less of the prompt cached, was the more often wrong), and 0.92-0.96
of the hit rate's bound against 0.975 (`BENCHMARKS.md`, nineteenth session).

A worker's seconds per output token (`DecodeTimes`) are the gaps between the chunks of
its streams as the router relays them, one engine step each
(`kvbus.service.upstream`), in an exponential mean over the worker's steps (each
stream's gap weighs ``STEP_WEIGHT`` over the streams there, which all see the same
step). Timed at each answer's end instead, over the tokens its usage counts, it lagged
the onset of saturation by a second of simulated time: what was admitted in that second
timed out, and then more was shed than needed. The output a request will have is its
``max_tokens`` when it ignores EOS, else the lesser of that and the mean output of the
answers lately seen (their usage). Nothing is shed on what is not yet known (NaN).

No margin is added to the estimate. On that trace its median is right (a request's end
over its prediction: 1.07) and its spread wide (0.55-2.97, p10-p90): the requests that
timed out had been predicted at 0.35-0.79 of the limit, and the decode's estimate times
1.4 would have shed 170 requests in time for each one that timed out (`BENCHMARKS.md`,
twentieth session).
"""

from __future__ import annotations

import math
import statistics
from typing import Final

STEP_WEIGHT: Final = 0.7
"""Weight of a worker's latest step in its seconds per output token (an exponential
mean: a saturated engine's step time moves with what it prefills from one step to the
next, and a request admitted now decodes a few steps on). At 0.3 the Mooncake trace at
300 req/s admitted what then timed out (92-104 requests a stage against 6-22 when each
stream's gap weighed 0.1, about 0.6 a step; `BENCHMARKS.md`)."""
MIN_STEP: Final = 0.001
"""Seconds between two chunks of a stream under which they are one step's (its last
token and the usage event and ``[DONE]`` after it, or several choices'), or the second
waited while the first was written (`kvbus.service.upstream`)."""
MEDIAN_EVERY: Final = 0.25
"""Seconds the fleet's median seconds per token stands for at most (`DecodeTimes`)."""
OUTPUT_WEIGHT: Final = 0.02
"""Weight of the latest answer in the fleet's mean output tokens."""
STALE_AFTER: Final = 10.0
"""Seconds after a worker's latest step that its own time per token no longer counts
(an idle worker's was read when it was busy): the fleet's median stands in."""
MAX_OUTPUT: Final = 1 << 20
"""Output tokens counted of one request or answer at most (a request's ``max_tokens``,
an answer's usage): 1M, past any model's context; one forged answer moves the mean
output by ``OUTPUT_WEIGHT`` of this at most."""


class DecodeTimes:
    """Each worker's seconds per output token after the first (`step`), and the fleet's
    mean output tokens per answer (`answered`)."""

    def __init__(self, stale_after: float = STALE_AFTER) -> None:
        self.stale_after = stale_after
        # Per worker (by the index's number): Python lists, not arrays; `step` runs for
        # every token the router relays, and a list's item costs a tenth of an array's.
        self._per_token: list[float] = []
        self._last: list[float] = []
        """when (the router's clock) each worker's latest step came"""
        self._median = (-math.inf, math.nan)
        """(when, the fresh workers' median then): recomputed at most every
        `MEDIAN_EVERY` seconds, not for every request routed to a worker without one."""
        self.mean_output = math.nan
        """Output tokens per answer, an exponential mean (NaN until one is seen)."""

    def step(self, number: int, seconds: float, now: float, streams: int = 1) -> None:
        """A stream on worker ``number`` brought its next token ``seconds`` after the
        one before: one engine step, which each of the ``streams`` there sees too."""
        if number < 0 or not 0.0 < seconds < math.inf:
            return
        if number >= len(self._per_token):
            grow = number + 1 - len(self._per_token)
            self._per_token += [math.nan] * grow
            self._last += [-math.inf] * grow
        known = self._per_token[number]
        if now - self._last[number] <= self.stale_after and not math.isnan(known):
            seconds = known + STEP_WEIGHT / max(1, streams) * (seconds - known)
        self._per_token[number] = seconds
        self._last[number] = now

    def answered(self, tokens: float) -> None:
        """An answer ended with ``tokens`` output tokens (its usage's, over its
        choices)."""
        if tokens < 1:
            return
        tokens = min(tokens, MAX_OUTPUT)
        mean = self.mean_output
        self.mean_output = tokens if math.isnan(mean) else mean + OUTPUT_WEIGHT * (tokens - mean)

    def own(self, number: int, now: float) -> float:
        """Worker ``number``'s own seconds per output token (NaN: none lately)."""
        if 0 <= number < len(self._per_token) and now - self._last[number] <= self.stale_after:
            return self._per_token[number]
        return math.nan

    def per_token(self, number: int, now: float) -> float:
        """Seconds per output token after the first on worker ``number``: its own, or
        the median of the workers read lately while it has none fresh (NaN: none)."""
        own = self.own(number, now)
        if not math.isnan(own):
            return own
        when, median = self._median
        # (Not a NaN kept: a fleet's first steps must count at once, not 0.25 s on.)
        if math.isnan(median) or now - when > MEDIAN_EVERY or now < when:
            fresh = [
                seconds
                for seconds, last in zip(self._per_token, self._last, strict=True)
                if now - last <= self.stale_after and not math.isnan(seconds)
            ]
            median = statistics.median(fresh) if fresh else math.nan
            self._median = (now, median)
        return median

    def expected_output(self, max_tokens: int | None, ignores_eos: bool) -> float:
        """Output tokens to expect of a request asking for ``max_tokens`` (None: not
        said), which it runs to when ``ignores_eos``."""
        if max_tokens is not None and (ignores_eos or math.isnan(self.mean_output)):
            return float(max_tokens)
        if max_tokens is None:
            return self.mean_output
        return min(float(max_tokens), self.mean_output)

    def forget(self, number: int) -> None:
        """Worker ``number`` restarted (maybe on other hardware)."""
        if 0 <= number < len(self._per_token):
            self._per_token[number] = math.nan


class Admission:
    """Refuses a request whose worker should miss ``shed_after`` to its first token, or
    its deadline to its last (see the module docstring)."""

    def __init__(self, shed_after: float | None = None, deadline: float | None = None) -> None:
        self.shed_after = shed_after
        """Seconds to the first token past which a request is shed; None: never."""
        self.deadline = deadline
        """Seconds to the last token past which a request is shed, unless it says its
        own; None: only by its own."""
        self.decode_times = DecodeTimes()

    def predicted_end(
        self,
        number: int,
        predicted_ttft: float,
        max_tokens: int | None,
        ignores_eos: bool,
        now: float,
    ) -> float:
        """Seconds from now to the last token of a request on worker ``number``: the
        first token's and the output's after it, each where known (the output's alone
        is a lower bound until the first tokens are learned); NaN: neither known."""
        output = self.decode_times.expected_output(max_tokens, ignores_eos)
        decode = math.nan
        if output > 1:  # (False for NaN)
            decode = (output - 1) * self.decode_times.per_token(number, now)
        elif output == 1:
            decode = 0.0
        if math.isnan(predicted_ttft):
            return decode if decode > 0 else math.nan
        return predicted_ttft if math.isnan(decode) else predicted_ttft + decode

    def sheds(
        self, predicted_ttft: float, predicted_end: float, deadline: float | None
    ) -> str | None:
        """The limit a request passes, ``"first_token"`` or ``"deadline"`` (None: it is
        admitted; NaN predictions always are)."""
        if self.shed_after is not None and predicted_ttft > self.shed_after:
            return "first_token"
        limit = self.deadline if deadline is None else deadline
        return "deadline" if limit is not None and predicted_end > limit else None
