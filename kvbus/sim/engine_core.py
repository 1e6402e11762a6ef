"""One simulated engine's core: vLLM's own `Scheduler` and KV cache manager, with the
model's forward pass replaced by a timing model. No I/O and no clock: the driver
(`kvbus.sim.engine`) feeds it requests, runs its steps and waits out their time.

The scheduler is built the way vLLM's EngineCore builds it (same config, the same
`KVCacheConfig` shape: one full-attention group over the model's layers, ``kv_blocks``
blocks, the request block hasher of the configured hash algorithm), so block
allocation, prefix caching, eviction order, chunked prefill and preemption are vLLM's
own, and so are the KV events its block pool emits. What is simulated: the tokens a
step samples (pseudo-random ids from the vocabulary, never a stop token, so a request
runs to its ``max_tokens``) and how long the step takes.
"""

from __future__ import annotations

import copy
import random
import zlib
from dataclasses import dataclass
from typing import Any

import vllm.plugins
from vllm.config import KVEventsConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.usage.usage_lib import UsageContext
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvbus.connectors.vllm_events import publish_queued_events
from kvbus.sim.timing import TimingModel, step_work


@dataclass(frozen=True)
class EngineShape:
    """What a `kvbus sim` engine is: the model directory (config and tokenizer), its KV
    cache (``kv_blocks`` blocks of ``block_size`` tokens) and vLLM's scheduler limits
    (None: vLLM's defaults for an OpenAI server on this platform)."""

    model: str
    kv_blocks: int
    block_size: int
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    served_model_name: str | None = None


def engine_config(shape: EngineShape) -> VllmConfig:
    """vLLM's config for ``shape``, made as ``vllm serve`` makes it (``EngineArgs``),
    with KV events on (published by the driver, not by a publisher of vLLM's)."""
    if shape.kv_blocks < 2:
        raise ValueError(f"kv_blocks {shape.kv_blocks}: at least 2 (vLLM keeps one aside)")
    # EngineArgs loads vLLM's general plugins, once per process. The sim wires
    # kvbus's publishers itself, so none of them may run for it, and a process that
    # starts a real engine later (the tests) must still get them: skip them, then
    # leave the flag as it was.
    loaded = vllm.plugins.plugins_loaded
    vllm.plugins.plugins_loaded = True
    try:
        args = EngineArgs(
            model=shape.model,
            served_model_name=[shape.served_model_name] if shape.served_model_name else None,
            load_format="dummy",
            block_size=shape.block_size,
            max_model_len=shape.max_model_len,  # type: ignore[arg-type]  # None: the model's
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            enable_prefix_caching=True,
            num_gpu_blocks_override=shape.kv_blocks,
            enforce_eager=True,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    finally:
        vllm.plugins.plugins_loaded = loaded
    config.cache_config.num_gpu_blocks = shape.kv_blocks
    # vLLM refuses to start an engine whose cache cannot hold one request of the
    # longest length it accepts; so does the sim (such a request would wait for ever).
    longest = config.model_config.max_model_len
    needed = -(-longest // config.cache_config.block_size)
    if shape.kv_blocks - 1 < needed:
        raise ValueError(
            f"{shape.kv_blocks} KV blocks of {config.cache_config.block_size} tokens cannot "
            f"hold one request of max_model_len {longest} (needs {needed} + 1 blocks): "
            "give more --kv-blocks or a smaller --max-model-len"
        )
    return config


def _kv_cache_config(config: VllmConfig) -> KVCacheConfig:
    model, parallel = config.model_config, config.parallel_config
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=model.dtype,  # type: ignore[arg-type]  # a torch.dtype once resolved
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(parallel))]
    num_blocks = config.cache_config.num_gpu_blocks
    assert num_blocks is not None
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


class EngineCore:
    """vLLM's scheduler stepped without a model. ``config`` is shared read-only between
    engines (each takes its own copy)."""

    def __init__(self, config: VllmConfig, timing: TimingModel, seed: int = 0) -> None:
        self.config = copy.deepcopy(config)
        self.timing = timing
        kv_config = _kv_cache_config(self.config)
        block_size, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(
            kv_config, self.config
        )
        kv_config.hash_block_size = hash_block_size
        kv_config.cache_hit_alignment_tokens = kv_cache_utils.resolve_cache_hit_alignment_tokens(
            kv_config, self.config, block_size, hash_block_size
        )
        scheduler_class = self.config.scheduler_config.get_scheduler_cls()
        self.scheduler: Any = scheduler_class(
            vllm_config=self.config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        self._block_hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)
        self._random = random.Random(seed)
        vocab = self.config.model_config.get_vocab_size()
        self._tokens = range(min(3, vocab - 1), vocab)  # ids 0-2: unk, bos, eos in most vocabs

    @property
    def num_blocks(self) -> int:
        return int(self.config.cache_config.num_gpu_blocks or 0)

    def add(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        arrival: float,
        cache_salt: str | None = None,
    ) -> None:
        request = Request(
            request_id,
            prompt,
            sampling,
            None,
            arrival_time=arrival,
            cache_salt=cache_salt,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def begin_step(self) -> tuple[SchedulerOutput, float]:
        """The scheduler's next batch and the seconds its forward pass takes."""
        decision = self.scheduler.schedule()
        return decision, self.timing.seconds(step_work(decision, self.scheduler.requests))

    def end_step(self, decision: SchedulerOutput) -> tuple[list[EngineCoreOutput], Any]:
        """The step's sampled tokens fed back (each request past its prompt gets one):
        the requests' outputs and the step's `SchedulerStats` (None when it has none),
        as the engine core returns them to vLLM's front end."""
        requests = self.scheduler.requests
        ids = list(decision.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for request_id in ids:
            request = requests.get(request_id)
            done = request is not None and request.num_computed_tokens >= request.num_tokens
            sampled.append([self._random.choice(self._tokens)] if done else [])
        output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        produced = self.scheduler.update_from_output(decision, output)
        stats = next((o.scheduler_stats for o in produced.values() if o.scheduler_stats), None)
        return [o for outputs in produced.values() for o in outputs.outputs], stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``/reset_prefix_cache``: False while requests hold blocks, unless
        ``reset_running_requests`` preempts them first (vLLM's scheduler does it; they
        recompute). Call it between steps, as vLLM's engine core runs it. What the
        reset queued (its ``AllBlocksCleared``) is published at once, as kvbus's plugin
        makes a real engine do (`kvbus.connectors.vllm_events.install_reset_publishing`;
        a no-op here when that already did it), not with the next step."""
        done = bool(self.scheduler.reset_prefix_cache(reset_running_requests))
        publish_queued_events(self.scheduler)
        return done


def request_seed(request_id: str) -> int:
    """A stable seed per request id (tests that replay a workload get the same tokens)."""
    return zlib.crc32(request_id.encode())
