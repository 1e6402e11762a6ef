"""The prefix index on hybrid models (kvbus.routing.index_window): events shaped as
vLLM 0.32 sends them for a model with a 64-token sliding window beside full attention
(read off a real engine: the window group's stores come first in a batch, name the
same engine hashes as the full-attention blocks of the same tokens, and carry no
parent). Real engines: test_router_window."""

from __future__ import annotations

import random

import pytest

from kvbus import AllBlocksCleared, BlockRemoved, BlockStored
from kvbus.routing.index import PrefixIndex
from kvbus.routing.index_window import _window_ands

BLOCK = 32
A = list(range(5, 5 + 4 * BLOCK + 8))  # 4 whole blocks


def full(hashes: list[int], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(
        hashes, parent, tokens, BLOCK, None, "GPU", None,
        group_idx=1, kv_cache_spec_kind="full_attention",
    )  # fmt: skip


def window(hashes: list[int], tokens: list[int]) -> BlockStored:
    return BlockStored(
        hashes, None, tokens, BLOCK, None, "GPU", None,
        group_idx=0, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64,
    )  # fmt: skip


def blocks(tokens: list[int], first: int, last: int) -> list[int]:
    return tokens[first * BLOCK : last * BLOCK]


def served(index: PrefixIndex, worker: str = "h/dp0") -> None:
    """Prompt A run on a hybrid engine: four full-attention blocks (hashes 100..103) and
    its last window (blocks 2 and 3), the window group's store first."""
    index.apply_events(
        worker,
        [window([102, 103], blocks(A, 2, 4)), full([100, 101, 102, 103], blocks(A, 0, 4))],
    )


def test_a_hit_needs_the_window_before_its_end() -> None:
    index = PrefixIndex()
    served(index)
    assert index.match(A + [9] * 40) == {"h/dp0": 128}  # the next turn: all 4 blocks
    # The same system prompt (3 blocks), then other words: the window before its end
    # (blocks 1 and 2) is not held, nor any shorter one from the start.
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {}
    # A prompt of exactly the 4 blocks: the engine computes its last token, so at most
    # 3 blocks, and their window (1, 2) is not held either.
    assert index.match(A[: 4 * BLOCK]) == {}


def test_a_window_eviction_leaves_the_full_attention_copy() -> None:
    index = PrefixIndex()
    served(index)
    index.apply_events("h/dp0", [BlockRemoved([103], "GPU", group_idx=0)])
    key = index.keys(A)[3]
    assert index.holds("h/dp0", key)  # the full-attention block is still there
    assert index.match(A + [9] * 40) == {}  # but the window ending at 4 is not
    index.apply_events("h/dp0", [BlockRemoved([103], "GPU", group_idx=1)])
    assert not index.holds("h/dp0", key)


def test_other_groups_are_skipped_removals_included() -> None:
    index = PrefixIndex()
    mamba = BlockStored(
        [100], None, blocks(A, 0, 1), BLOCK, None, "GPU", None,
        group_idx=2, kv_cache_spec_kind="mamba",
    )  # fmt: skip
    index.apply_events("h/dp0", [full([100, 101], blocks(A, 0, 2)), mamba])
    index.apply_events("h/dp0", [BlockRemoved([100], "GPU", group_idx=2)])
    assert index.match([*A[: 2 * BLOCK], 1]) == {"h/dp0": 64}
    assert index.other_groups == 2


def test_plain_workers_beside_hybrid_ones_match_as_before() -> None:
    index = PrefixIndex()
    served(index)
    index.apply_events(
        "p/dp0", [BlockStored([7, 8, 9], None, blocks(A, 0, 3), BLOCK, None, "GPU", None)]
    )
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {"p/dp0": 96}


def test_a_clear_forgets_the_window_and_the_model() -> None:
    index = PrefixIndex()
    served(index)
    index.apply_events("h/dp0", [AllBlocksCleared()])
    assert index.window_mask == 0
    # Restarted with a plain model: its matches are no longer cut.
    index.apply_events(
        "h/dp0", [BlockStored([1, 2, 3], None, blocks(A, 0, 3), BLOCK, None, "GPU", None)]
    )
    assert index.match(A[: 3 * BLOCK] + [7] * 60) == {"h/dp0": 96}


def test_a_window_block_never_held_in_full_is_not_indexed() -> None:
    index = PrefixIndex()
    index.apply_events("h/dp0", [window([555], blocks(A, 0, 1))])
    assert index.unchained == 1 and index.window_mask == 0


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8])
def test_window_ands_are_the_ands_of_each_window(width: int) -> None:
    rng = random.Random(width)
    for count in range(0, 30):
        masks = [rng.getrandbits(4) | rng.getrandbits(4) for _ in range(count)]
        expected = []
        for i in range(count):
            value = -1
            for mask in masks[max(0, i - width + 1) : i + 1]:
                value &= mask
            expected.append(value)
        assert _window_ands(masks, width) == expected
