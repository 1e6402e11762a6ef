"""`PrefixIndex`: which worker holds which prefix blocks, rebuilt from kv messages.

Feed it every item of ``kvbus.subscribe()`` (`PrefixIndex.apply`); ask it how much of a
prompt each worker already holds (`PrefixIndex.match`).

Blocks are keyed on the router's side by a hash chained over their token ids (and the
LoRA adapter, the per-block extra keys and, for vLLM >= 0.33 engines that hash ahead,
the lookahead tokens), so the index never depends on the engine's hash seed or
algorithm. A worker is a kvbus source (``NAME/dp<rank>`` for vLLM engines). Blocks are
tracked per medium (GPU, CPU, STORAGE). For hybrid models the full-attention group's
blocks are the prefix, and its sliding-window and mamba groups' blocks cut it to what
the engine can reuse (`kvbus.routing.index_window`); other groups are skipped.
``AllBlocksCleared``, a `Resync` and a new epoch clear exactly that worker.

Residency is a count, as in the engine: vLLM may cache several copies of one block
hash (a prompt recomputes its last block even when all of it is cached) and sends a
``BlockStored`` and, on eviction, a ``BlockRemoved`` for each copy, so a block stays
held until its last copy goes. Each worker remembers the router key of engine hashes
for a while after their last copy went, so a block stored under an evicted parent
still chains (bounded: at most as many remembered as held, and at least 1,024).

The index in parts, one concern each:

- `kvbus.routing.index_keys`: how tokens become router keys, and the keyings in use;
- `kvbus.routing.index_holders`: each worker's blocks and the holder masks, their caps;
- `kvbus.routing.index_feed`: applying kv messages (the hot path);
- `kvbus.routing.index_match`: querying a prompt's match;
- `kvbus.routing.index_window`: hybrid models' sliding-window and mamba groups.

`PrefixIndex` is the feeding and the querying side of one shared state, joined by
inheritance rather than held as parts: a call goes straight to the method that does
the work, with no forwarding call per message or query.
"""

from __future__ import annotations

from types import ModuleType

from kvbus.routing import index_feed, index_keys
from kvbus.routing.index_feed import MAX_BLOCK_SIZE, _Feeding
from kvbus.routing.index_holders import (
    _MIN_REMEMBERED,
    CAPACITY_HEADROOM,
    DEFAULT_MAX_BLOCKS_PER_WORKER,
    DEFAULT_MEDIUM_WEIGHTS,
    MEDIUM_SHIFTS,
    mask_numbers,
)
from kvbus.routing.index_keys import MAX_PROFILES, block_keys, block_salt
from kvbus.routing.index_match import _Matching
from kvbus.routing.kernels import kernels

__all__ = [
    "CAPACITY_HEADROOM",
    "DEFAULT_MAX_BLOCKS_PER_WORKER",
    "DEFAULT_MEDIUM_WEIGHTS",
    "MAX_BLOCK_SIZE",
    "MAX_PROFILES",
    "MEDIUM_SHIFTS",
    "_MIN_REMEMBERED",
    "PrefixIndex",
    "block_keys",
    "block_salt",
    "kernels",
    "mask_numbers",
    "use_kernels",
]


class PrefixIndex(_Feeding, _Matching):
    """Which worker holds which prefix blocks (see the module docstring).

    ``PrefixIndex(block_size=None, medium_weights=DEFAULT_MEDIUM_WEIGHTS,
    max_blocks_per_worker=DEFAULT_MAX_BLOCKS_PER_WORKER)``: ``block_size`` the
    operator's (a store of another size is skipped; ``None``: each worker's first store
    gives its own); ``medium_weights`` for `match_weighted`; ``max_blocks_per_worker``
    bounds what one worker may make the index hold.
    """


def use_kernels(loops: ModuleType) -> ModuleType:
    """Run every part of the index on ``loops`` (`kvbus.routing._ckernels` or
    `kvbus.routing._kernels`, its Python reference) from now on; returns the loops in use
    before. For the tests and benches that compare the two: the parts each hold
    ``kernels`` as a global, so that a loop call is one lookup, as in one module."""
    global kernels
    before = index_feed.kernels
    index_feed.kernels = index_keys.kernels = kernels = loops
    return before
