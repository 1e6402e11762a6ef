"""bench/fleet_verdicts.py: kv against the best peer, request by request."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import numpy as np
import pytest

from bench import fleet_verdicts
from bench.fleet_verdicts import paired_p90_difference, rows, table


def _ttfts(n: int, seed: int, scale: float = 0.05) -> list[float]:
    rng = random.Random(seed)
    return [rng.expovariate(1 / scale) for _ in range(n)]


def test_the_same_sample_is_within_noise_with_an_interval_of_zero() -> None:
    sample = _ttfts(300, 1)
    d = paired_p90_difference(sample, sample)
    assert (d.value, d.low, d.high) == (0, 0, 0)
    assert d.verdict == "within noise"


def test_a_router_faster_on_every_request_is_ahead_and_the_reverse_behind() -> None:
    theirs = _ttfts(300, 2)
    ours = [t * 0.8 for t in theirs]
    d = paired_p90_difference(ours, theirs)
    assert d.value < 0 and d.high < 0
    assert d.verdict == "ahead"
    assert paired_p90_difference(theirs, ours).verdict == "behind"


def test_a_few_slow_requests_near_the_p90_are_within_noise() -> None:
    """Two samples that differ only in which 3 of 300 requests were slow: their p90s
    differ, but the resamples cannot tell them apart."""
    ours = _ttfts(300, 3)
    theirs = list(ours)
    order = sorted(range(300), key=lambda i: ours[i])
    for i in order[271:274]:  # just over the p90 (index 270 of 300) in ours: under it
        theirs[i] = ours[order[100]]
    d = paired_p90_difference(ours, theirs)
    assert d.value > 0
    assert d.verdict == "within noise"
    assert d.low <= 0 <= d.high


def test_failed_requests_are_slower_than_any_served() -> None:
    ours = _ttfts(100, 4)
    theirs = list(ours)
    for i in range(20):  # a fifth failed: their p90 is a failure
        theirs[i] = math.inf
    d = paired_p90_difference(ours, theirs)
    assert d.theirs == fleet_verdicts.FAILED
    assert d.verdict == "ahead"


def test_the_samples_must_be_paired() -> None:
    with pytest.raises(ValueError, match="equal"):
        paired_p90_difference([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="non-empty"):
        paired_p90_difference([], [])


def _run(router: str, repetition: int, ttfts: list[float], stage: str = "steady") -> Any:
    warm = [[0.0, "warm-up", "warm-up", 200, 0.5, 100, 0, "sim-0"]]
    requests = [
        [i * 0.01, stage, "", 200 if math.isfinite(t) else 0, t if math.isfinite(t) else -1,
         100, 50, "sim-0"]
        for i, t in enumerate(ttfts)
    ]  # fmt: skip
    return {"router": router, "repetition": repetition, "requests": warm + requests}


def test_each_repetition_is_against_its_own_best_peer_and_kvbus_policies_are_not_peers() -> None:
    base = _ttfts(200, 5)
    scenario = {
        "title": "t",
        "runs": [
            _run("kv", 0, base),
            _run("kv", 1, base),
            _run("round_robin", 0, [t * 0.1 for t in base]),  # kvbus's own: not a peer
            _run("round_robin", 1, [t * 0.1 for t in base]),
            _run("sglang-cache_aware", 0, [t * 0.9 for t in base]),
            _run("sglang-cache_aware", 1, [t * 1.5 for t in base]),
            _run("vllm-router-cache_aware", 0, [t * 1.2 for t in base]),
            _run("vllm-router-cache_aware", 1, [t * 1.1 for t in base]),
        ],
    }
    found = rows(scenario, "kv", slo=1.0, resamples=500)
    assert [(r.stage, r.repetition, r.peer) for r in found] == [
        ("steady", 0, "sglang-cache_aware"),
        ("steady", 1, "vllm-router-cache_aware"),
    ]
    assert [r.difference.verdict for r in found] == ["behind", "ahead"]
    printed = table(scenario, "kv", 1.0, 500)
    assert "1 ahead, 0 within noise, 1 behind of 2" in printed


def test_goodput_decides_before_the_p90() -> None:
    """A peer that served one request fewer within the SLO is behind, whatever its p90."""
    ours = _ttfts(100, 6, scale=0.01)
    theirs = [t * 0.5 for t in ours]
    theirs[0] = 5.0  # over the 1 s SLO
    scenario = {"title": "t", "runs": [_run("kv", 0, ours), _run("sglang-cache_aware", 0, theirs)]}
    printed = table(scenario, "kv", 1.0, 500)
    line = next(x for x in printed.splitlines() if x.startswith("steady"))
    fields = line.split()
    assert fields[-2] == "ahead"
    assert "100/99" in fields


def test_a_scenario_without_kv_beside_a_peer_says_so() -> None:
    scenario = {"title": "t", "runs": [_run("kv", 0, _ttfts(50, 7))]}
    assert rows(scenario, "kv", 1.0, 100) == []
    assert "no kv run beside a peer" in table(scenario)


def test_a_bursts_siblings_are_resampled_together() -> None:
    """20 bursts of 8 siblings sharing a TTFT; the peer served the two slowest bursts
    fast. Drawn request by request, 16 requests' difference looks certain; drawn by burst,
    it rests on two observations of twenty, and no draw of them is not rare (12%)."""
    ours = [(burst + 1) / 1000 for burst in range(20) for _ in range(8)]
    theirs = [t if t < 0.019 else 0.0005 for t in ours]
    apart = paired_p90_difference(ours, theirs)
    assert apart.verdict == "behind"
    bursts = [i // 8 for i in range(160)]
    together = paired_p90_difference(ours, theirs, clusters=bursts)
    assert together.value == apart.value > 0
    assert together.verdict == "within noise"
    assert together.low <= 0 < together.high


def test_a_bursts_siblings_are_told_by_kind_and_arrival() -> None:
    requests = [
        [0.1, "s", "burst", 200, 0.1],
        [0.1001, "s", "burst", 200, 0.1],
        [0.1002, "s", "burst", 200, 0.1],
        [0.1003, "s", "shared", 200, 0.1],  # not a burst: its own
        [0.1004, "s", "shared", 200, 0.1],
        [0.3, "s", "burst", 200, 0.1],  # the next burst
        [0.3001, "s", "burst", 200, 0.1],
    ]
    labels = fleet_verdicts._bursts(requests)
    assert labels == [0, 0, 0, 3, 4, 5, 5]


def test_the_resampled_p90_is_the_benchs_order_statistic_of_each_draw() -> None:
    """Each weight row is a sample with that many copies of each value; its p90 is the
    bench's (sorted, index int(0.9 n)), ties and failures included."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        values = fleet_verdicts._finite(
            [math.inf if rng.random() < 0.1 else float(rng.integers(0, 6)) for _ in range(n)]
        )
        weights = rng.integers(0, 4, size=(10, n))
        weights[:, 0] += 1  # no empty sample
        got = fleet_verdicts._weighted_p90(values, weights)
        for row, value in zip(weights, got, strict=True):
            expanded = sorted(np.repeat(values, row))
            assert value == expanded[int(0.9 * len(expanded))]


def test_a_failed_request_is_not_good_and_slowest_in_the_rows() -> None:
    ours = [0.05] * 30
    theirs = [0.05] * 30
    theirs[3] = math.inf  # status 0: failed
    scenario = {"title": "t", "runs": [_run("kv", 0, ours), _run("sglang-cache_aware", 0, theirs)]}
    (row,) = rows(scenario, "kv", slo=0.05, resamples=200)
    assert (row.good, row.peer_good) == (30, 29)  # a TTFT at the SLO is good
    assert row.peer_p99 == fleet_verdicts.FAILED
    assert row.p99 == 0.05


def test_the_best_peer_is_the_one_with_most_within_the_slo_then_the_lowest_p90() -> None:
    base = _ttfts(100, 8, scale=0.01)
    fast_but_lossy = [t * 0.5 for t in base]
    fast_but_lossy[0] = 5.0
    scenario = {
        "title": "t",
        "runs": [
            _run("kv", 0, base),
            _run("sglang-cache_aware", 0, fast_but_lossy),
            _run("vllm-router-cache_aware", 0, [t * 0.9 for t in base]),
        ],
    }
    (row,) = rows(scenario, "kv", slo=1.0, resamples=200)
    assert row.peer == "vllm-router-cache_aware"


def test_runs_of_different_arrivals_are_refused() -> None:
    other = _run("sglang-cache_aware", 0, _ttfts(50, 9))
    other["requests"][5][0] += 0.5  # not the same plan
    scenario = {"title": "t", "runs": [_run("kv", 0, _ttfts(50, 9)), other]}
    with pytest.raises(ValueError, match="same arrivals"):
        rows(scenario, "kv", 1.0, 100)


def test_a_stage_of_few_observations_is_within_noise_whatever_it_reads() -> None:
    ours = [0.01] * 10
    theirs = [0.5] * 10
    assert paired_p90_difference(ours, theirs).verdict == "within noise"
    assert paired_p90_difference(ours * 2, theirs * 2).verdict == "ahead"


def test_runs_pool_into_one_p90_and_a_run_in_two_files_counts_once() -> None:
    """Two runs of kv on one plan, a third the first's copy (results merged into another
    file); kv's p90 is that of both runs' requests, its goodput their mean."""
    fast, slow = _ttfts(200, 10, scale=0.02), _ttfts(200, 11, scale=0.08)
    slow[0] = 5.0  # one request over the SLO in the second run
    peer = _ttfts(200, 12, scale=0.05)
    first = {"args": {"slo": 1.0}, "scenarios": {"c": {"title": "t", "runs": [
        _run("kv", 0, fast), _run("sglang-cache_aware", 0, peer)]}}}  # fmt: skip
    second = {"args": {"slo": 1.0}, "scenarios": {"c": {"title": "t", "runs": [
        _run("kv", 0, slow), _run("kv", 0, fast)]}}}  # fmt: skip
    scenario = fleet_verdicts.merged([first, second])["c"]
    assert len(scenario["runs"]) == 4
    (row,) = rows(scenario, "kv", 1.0, 300)
    assert (row.runs, row.peer_runs) == (2, 1)
    pooled = sorted(fast + slow)
    assert row.difference.ours == pooled[int(0.9 * len(pooled))]
    assert row.good == 199.5 and row.peer_good == 200
    assert row.verdict == "behind"  # half a request more failed on average
    printed = table(scenario, "kv", 1.0, 300)
    assert "199.5/200" in printed and printed.splitlines()[2].endswith(" 2/1")


def test_a_run_twice_resamples_as_the_run_once() -> None:
    """Pooled runs draw a request in every run at once: two copies of one run are the
    run, to the p90 and its interval."""
    ours, theirs = _ttfts(300, 13), _ttfts(300, 14)
    once = paired_p90_difference(ours, theirs, resamples=400)
    twice = paired_p90_difference([ours, ours], [theirs, theirs, theirs], resamples=400)
    assert (twice.ours, twice.theirs, twice.low, twice.high) == (
        once.ours, once.theirs, once.low, once.high,
    )  # fmt: skip


def test_runs_that_miss_the_p90_on_either_side_pool_to_within_noise() -> None:
    """The lottery of a p90 at a cliff: in each router's runs, 15 or 40 of 250 requests
    are slow, the other way round in the peer's. Each run alone is "ahead" or "behind";
    pooled, the two routers are the same."""

    def run(slow: int) -> list[float]:
        return [0.2] * slow + [0.03] * (250 - slow)

    lucky, unlucky = run(15), run(40)
    assert paired_p90_difference(lucky, unlucky).verdict == "ahead"
    assert paired_p90_difference(unlucky, lucky).verdict == "behind"
    assert paired_p90_difference([lucky, unlucky], [unlucky, lucky]).verdict == "within noise"


def test_results_of_different_slos_are_refused(tmp_path: Any, capsys: Any) -> None:
    paths = []
    for i, slo in enumerate((1.0, 2.0)):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"args": {"slo": slo}, "scenarios": {}}))
        paths.append(str(path))
    with pytest.raises(SystemExit):
        fleet_verdicts.main(paths)
    assert "different SLOs" in capsys.readouterr().err


def test_over_the_repetitions_each_peer_is_judged_on_all_their_requests() -> None:
    """kv is slower than sglang-router in one repetition and faster in the other, by
    a margin each way; over both, its p90 is that of both repetitions' requests, one
    repetition of two at or under the peer's, and the peer with the lowest p90 in each
    repetition is not what decides: each peer has its own line."""
    fast, slow = _ttfts(250, 20, scale=0.02), _ttfts(250, 21, scale=0.08)
    scenario = {"title": "t", "runs": [_run("kv", 0, fast), _run("kv", 1, slow)]}
    for repetition, sglang, vllm in ((0, slow, slow), (1, [t * 0.5 for t in fast], slow)):
        scenario["runs"] += [
            _run("sglang-cache_aware", repetition, sglang),
            _run("vllm-router-cache_aware", repetition, [t * 3 for t in vllm]),
        ]
    found = fleet_verdicts.stage_verdicts(scenario, "kv", 1.0, 300)
    assert [(v.stage, v.peer, v.repetitions) for v in found] == [
        ("steady", "sglang-cache_aware", 2),
        ("steady", "vllm-router-cache_aware", 2),
    ]
    sglang, vllm = found
    joined = sorted(fast + slow)
    assert sglang.difference.ours == joined[int(0.9 * len(joined))]
    assert sglang.at_or_under == 1 and vllm.at_or_under == 2
    assert vllm.verdict == "ahead"
    assert sglang.good == vllm.good == 500
    printed = table(scenario, "kv", 1.0, 300)
    assert "over the repetitions, against each peer:" in printed
    assert "of 2 stages against each peer over every repetition" in printed
    assert printed.splitlines()[-3].split()[-3:] == ["1", "of", "2"]


def test_over_the_repetitions_a_router_counts_as_many_runs_in_each() -> None:
    """Two runs of kv in the first repetition, one in the second: the joined sample
    keeps the first run of each, so every resample draws in one run everywhere."""
    a, b, c = _ttfts(100, 22), _ttfts(100, 23), _ttfts(100, 24)
    peer = _ttfts(100, 25)
    ours = [_run("kv", 0, a), _run("kv", 0, b), _run("kv", 1, c)]
    theirs = [_run("sglang-cache_aware", repetition, peer) for repetition in (0, 1)]
    scenario = {"title": "t", "runs": ours + theirs}
    (verdict,) = fleet_verdicts.stage_verdicts(scenario, "kv", 1.0, 200)
    joined = sorted(a + c)
    assert verdict.difference.ours == joined[int(0.9 * len(joined))]
    assert verdict.good == 200  # the first repetition's mean of its two runs, plus 100


def test_one_repetition_prints_no_summary_over_the_repetitions() -> None:
    scenario = {"title": "t", "runs": [_run("kv", 0, _ttfts(50, 26)),
                                       _run("sglang-cache_aware", 0, _ttfts(50, 27))]}  # fmt: skip
    assert "over the repetitions" not in table(scenario, "kv", 1.0, 100)


def _at(speedup: float, run: dict[str, Any]) -> dict[str, Any]:
    return {**run, "speedup": speedup}


def test_each_peer_is_against_kv_at_its_own_speedup_and_the_speeds_never_pool() -> None:
    """kv ran at 0.1 beside sglang-router and at 0.025 beside vllm-router (the bench's
    --kv-at-every-speedup). Its runs at 0.1 are slower than vllm-router's, its runs at
    0.025 faster: vllm-router is judged against the latter, sglang-router against the
    former, and kv's two speeds are two routers, not two runs of one."""
    base = _ttfts(250, 30)
    runs = []
    for repetition in (0, 1):
        runs += [
            _at(0.1, _run("kv", repetition, [t * 1.5 for t in base])),
            _at(0.025, _run("kv", repetition, [t * 0.5 for t in base])),
            _at(0.1, _run("sglang-cache_aware", repetition, [t * 2 for t in base])),
            _at(0.025, _run("vllm-router-cache_aware", repetition, base)),
        ]
    scenario = {"title": "t", "runs": runs}
    found = rows(scenario, "kv", 1.0, 300)
    # vllm-router's p90 is the lowest, so it is each repetition's best peer, against kv@0.025
    assert [(r.peer, r.ours, r.runs, r.verdict) for r in found] == [
        ("vllm-router-cache_aware", "kv@0.025", 1, "ahead"),
        ("vllm-router-cache_aware", "kv@0.025", 1, "ahead"),
    ]
    stages = {v.peer: v for v in fleet_verdicts.stage_verdicts(scenario, "kv", 1.0, 300)}
    assert stages["sglang-cache_aware"].ours == "kv@0.1"
    assert stages["sglang-cache_aware"].verdict == "ahead"  # 1.5x against 2x
    assert stages["vllm-router-cache_aware"].ours == "kv@0.025"
    printed = table(scenario, "kv", 1.0, 300)
    assert "vllm-router-cache_aware against kv@0.025" in printed
    assert "sglang-cache_aware against kv@0.1" in printed
    # Without kv at vllm-router's speed, it is against kv's first (0.1): behind.
    alone = {"title": "t", "runs": [r for r in runs if r["router"] != "kv" or r["speedup"] == 0.1]}
    found = rows(alone, "kv", 1.0, 300)
    assert [(r.peer, r.ours, r.verdict) for r in found] == [
        ("vllm-router-cache_aware", "kv", "behind"),
    ] * 2
    assert "ran at several speedups" not in table(alone, "kv", 1.0, 300)


def test_a_peer_run_at_two_speedups_is_two_peers() -> None:
    base = _ttfts(200, 31)
    scenario = {
        "title": "t",
        "runs": [
            _at(0.1, _run("kv", 0, base)),
            _at(0.1, _run("sglang-cache_aware", 0, [t * 2 for t in base])),
            _at(0.05, _run("sglang-cache_aware", 0, [t * 0.5 for t in base])),
        ],
    }
    (row,) = rows(scenario, "kv", 1.0, 300)
    assert (row.peer, row.ours, row.peer_runs, row.verdict) == (
        "sglang-cache_aware@0.05", "kv", 1, "behind",
    )  # fmt: skip


def test_the_bench_runs_kv_beside_each_slower_peer_when_asked() -> None:
    from bench import bench_fleet_routing as bench

    policies = ["kv", "sglang-cache_aware", "vllm-router-cache_aware", "round_robin"]
    assert bench.speedups(policies, bench.parse_args([])) == {
        0.1: ["kv", "sglang-cache_aware", "round_robin"],
        0.025: ["vllm-router-cache_aware"],
    }
    paired = bench.speedups(policies, bench.parse_args(["--kv-at-every-speedup"]))
    assert paired == {
        0.1: ["kv", "sglang-cache_aware", "round_robin"],
        0.025: ["kv", "vllm-router-cache_aware"],
    }
    assert bench.speedups(["round_robin"], bench.parse_args(["--kv-at-every-speedup"])) == {
        0.1: ["round_robin"]
    }


def test_a_routers_hit_rate_is_held_to_the_bound_of_the_requests_it_served() -> None:
    """Past saturation a router that sheds serves a subset: the bound over every arrival
    counts what the shed requests would have found; ``bound_ok`` counts only those served."""
    from bench import bench_fleet_routing as bench

    Result = bench.Result
    arrivals = [bench.Arrival(0.1 * i, [1] * 100, "s", "shared") for i in range(5)]
    bound = [0, 80, 90, 40, 70]  # cached tokens each could find at best
    results = [
        Result(0, 200, "w0", 0, prompt_tokens=100, cached_tokens=0, ttft=0.1),
        Result(0, 503, "", 0),  # shed: the one with most to find
        Result(0, 200, "w0", 0, prompt_tokens=100, cached_tokens=0, ttft=0.0),  # no token
        Result(0, 200, "w1", 0, prompt_tokens=100, cached_tokens=40, ttft=0.2),
        Result(0, 0, "w1", 0, ttft=0.3),  # timed out after its first token: failed
    ]
    run = bench.Run("b", "kv", 0, arrivals, results, 1.0, {}, 0.0)
    f = bench.figures(run, ("s", 0.0, 1.0), 1.0, bound)
    assert (f.requests, f.failed) == (5, 3)
    assert f.goodput == 2 and math.isinf(f.ttft_p90)
    assert f.hit_rate == pytest.approx(40 / 200)
    assert f.bound == pytest.approx(280 / 500)
    assert f.bound_ok == pytest.approx(40 / 200)
    assert bench.figures(run, ("s", 0.0, 1.0), 1.0, None).bound_ok is None
