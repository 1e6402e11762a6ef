"""Read a KV block's bytes on a vLLM worker, to prove a transfer exact (no KV on the bus).

vLLM hands each connector its KV caches once (``register_kv_caches``): per attention
layer a tensor whose block axis is the first (``[num_blocks, ...]``: the CPU backend
and vLLM's cross-layer views) or the second after a K/V axis of 2 (``[2, num_blocks,
...]``: FlashAttention's). A block may span several kernel blocks (the axis is then a
multiple of the engine's block count). `block_digest` hashes a block's pages as bytes,
layer by layer, without interpreting K and V: equal on two engines with the same
layout, model and dtype exactly when every layer's KV of that block is equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

DIGEST_SIZE = 16


def block_pages(kv_cache: Any, block_id: int, num_blocks: int) -> list[Any]:
    """The pages of engine block ``block_id`` in one layer's KV cache tensor."""
    shape = tuple(kv_cache.shape)
    if shape[0] % num_blocks == 0 and shape[0] >= num_blocks:
        per_block = shape[0] // num_blocks
        return [kv_cache[block_id * per_block : (block_id + 1) * per_block]]
    if len(shape) > 1 and shape[0] == 2 and shape[1] % num_blocks == 0:
        per_block = shape[1] // num_blocks
        rows = slice(block_id * per_block, (block_id + 1) * per_block)
        return [kv_cache[0, rows], kv_cache[1, rows]]
    raise ValueError(f"no axis of {num_blocks} blocks in a KV cache of shape {shape}")


def _page_bytes(page: Any) -> memoryview:
    import torch

    flat = page.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.cpu().numpy())


def block_digest(kv_caches: Mapping[str, Any], block_id: int, num_blocks: int) -> bytes:
    """A 16-byte blake2b digest of block ``block_id`` over every layer (in name order)."""
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for name in sorted(kv_caches):
        digest.update(name.encode())
        for page in block_pages(kv_caches[name], block_id, num_blocks):
            digest.update(_page_bytes(page))
    return digest.digest()


def block_digests(
    kv_caches: Mapping[str, Any], block_ids: Sequence[int], num_blocks: int
) -> list[bytes]:
    return [block_digest(kv_caches, b, num_blocks) for b in block_ids]
