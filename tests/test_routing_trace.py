"""The kv policy on a real trace (a slice of Mooncake's), through simulated vLLM prefix
caches (bench/mooncake.py): the logic of placement under cache pressure, apart from
engines and timing (bench/bench_routing.py runs the same slice on real engines)."""

from __future__ import annotations

import pytest

from bench.mooncake import (
    SLICE,
    Prompts,
    SimEngine,
    Workload,
    hit_rate,
    load_trace,
    pooled_hit_rate,
    simulated_cached,
)
from bench.mooncake import simulate as simulate_router
from kvbus import AllBlocksCleared
from kvbus.routing.router import CostWeights, Router

ENGINES = 4
Setting = tuple[Prompts, int]


@pytest.fixture(scope="module")
def setting() -> Setting:
    requests = load_trace(SLICE)
    workload = Workload()
    blocks = workload.working_set(requests) // 5  # each cache a fifth of the working set
    return workload.prompts(requests), blocks


def test_kv_policy_reaches_the_offline_bound(setting: Setting) -> None:
    prompts, blocks = setting
    bound = pooled_hit_rate(prompts, ENGINES * blocks)
    unlimited = pooled_hit_rate(prompts, 10**6)
    kv = simulate_router(Router(block_size=32), prompts, ENGINES, blocks)
    engines = [SimEngine(blocks) for _ in range(ENGINES)]
    round_robin = hit_rate(prompts, engines, lambda i, tokens: i % ENGINES)
    assert 0.5 < bound <= unlimited
    assert kv >= 0.98 * bound, (kv, bound)
    assert kv > 1.5 * round_robin, (kv, round_robin)


def test_prefix_alone_thrashes_the_cache_holding_the_shared_prompt(
    setting: Setting,
) -> None:
    """Every request of the trace starts with the same block (a system prompt): weighing
    only the prefix sends new conversations to whichever worker holds it."""
    prompts, blocks = setting
    blind = Router(weights=CostWeights(eviction=0), block_size=32)
    prefix_only = simulate_router(blind, prompts, ENGINES, blocks)
    kv = simulate_router(Router(block_size=32), prompts, ENGINES, blocks)
    assert prefix_only < 0.6 * kv, (prefix_only, kv)


def test_a_cleared_engine_costs_the_offline_placement_its_cache() -> None:
    """The offline placement of a fault scenario (bench_fleet_routing's bound) empties an
    engine where the run restarts or resets it: what that engine held is recomputed once,
    and the router, told of the clear, predicts it."""
    prefix = list(range(4, 4 + 8 * 32))
    prompts = Prompts(32, [(prefix + [1000 + i] * 40, [7, 8]) for i in range(6)])
    plain = simulated_cached(Router(block_size=32), prompts, 2, 64)
    cleared = simulated_cached(Router(block_size=32), prompts, 2, 64, clears={3: [0, 1]})
    assert plain[0] == 0 and all(c >= len(prefix) for c in plain[1:])
    assert cleared[:3] == plain[:3] and cleared[3] == 0 and cleared[4:] == plain[4:]
    engine = SimEngine(64, 32)
    engine.serve([*prefix, 9], [])
    engine.take_events()
    engine.clear()
    assert engine.take_events() == [AllBlocksCleared()]
    assert engine.cached_prefix([*prefix, 9]) == 0


def test_the_bound_of_what_a_shedding_router_admitted_leaves_out_what_it_shed() -> None:
    """A conversation's second turn finds its first cached in the bound of every arrival;
    placed with only what a router admitted, a shed first turn is cached nowhere, and
    what was not shed keeps its bound."""
    from bench.bench_fleet_routing import Arrival, Plan, offline_bound

    first = list(range(4, 4 + 8 * 32))
    other = list(range(5000, 5000 + 4 * 32))
    plan = Plan(
        [Arrival(0.0, first), Arrival(0.1, [*first, *range(900, 964)]), Arrival(0.2, other),
         Arrival(0.3, [*other, 7])],
        [("run", 0.0, 1.0)],
    )  # fmt: skip
    whole = offline_bound(plan, 2, 64)
    assert whole is not None and whole[1] >= len(first) and whole[3] == len(other)
    admitted = offline_bound(plan, 2, 64, admitted=[False, True, True, True])
    assert admitted == [0, 0, 0, whole[3]]
