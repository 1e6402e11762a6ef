"""Admission by deadline (`kvbus.routing.admission`): a worker's seconds per output
token learned from its streams' steps, the output a request should have, and a request that its
worker should finish past its deadline shed, with nothing assigned."""

from __future__ import annotations

import math

import pytest

from kvbus.routing.admission import MAX_OUTPUT, STEP_WEIGHT, Admission, DecodeTimes
from kvbus.routing.router import Router
from kvbus.service.served_model import MAX_CHOICES, read_choices, read_max_tokens

from .test_pace import load, slow_b_router


def test_a_workers_seconds_per_token_follow_its_steps_and_stand_in_when_stale() -> None:
    times = DecodeTimes(stale_after=10.0)
    assert math.isnan(times.per_token(0, 0.0))  # nothing seen
    times.step(7, 0.2, now=0.01)  # the fleet's first step: at once the median
    assert times.per_token(0, 0.02) == pytest.approx(0.2)
    times.forget(7)
    times.step(0, 0.1, now=0.0)
    assert times.per_token(0, 0.0) == pytest.approx(0.1)
    times.step(0, 0.3, now=1.0)  # slower now: the mean moves STEP_WEIGHT of the way
    assert times.per_token(0, 1.0) == pytest.approx(0.1 + STEP_WEIGHT * 0.2)
    for _ in range(40):  # and follows a run of slow steps
        times.step(0, 0.3, now=1.0)
    assert times.per_token(0, 1.0) == pytest.approx(0.3, rel=0.01)
    # Four streams there each see every step: each of their gaps weighs a quarter.
    times.step(0, 0.7, now=1.0, streams=4)
    assert times.per_token(0, 1.0) == pytest.approx(0.3 + STEP_WEIGHT / 4 * 0.4, rel=0.01)
    assert math.isnan(times.own(5, 1.0))  # never read
    times.step(1, 0.02, now=1.0)
    times.step(2, 0.04, now=1.0)
    # Worker 3 has none of its own: the median of the workers read lately stands in.
    assert times.per_token(3, 1.0) == pytest.approx(0.04)
    # Past stale_after, a worker's own (read while busy) no longer counts.
    times.step(1, 0.5, now=20.0)
    assert times.per_token(0, 20.0) == pytest.approx(0.5)
    # Back after a lull: its first step sets it anew, not a tenth of the way.
    times.step(0, 0.01, now=21.0)
    assert times.per_token(0, 21.0) == pytest.approx(0.01)
    times.forget(0)  # restarted
    assert times.per_token(0, 21.0) == pytest.approx(0.5)  # worker 1's stands in
    times.step(40, 0.2, now=21.0)  # numbers past the arrays grow them
    assert times.per_token(40, 21.0) == pytest.approx(0.2)


def test_forged_figures_teach_nothing() -> None:
    times = DecodeTimes()
    for seconds in (0.0, -1.0, math.inf, math.nan):
        times.step(0, seconds, now=0.0)
    times.step(-1, 0.1, now=0.0)
    assert math.isnan(times.per_token(0, 0.0))
    for tokens in (0, -5):
        times.answered(tokens)
    assert math.isnan(times.mean_output)
    times.answered(2**40)  # counted as MAX_OUTPUT at most
    assert times.mean_output == MAX_OUTPUT


def test_a_requests_output_is_its_limit_when_it_ignores_eos_else_at_most_the_usual() -> None:
    times = DecodeTimes()
    assert times.expected_output(64, ignores_eos=False) == 64  # nothing seen: its limit
    assert math.isnan(times.expected_output(None, ignores_eos=False))
    times.answered(11)  # answers have run to 11 tokens
    assert times.expected_output(64, ignores_eos=False) == 11
    assert times.expected_output(64, ignores_eos=True) == 64
    assert times.expected_output(4, ignores_eos=False) == 4
    assert times.expected_output(None, ignores_eos=False) == 11


@pytest.mark.parametrize(
    ("body", "read"),
    [
        ({"max_tokens": 16}, (16, False)),
        ({"max_tokens": 16, "ignore_eos": True}, (16, True)),
        ({"max_completion_tokens": 8, "max_tokens": 16}, (8, False)),
        ({"max_output_tokens": 5}, (5, False)),
        ({"max_tokens": 2**80, "ignore_eos": True}, (MAX_OUTPUT, True)),
        ({"max_tokens": 16, "ignore_eos": 1}, (16, False)),
        ({"max_tokens": 0}, (None, False)),
        ({"max_tokens": -3}, (None, False)),
        ({"max_tokens": 1.5}, (None, False)),
        ({"max_tokens": True}, (None, False)),
        ({"max_tokens": "16"}, (None, False)),
        ({"ignore_eos": True}, (None, False)),
        ({}, (None, False)),
    ],
)
def test_a_bodys_output_limit_is_read_only_when_it_is_a_positive_integer(
    body: dict[str, object], read: tuple[int | None, bool]
) -> None:
    assert read_max_tokens(body) == read


@pytest.mark.parametrize(
    ("body", "choices"),
    [
        ({}, 1),
        ({"n": 4}, 4),
        ({"n": 4.0}, 4),  # vLLM's pydantic takes it as 4
        ({"n": 2.5}, 1),
        ({"n": 0}, 1),
        ({"n": -2}, 1),
        ({"n": True}, 1),
        ({"n": "4"}, 1),
        ({"n": 2**80}, MAX_CHOICES),
        ({"n": 3, "prompt": ["a", "b"]}, 6),  # a batch: each prompt's choices
        ({"prompt": [[1, 2], [3]]}, 2),
        ({"n": 3, "prompt": [1, 2, 3]}, 3),  # one prompt of token ids
        ({"n": 2**13, "prompt": ["a"] * 4}, MAX_CHOICES),
    ],
)
def test_a_bodys_choices_are_its_n_times_its_batch(body: dict[str, object], choices: int) -> None:
    assert read_choices(body) == choices


def test_a_request_its_worker_would_end_past_the_deadline_is_shed_and_assigns_nothing() -> None:
    """The first token alone is in time; the output at the worker's seconds per token
    is not. A shorter output, or a later deadline of the request's own, is admitted."""
    r, _ = slow_b_router(1.0)
    a = r.index.worker_number("a")
    first = r.route(list(range(500, 540)), exclude={"b", "c"})
    assert first is not None and 0 < first.predicted_ttft < 0.2
    r.started(first)
    for _ in range(9):
        r.stepped(first, 0.1)  # 0.1 s per token after the first
    r.finished(first)
    r.deadline = 1.0
    queued, pending = r.state.queued_blocks(a), dict(r._pending[a])
    prompt = list(range(900, 932))
    shed = r.route(prompt, exclude={"b", "c"}, max_tokens=40, ignores_eos=True)
    assert shed is not None and shed.shed and shed.worker == "a"
    assert shed.predicted_ttft < 1.0  # the first token would have been in time
    assert shed.predicted_end == pytest.approx(shed.predicted_ttft + 39 * 0.1)
    assert "last in" in shed.explain() and "shed" in shed.explain()
    assert (r.state.queued_blocks(a), r._pending[a]) == (queued, pending)
    short = r.route(prompt, exclude={"b", "c"}, max_tokens=4, ignores_eos=True)
    assert short is not None and not short.shed
    assert short.predicted_end == pytest.approx(short.predicted_ttft + 3 * 0.1)
    r.finished(short)
    own = r.route(prompt, exclude={"b", "c"}, max_tokens=40, ignores_eos=True, deadline=10.0)
    assert own is not None and not own.shed
    r.finished(own)
    # Without a deadline (the router's or its own), the same request goes.
    r.deadline = None
    anyway = r.route(prompt, exclude={"b", "c"}, max_tokens=40, ignores_eos=True)
    assert anyway is not None and not anyway.shed


def test_a_deadline_sheds_on_the_output_alone_before_the_first_tokens_are_learned() -> None:
    """Before the pace's fit, the first token is predicted only as late as a request
    already waiting there (none: 0 s); the output's time after it is still known, and
    over the deadline it sheds."""
    r = Router(block_size=4, deadline=1.0)
    r.apply_metrics(load("a"))
    routed = r.route(list(range(40)))
    assert routed is not None and routed.predicted_ttft == 0.0
    assert routed.predicted_end == 0.0 and not routed.shed  # no output time known yet
    r.started(routed)
    r.stepped(routed, 0.1)
    r.finished(routed)
    long = r.route(list(range(100, 140)), max_tokens=21, ignores_eos=True)
    assert long is not None and long.shed and long.predicted_end == pytest.approx(2.0)
    short = r.route(list(range(100, 140)), max_tokens=5, ignores_eos=True)
    assert short is not None and not short.shed


def test_the_end_is_predicted_from_what_is_known_and_never_sheds_on_nothing() -> None:
    admission = Admission(deadline=1.0)
    assert math.isnan(admission.predicted_end(0, math.nan, 8, True, now=0.0))
    assert admission.predicted_end(0, 0.4, 8, True, now=0.0) == 0.4  # no time per token yet
    admission.decode_times.step(0, 0.1, now=0.0)
    assert admission.predicted_end(0, math.nan, 8, True, now=0.0) == pytest.approx(0.7)
    assert admission.predicted_end(0, 0.4, 8, True, now=0.0) == pytest.approx(1.1)
    assert admission.predicted_end(0, 0.4, 1, True, now=0.0) == 0.4  # one token: no decode
    assert admission.predicted_end(0, 0.4, None, False, now=0.0) == 0.4  # output unknown
    assert admission.sheds(0.4, 1.1, None) and not admission.sheds(0.4, 1.1, 2.0)
    assert not admission.sheds(math.nan, math.nan, None)
    admission.shed_after = 0.3
    assert admission.sheds(0.4, 0.4, 2.0)  # the first token's limit holds whatever the deadline
