"""Which router's TTFT p90 is lower, per repetition and stage, beyond what the stage's
sample of requests can tell: kvbus's ``kv`` against the best peer of each repetition, from
the ``--json`` of ``bench/bench_fleet_routing.py``.

A stage's p90 is one order statistic of a few hundred requests (of 250, the 25th
slowest), so two routers a few ms apart may differ by which requests happened to fall
near it. Every router runs the same arrivals, so the comparison is paired: each of
``resamples`` draws the stage's requests with replacement (the requests that arrive at
one instant, a burst's siblings, drawn together), and takes the difference of the two
routers' p90 over the same draw. The verdict is "ahead" or "behind" only when the
central 95% of those differences excludes 0 (or the goodputs differ: a request lost
outweighs any p90); otherwise "within noise".

What this cannot see: the run-to-run noise of the machine (a router's p90 over the same
plan moves between runs, by up to 19 ms in (f) here), which only repeated runs measure:
kv against its own rerun read "behind" in 2 of 18 stage-repetitions (BENCHMARKS.md).
One run's "ahead" or "behind" is worth a rerun before it is believed: given several
results files (several runs of the same plans), each router's runs of a repetition are
pooled (its p90 is of all their requests; a request drawn in a resample is drawn in
every run of both routers), and a run copied into several files counts once. Stages of fewer
than `MIN_CLUSTERS` observations are "within noise" whatever they read. Two bursts
arriving within `BURST_GAP` of each other are drawn as one (the JSON does not say which
prompt a request had): that widens the interval, never narrows it.

A repetition is one draw of the scenario's arrivals, and which engine a stage's random
traffic peaks on is part of the draw. Whether a peer wins a stage, rather than one draw of
it, is read over every repetition (`stage_verdicts`, printed below the rows when there
are several): kv against each peer on all the repetitions' requests together, and in how
many repetitions its p90 was at or under the peer's.

    python bench/fleet_verdicts.py RESULTS.json [MORE.json ...] [--router kv] [--resamples 2000]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbus.routing.cost import Policy

FAILED = 1e6
"""A failed or unanswered request's TTFT for the statistics (seconds): slower than any."""
CONFIDENCE = 0.95
MIN_CLUSTERS = 20
"""Fewer observations than this (requests, a burst counting once) tell nothing apart."""
OWN = frozenset(policy.value for policy in Policy)
"""kvbus's own policies: not peers."""
VERDICTS = ("ahead", "within noise", "behind")
"""Of the first router against the other: more requests within the SLO, or as many and
a p90 lower in 95% of the resamples; neither; the reverse."""


@dataclass(frozen=True)
class Difference:
    """``ours`` p90 less ``theirs``, in seconds, and its resampled central interval."""

    ours: float
    theirs: float
    low: float
    high: float
    observations: int = MIN_CLUSTERS

    @property
    def value(self) -> float:
        return self.ours - self.theirs

    @property
    def verdict(self) -> str:
        if self.observations < MIN_CLUSTERS:
            return "within noise"
        if self.high < 0:
            return "ahead"
        if self.low > 0:
            return "behind"
        return "within noise"


def paired_p90_difference(
    ours: Sequence[float] | Sequence[Sequence[float]],
    theirs: Sequence[float] | Sequence[Sequence[float]],
    resamples: int = 2000,
    seed: int = 0,
    clusters: Sequence[Hashable] | None = None,
) -> Difference:
    """The p90 of ``ours`` less that of ``theirs``, where ``ours[i]`` and ``theirs[i]`` are
    the same request's TTFT under two routers (``math.inf`` or ``nan``: it failed).

    Either may be several runs of the same requests (a row per run, as many rows as
    there were runs): its p90 is then of all its runs' requests, and a request drawn in a
    resample is drawn in every run. ``clusters`` (one label per request) resamples
    requests that share a label together: siblings of one burst wait for one prefill and
    share a TTFT, so they are one observation, not eight. Default: every request apart."""
    a = _runs(ours)
    b = _runs(theirs)
    if a.shape[1] != b.shape[1] or not a.shape[1]:
        raise ValueError(f"need two equal, non-empty samples, got {a.shape[1]} and {b.shape[1]}")
    labels = list(range(a.shape[1])) if clusters is None else list(clusters)
    if len(labels) != a.shape[1]:
        raise ValueError(f"{len(labels)} cluster labels for {a.shape[1]} requests")
    code = {label: i for i, label in enumerate(dict.fromkeys(labels))}
    of_request = np.array([code[label] for label in labels])
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(code), np.full(len(code), 1 / len(code)), size=resamples)
    weights = counts[:, of_request]  # how often each request is in each resample
    differences = _weighted_p90(a.ravel(), np.tile(weights, len(a))) - _weighted_p90(
        b.ravel(), np.tile(weights, len(b))
    )
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(differences, [tail, 1 - tail])
    return Difference(_quantile(a, 0.9), _quantile(b, 0.9), float(low), float(high), len(code))


def _runs(sample: Sequence[float] | Sequence[Sequence[float]]) -> np.ndarray:
    """A sample as a 2-D array of finite TTFTs, a row per run."""
    array = _finite(sample)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2:
        raise ValueError(f"a sample is a run or a list of runs, not {array.ndim}-D")
    return array


def _weighted_p90(values: np.ndarray, weights: np.ndarray) -> Any:
    """The p90 (`_quantile`) of each row's sample, where ``weights[r, i]`` copies of
    ``values[i]`` are in row ``r``: the first value, in sorted order, whose cumulative
    count passes the index."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[:, order], axis=1)
    total = cumulative[:, -1]
    index = np.minimum(total - 1, np.floor(0.9 * total))
    return values[order][(cumulative > index[:, None]).argmax(axis=1)]


def _finite(values: Sequence[float] | Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    """TTFTs (one run, or a row per run) as floats, a failure as `FAILED`."""
    array = np.asarray(values, dtype=float)
    return np.where(np.isfinite(array), array, FAILED)


@dataclass(frozen=True)
class Row:
    stage: str
    repetition: int
    peer: str
    """The best peer in this repetition and stage: the most within the SLO, then the
    lowest p90."""
    difference: Difference
    good: float
    peer_good: float
    p99: float
    peer_p99: float
    """The tail beyond the p90: a router that piles a fault's misses on one engine can
    keep them under a tenth of the requests (its p90 low) and far slower (its p99 high)."""
    runs: int = 1
    peer_runs: int = 1
    """Runs pooled (``good`` and ``peer_good`` are their mean)."""
    ours: str = ""
    """The router's runs compared (`_grouped`): its name, with ``@speedup`` where it ran
    at several."""

    @property
    def verdict(self) -> str:
        return _verdict(self.good, self.peer_good, self.difference)


def _verdict(good: float, peer_good: float, difference: Difference) -> str:
    """Goodput first (a request lost outweighs any p90), then the p90's."""
    if good != peer_good:
        return "ahead" if good > peer_good else "behind"
    return difference.verdict


def rows(
    scenario: dict[str, Any], router: str, slo: float, resamples: int,
    peers: Collection[str] | None = None,
) -> list[Row]:  # fmt: skip
    """Per stage (warm-up aside) and repetition, ``router`` against the best of ``peers``
    (default: every router in ``scenario`` but kvbus's own) in that repetition and stage;
    ``scenario`` is one entry of the JSON's ``scenarios``, or several runs' entries with
    their ``runs`` put together (`merged`): a router's runs of one repetition pool."""
    by_run, repetitions, named, stages, against = _grouped(scenario, router, peers)
    out: list[Row] = []
    for stage in stages:
        for repetition in repetitions:
            candidates = []
            for peer in named:
                mine = against[peer]
                if (peer, repetition) not in by_run or (mine, repetition) not in by_run:
                    continue
                ours = [_stage_ttfts(run, stage) for run in by_run[(mine, repetition)]]
                theirs = [_stage_ttfts(run, stage) for run in by_run[(peer, repetition)]]
                if ours[0]:
                    candidates.append(
                        (-_good(theirs, slo), _quantile(theirs, 0.9), peer, mine, ours, theirs)
                    )
            if not candidates:
                continue
            # The best peer as the verdict ranks: the most within the SLO, then the p90.
            *_, peer, mine, ours, theirs = min(candidates, key=lambda c: (c[0], c[1], c[2]))
            first = by_run[(mine, repetition)][0]
            clusters = _bursts([q for q in first if q[1] == stage])
            out.append(
                Row(
                    stage, repetition, peer,
                    paired_p90_difference(ours, theirs, resamples, repetition, clusters),
                    _good(ours, slo), _good(theirs, slo),
                    _quantile(ours, 0.99), _quantile(theirs, 0.99),
                    len(ours), len(theirs), mine,
                )
            )  # fmt: skip
    return out


Runs = dict[tuple[str, int], list[list[list[Any]]]]
"""(router, repetition) -> the requests of each of its runs (bench rows)"""


def _grouped(
    scenario: dict[str, Any], router: str, peers: Collection[str] | None
) -> tuple[Runs, list[int], list[str], list[str], dict[str, str]]:
    """The scenario's runs by router and repetition (a run copied into two results files
    once), ``router``'s repetitions, the peers (default: every router but kvbus's own),
    the stages (warm-up aside), and which of ``router``'s runs each peer is against;
    every peer's run checked to be of the plan of the runs it is against.

    A router that ran at several speedups of the sim (the bench's ``speedup`` of a
    run, ``--speedup-for``) is several: ``kv@0.1`` and ``kv@0.025``, never pooled (its
    wall time counts for more at the higher). A peer is against ``router``'s runs at
    its own speedup where there are any (the same engines), else at the first speedup
    ``router`` ran at."""
    speeds: dict[str, list[Any]] = {}
    for run in scenario["runs"]:
        seen = speeds.setdefault(run["router"], [])
        if run.get("speedup") not in seen:
            seen.append(run.get("speedup"))

    def label(name: str, speedup: Any) -> str:
        return name if len(speeds[name]) < 2 else f"{name}@{speedup:g}"

    by_run: Runs = {}
    speed_of: dict[str, Any] = {}
    for run in scenario["runs"]:
        name = label(run["router"], run.get("speedup"))
        speed_of[name] = run.get("speedup")
        runs = by_run.setdefault((name, run["repetition"]), [])
        if run["requests"] not in runs:  # a run copied into two results files: once
            runs.append(run["requests"])
    mine = [label(router, s) for s in speeds.get(router, [])]
    repetitions = sorted({rep for name, rep in by_run if name in mine})
    if peers is None:
        peers = {name for name in speeds if name not in OWN}
    named = sorted(
        label(name, s) for name in set(peers) - {router} if name in speeds for s in speeds[name]
    )
    against = {
        peer: next((m for m in mine if speed_of[m] == speed_of[peer]), mine[0] if mine else "")
        for peer in named
    }
    for (name, repetition), runs in by_run.items():
        if name not in named or (against[name], repetition) not in by_run:
            continue
        for requests in runs:
            _check_paired(by_run[(against[name], repetition)][0], requests, name)
    stages = (
        list(dict.fromkeys(q[1] for q in by_run[(mine[0], repetitions[0])][0]))
        if repetitions and (mine[0], repetitions[0]) in by_run
        else []
    )
    return by_run, repetitions, named, [s for s in stages if s != "warm-up"], against


@dataclass(frozen=True)
class StageVerdict:
    """``router`` against one peer over every repetition of a stage: whether the peer
    wins the stage, not one draw of its arrivals."""

    stage: str
    peer: str
    difference: Difference
    """The p90 of all the repetitions' requests together, and its resampled interval."""
    good: float
    peer_good: float
    """Requests within the SLO, summed over the repetitions (each the mean of its runs)."""
    repetitions: int
    at_or_under: int
    """Repetitions where ``router``'s p90 was at or under the peer's."""
    ours: str = ""
    """The router's runs compared (as `Row.ours`)."""

    @property
    def verdict(self) -> str:
        return _verdict(self.good, self.peer_good, self.difference)


def stage_verdicts(
    scenario: dict[str, Any], router: str, slo: float, resamples: int,
    peers: Collection[str] | None = None,
) -> list[StageVerdict]:  # fmt: skip
    """Per stage and peer, ``router`` against that peer over every repetition both ran.
    A repetition's requests are paired as in `rows`; the repetitions' samples are joined
    (a router's runs of each: the first as many as its fewest in any repetition, so that
    each resample draws a request in the same number of runs everywhere); a resample
    draws among all the repetitions' requests (a burst's siblings together)."""
    by_run, repetitions, named, stages, against = _grouped(scenario, router, peers)
    out: list[StageVerdict] = []
    for stage in stages:
        for peer in named:
            mine = against[peer]
            both = [r for r in repetitions if (peer, r) in by_run and (mine, r) in by_run]
            if not both:
                continue
            ours = [[_stage_ttfts(run, stage) for run in by_run[(mine, r)]] for r in both]
            theirs = [[_stage_ttfts(run, stage) for run in by_run[(peer, r)]] for r in both]
            if not all(runs[0] for runs in ours):
                continue
            clusters: list[tuple[int, int]] = []
            for r in both:
                first = [q for q in by_run[(mine, r)][0] if q[1] == stage]
                clusters += [(r, label) for label in _bursts(first)]
            difference = paired_p90_difference(
                _joined(ours), _joined(theirs), resamples, 0, clusters
            )
            under = sum(
                _quantile(a, 0.9) <= _quantile(b, 0.9) for a, b in zip(ours, theirs, strict=True)
            )
            out.append(
                StageVerdict(
                    stage, peer, difference,
                    sum(_good(runs, slo) for runs in ours),
                    sum(_good(runs, slo) for runs in theirs),
                    len(both), under, mine,
                )
            )  # fmt: skip
    return out


def _joined(repetitions: list[list[list[float]]]) -> list[list[float]]:
    """Each repetition's runs (TTFTs of its stage) joined end to end into rows, one per
    run: as many rows as the fewest runs any repetition has."""
    runs = min(len(r) for r in repetitions)
    return [[t for r in repetitions for t in r[k]] for k in range(runs)]


def merged(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The scenarios of several results files, each with the runs of all of them (of the
    same plans: `rows` refuses runs of other arrivals)."""
    scenarios: dict[str, dict[str, Any]] = {}
    for report in reports:
        for key, scenario in report["scenarios"].items():
            into = scenarios.setdefault(key, {**scenario, "runs": []})
            into["runs"] = into["runs"] + scenario["runs"]
    return scenarios


def _check_paired(ours: list[list[Any]], theirs: list[list[Any]], peer: str) -> None:
    """Both runs are of one plan: the same arrivals (time, stage, kind) in the same order."""
    if [q[:3] for q in ours] != [q[:3] for q in theirs]:
        raise ValueError(f"{peer}'s run is not of the same arrivals as the router's")


BURST_GAP = 1e-3
"""Seconds (simulated) within which a burst's requests arrive (the bench: 0.1 ms apart)."""


def _bursts(requests: list[list[Any]]) -> list[int]:
    """A label per request: one burst's siblings (kind "burst", each within `BURST_GAP`
    of the one before) share one; every other request has its own."""
    labels: list[int] = []
    for i, q in enumerate(requests):
        previous = requests[i - 1] if i else None
        same = (
            previous is not None
            and q[2] == previous[2] == "burst"
            and 0 <= q[0] - previous[0] < BURST_GAP
        )
        labels.append(labels[-1] if same else i)
    return labels


def _stage_ttfts(requests: list[list[Any]], stage: str) -> list[float]:
    """Each of the stage's requests' TTFT (simulated seconds), ``inf`` where it failed;
    rows are the bench's ``[at, stage, kind, status, ttft, prompt, cached, worker, bound,
    admitted_bound]`` (status 0: failed or timed out, its ttft that of a first token that
    came; the last: the offline bound of what a run that shed admitted, else None)."""
    return [q[4] if q[3] == 200 and q[4] > 0 else math.inf for q in requests if q[1] == stage]


def _quantile(ttfts: Sequence[float] | Sequence[Sequence[float]] | np.ndarray, q: float) -> float:
    """The bench's quantile (`bench_fleet_routing._quantile`): the value at index
    ``int(q * n)`` of the sorted sample (of all its runs), a failure counting as `FAILED`."""
    ordered = np.sort(_finite(ttfts).ravel())
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _good(runs: list[list[float]], slo: float) -> float:
    """Requests within the SLO, the mean over the runs."""
    return sum(sum(1 for t in ttfts if t <= slo) for ttfts in runs) / len(runs)


def table(
    scenario: dict[str, Any], router: str = "kv", slo: float = 1.0, resamples: int = 2000,
    peers: Collection[str] | None = None,
) -> str:  # fmt: skip
    """The verdicts of one scenario (`rows`), a line each, and a count of them."""
    found = rows(scenario, router, slo, resamples, peers)
    if not found:
        return f"(no {router} run beside a peer on the same plans)"
    head = (
        f"{'stage':10} {'rep':>3} {'best peer':29} {router + ' p90':>8} {'peer p90':>8} "
        f"{'diff':>6} {'95% of resamples':>17} {'good':>9} {'verdict':12} "
        f"{'p99 ' + router + '/peer':>14}"
    )
    pooled = any(row.runs > 1 or row.peer_runs > 1 for row in found)
    if pooled:
        head += " runs"
    lines = [head, "-" * len(head)]
    counts: dict[str, int] = {}
    for row in found:
        d = row.difference
        verdict = row.verdict
        counts[verdict] = counts.get(verdict, 0) + 1
        lines.append(
            f"{row.stage:10} {row.repetition + 1:>3} {row.peer:29} {_ms(d.ours):>8} "
            f"{_ms(d.theirs):>8} {_ms(d.value, sign=True):>6} "
            f"{_interval(d):>17} {f'{_count(row.good)}/{_count(row.peer_good)}':>9} {verdict:12} "
            f"{_ms(row.p99) + '/' + _ms(row.peer_p99):>14}"
            + (f" {row.runs}/{row.peer_runs}" if pooled else "")
        )
    lines.append(
        _tally(counts, router, f"{len(found)} stage-repetitions against the best peer of each "
               "(by goodput, then TTFT p90 in ms)")
    )  # fmt: skip
    lines += _pairs(found, router)
    if len({row.repetition for row in found}) > 1:
        lines += ["", _stage_table(stage_verdicts(scenario, router, slo, resamples, peers), router)]
    return "\n".join(lines)


def _stage_table(found: list[StageVerdict], router: str) -> str:
    """`stage_verdicts` a line each, and a count of them."""
    head = (
        f"{'stage':10} {'peer':29} {router + ' p90':>8} {'peer p90':>8} {'diff':>6} "
        f"{'95% of resamples':>17} {'good':>11} {'verdict':12} {'reps at or under':>16}"
    )
    lines = ["over the repetitions, against each peer:", head, "-" * len(head)]
    counts: dict[str, int] = {}
    for row in found:
        d = row.difference
        counts[row.verdict] = counts.get(row.verdict, 0) + 1
        lines.append(
            f"{row.stage:10} {row.peer:29} {_ms(d.ours):>8} {_ms(d.theirs):>8} "
            f"{_ms(d.value, sign=True):>6} "
            f"{_interval(d):>17} {f'{_count(row.good)}/{_count(row.peer_good)}':>11} "
            f"{row.verdict:12} "
            f"{f'{row.at_or_under} of {row.repetitions}':>16}"
        )
    lines.append(
        _tally(counts, router, f"{len(found)} stages against each peer over every repetition")
    )
    return "\n".join(lines + _pairs(found, router))


def _pairs(found: Sequence[Row] | Sequence[StageVerdict], router: str) -> list[str]:
    """Which of ``router``'s runs each peer was against, where it ran at several speedups."""
    pairs = {row.peer: row.ours for row in found if row.ours and row.ours != router}
    if not pairs:
        return []
    said = ", ".join(f"{peer} against {ours}" for peer, ours in pairs.items())
    return [
        f"({router} ran at several speedups; each peer against its runs at the peer's own "
        f"where there are any: {said})"
    ]


def _interval(d: Difference) -> str:
    """The central 95% of the resampled differences, in ms."""
    return f"[{_ms(d.low, sign=True)}, {_ms(d.high, sign=True)}]"


def _tally(counts: dict[str, int], router: str, of: str) -> str:
    """The summary line under a table: how many of each verdict, of what."""
    return f"{router}: " + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS) + f" of {of}"


def _count(requests: float) -> str:
    """A count of requests, or a mean of counts over runs."""
    return f"{requests:.0f}" if requests == int(requests) else f"{requests:.1f}"


def _ms(seconds: float, sign: bool = False) -> str:
    """Milliseconds; a p90 of failed requests reads "failed", a difference with one "inf"."""
    if abs(seconds) >= FAILED / 2:
        if not sign:
            return "failed"
        return "+inf" if seconds > 0 else "-inf"
    digits = 1 if abs(seconds) < 1e-3 else 0  # not "+0" for a bound just over 0
    return f"{seconds * 1000:+.{digits}f}" if sign else f"{seconds * 1000:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results", type=Path, nargs="+",
        help="bench_fleet_routing.py's --json; several: runs of the same plans, pooled",
    )  # fmt: skip
    parser.add_argument("--router", default="kv")
    parser.add_argument("--resamples", type=int, default=2000)
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.results]
    slos = {float(report.get("args", {}).get("slo", 1.0)) for report in reports}
    if len(slos) > 1:
        parser.error(f"the results were run with different SLOs: {sorted(slos)}")
    slo = slos.pop()
    for key, scenario in merged(reports).items():
        print(f"\n({key}) {scenario['title']}")
        print(table(scenario, args.router, slo, args.resamples))


if __name__ == "__main__":
    main()
