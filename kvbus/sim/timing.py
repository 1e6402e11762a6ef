"""How long a simulated engine step takes: a small, explicit model with named profiles.

One step of a vLLM engine runs the batch the scheduler chose: prefill chunks of some
requests and one decode token of others. The model::

    step = overhead + max(weight_read, prefill_tokens * prefill + decode_seqs * decode)
           + context_tokens * context

- ``weight_read``: every step reads the model's weights once (memory bound); small
  batches cost this however few tokens they hold.
- ``prefill`` / ``decode``: compute per prefilled token and per decoding sequence once
  the batch is large enough to be compute bound.
- ``context``: reading the KV cache of every token the batch's sequences attend to
  (outside the ``max``: KV reads add to the weight reads).
- ``overhead``: the step's CPU work outside the forward pass.

A profile is a row of five numbers (seconds); a user replaces them with their own
(``--profile FILE.json``). ``--speedup`` divides every step's time, so a fleet runs
faster than real time with the same order of events; ``--slow ENGINE=FACTOR`` multiplies
one engine's (a slower GPU, a noisy neighbour, a throttled card).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

if TYPE_CHECKING:  # vLLM loads in seconds: not for `kvbus sim --help`
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds per step part (see the module's docstring); ``source`` says where the
    numbers come from."""

    overhead: float
    weight_read: float
    prefill: float
    decode: float
    context: float
    source: str = ""
    max_num_seqs: int | None = None
    """vLLM's OpenAI-server default on this hardware (None: the running platform's),
    used unless ``--max-num-seqs`` is given."""
    max_num_batched_tokens: int | None = None
    """Likewise for ``--max-num-batched-tokens``."""

    def __post_init__(self) -> None:
        for name in ("overhead", "weight_read", "prefill", "decode", "context"):
            value = getattr(self, name)
            if not 0.0 <= value < 10.0:
                raise ValueError(f"profile {name}={value!r}: seconds in [0, 10)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            limit = getattr(self, name)
            if limit is not None and not 1 <= limit <= 1 << 20:
                raise ValueError(f"profile {name}={limit!r}: in [1, 2**20]")


_VIDUR: Final = (
    "Vidur's per-operator profiles (github.com/microsoft/vidur, data/profiling/compute, "
    "commit 7d47513): linear, norm and RoPE medians summed over layers"
)
# vLLM's scheduler defaults for an OpenAI server by GPU (vllm/engine/arg_utils.py,
# _get_default_max_num_seqs_and_batched_tokens): H100/H200-class, A100.
_H100_LIMITS: Final[dict[str, Any]] = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
_A100_LIMITS: Final[dict[str, Any]] = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
PROFILES: Final[dict[str, Profile]] = {
    # Llama-3.1-8B bf16 (15.0 GB of weights read per step, 128 KiB of KV per token).
    "h100-llama-3.1-8b": Profile(
        overhead=0.3e-3,
        weight_read=6.5e-3,
        prefill=21.5e-6,
        decode=23e-6,
        context=57e-9,
        **_H100_LIMITS,
        source=f"{_VIDUR} (Llama-2-7B on H100 scaled by 1.077 for 8B: 2.31 TB/s effective, "
        "~46k prefill tokens/s); checked against a vLLM H100 concurrency sweep (TPOT p50 "
        "6.5 ms at 1-4 concurrent, yobitelcomm.github.io/bench/recipes/concurrency-sweep)",
    ),
    "a100-llama-3.1-8b": Profile(
        overhead=1.5e-3,
        weight_read=10.4e-3,
        prefill=66e-6,
        decode=70e-6,
        context=91e-9,
        **_A100_LIMITS,
        source=f"{_VIDUR} (Meta-Llama-3-8B on A100 80GB: 1.44 TB/s effective, ~15k prefill "
        "tokens/s); overhead from vLLM's CI latency_llama8B_tp1 on A100-SXM4-80GB "
        "(1579 ms for 128 steps, buildkite vllm/performance-benchmark build 9523)",
    ),
    "2xh100-qwen3-32b": Profile(
        overhead=5e-3,
        weight_read=11.9e-3,
        prefill=50e-6,
        decode=51e-6,
        context=49e-9,
        **_H100_LIMITS,
        source=f"{_VIDUR} (Llama-2-70B TP2 on H100 scaled to Qwen3-32B's 64 GFLOP/token); "
        "overhead (mostly TP all-reduce) from NVIDIA NIM's Llama-3.3-70B 2xH100 ITL "
        "(docs.nvidia.com/nim/benchmarking/llm): the weakest number here; llm-d's "
        "precise-routing run served Qwen3-32B on 2 H100s per pod",
    ),
    "instant": Profile(
        overhead=0.0,
        weight_read=0.0,
        prefill=0.0,
        decode=0.0,
        context=0.0,
        source="no model time: steps as fast as the scheduler runs (tests, fidelity checks)",
    ),
}
DEFAULT_PROFILE: Final = "h100-llama-3.1-8b"


def load_profile(name_or_path: str) -> Profile:
    """A named profile, or one read from a JSON file of the five numbers."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        names = ", ".join(PROFILES)
        raise ValueError(f"profile {name_or_path!r}: neither one of {names} nor a JSON file")
    try:
        return msgspec.json.decode(path.read_bytes(), type=Profile)
    except (msgspec.DecodeError, msgspec.ValidationError, json.JSONDecodeError) as error:
        raise ValueError(f"profile {path}: {error}") from None


class StepWork(msgspec.Struct, kw_only=True):
    """What one step computes, read from the scheduler's decision."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0


def step_work(decision: SchedulerOutput, requests: dict[str, Request]) -> StepWork:
    """The work of ``decision``, taken right after ``Scheduler.schedule()`` (which has
    already advanced each request's ``num_computed_tokens`` by its scheduled tokens)."""
    work = StepWork()
    for request_id, tokens in decision.num_scheduled_tokens.items():
        request = requests.get(request_id)
        if request is None:
            continue
        before = request.num_computed_tokens - tokens
        if before < request.num_prompt_tokens:
            work.prefill_tokens += tokens
        else:
            work.decode_seqs += 1
        work.context_tokens += before + tokens
    return work


class TimingModel:
    """Seconds of wall time for a step's work under ``profile``, ``speedup`` times
    faster than the hardware it describes, and ``slowdown`` times slower (one engine
    of a fleet on slower hardware: ``kvbus sim --slow``)."""

    def __init__(self, profile: Profile, speedup: float = 1.0, slowdown: float = 1.0) -> None:
        if not speedup > 0:
            raise ValueError(f"speedup {speedup!r}: must be > 0")
        if not 0 < slowdown < float("inf"):
            raise ValueError(f"slowdown {slowdown!r}: must be > 0 and finite")
        self.profile = profile
        self.speedup = speedup
        self.slowdown = slowdown

    def seconds(self, work: StepWork) -> float:
        if not (work.prefill_tokens or work.decode_seqs):
            return 0.0  # nothing ran (every request waits for blocks)
        p = self.profile
        compute = work.prefill_tokens * p.prefill + work.decode_seqs * p.decode
        hardware = p.overhead + max(p.weight_read, compute) + work.context_tokens * p.context
        return hardware * self.slowdown / self.speedup
