"""Hybrid models' sliding-window and mamba groups in the prefix index: what a worker's
engine can reuse of a prompt when some of its layers attend to a window only, or keep a
recurrent state (mamba, linear attention).

vLLM keeps such layers' KV in a cache group of its own (its events name it:
``kv_cache_spec_kind`` ``sliding_window``, ``group_idx``), and that group keeps few
blocks: those within the window of the last token each request computed. A prefix hit
of ``L`` blocks needs both the full-attention group to hold the prompt's first ``L``
blocks and the sliding-window group to hold the ``w`` blocks before block ``L`` (all
``L`` of them when ``L < w``), where ``w`` is ``ceil((window - 1) / block_size)``; the
engine takes the longest such ``L`` (``SlidingWindowManager.find_longest_cache_hit``
within ``HybridKVCacheCoordinator``'s). So a conversation's next turn finds its history,
while a request sharing only an earlier request's system prompt may find nothing,
although the full-attention group holds it.

The index keeps each worker's blocks of such groups apart (their own holder masks: a
window block evicted must not take the full-attention copy of the same engine hash
with it), each keyed as the full-attention block of the same engine hash, and cuts each
hybrid worker's match to the longest ``L`` its window allows (`window_cut`): one pass
over the prompt's matched blocks, a few big-int operations per block, whatever the
number of workers.

A mamba group (``kv_cache_spec_kind`` ``mamba``: Mamba, GDN and other linear-attention
layers) keeps a request's recurrent state at a few block boundaries only (in vLLM's
``align`` mode, where a scheduled chunk ended), named by the full-attention hash of the
block ending there; a hit of ``L`` blocks needs the state at exactly that boundary
(``MambaManager.find_longest_cache_hit``): a window of one block. A model with both
kinds needs both, and the engine takes the longest ``L`` every group allows (its
coordinator iterates to a fixed point; so does `window_cut`). Groups of other kinds
(chunked local attention) are skipped, their removals too. A worker whose model has no
full-attention layers stores no full-attention block to key the others' blocks as: they
are not indexed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvbus.routing import _kernels
from kvbus.routing.index_holders import _MIN_REMEMBERED, MEDIUM_SHIFTS, _Holders, _Worker
from kvbus.wire.events import BlockRemoved

SLIDING_WINDOW: Final = "sliding_window"
MAMBA: Final = "mamba"
SPARSE_KINDS: Final = (SLIDING_WINDOW, MAMBA)
"""Groups that keep few of a prompt's blocks, whose hits the index follows."""
MAX_GROUPS: Final = 16
"""KV cache groups remembered per worker (vLLM's models have a handful)."""
Groups = list[tuple[int, int]]


class SparseGroup:
    """One kind of group over every worker: the blocks each keeps (holder masks of their
    own) and the width of the window a hit needs, per worker."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.masks: dict[int, int] = {}
        """router key -> mask of the workers whose group of this kind holds it"""
        self.workers: dict[str, _Worker] = {}
        self.widths: dict[int, int] = {}
        """worker number -> blocks before a hit's end this group must hold"""
        self.sizes: dict[int, int] = {}
        """width -> mask of the workers with that width"""
        self.mask = 0
        """The workers with a group of this kind."""

    def width(self, event: Any, block_size: int) -> int:
        if self.kind == MAMBA:
            return 1  # the state at the hit's boundary
        tokens = event.kv_cache_spec_sliding_window
        blocks = math.ceil((tokens - 1) / block_size) if isinstance(tokens, int) else 1
        return min(max(1, blocks), 1 << 20)  # a forged window: bounded like a block count

    def set_width(self, number: int, width: int) -> None:
        """Worker ``number``'s group needs ``width`` blocks (the widest it named)."""
        before = self.widths.get(number, 0)
        if width <= before:
            return
        self._unsize(number, before)
        self.widths[number] = width
        self.sizes[width] = self.sizes.get(width, 0) | (1 << number)
        self.mask |= 1 << number

    def clear(self, worker: str, number: int, keep_width: bool = False) -> None:
        state = self.workers.pop(worker, None)
        if state is not None:
            _kernels.clear_holder(self.masks, state.held, state.bit)
        if not keep_width:
            self._unsize(number, self.widths.pop(number, 0))
            self.mask &= ~(1 << number)

    def _unsize(self, number: int, width: int) -> None:
        if width:
            left = self.sizes[width] & ~(1 << number)
            if left:
                self.sizes[width] = left
            else:
                del self.sizes[width]

    def cut(
        self, groups: Groups, keys: Sequence[int], most: int, also: Mapping[int, int]
    ) -> Groups:
        """``groups`` (ascending blocks; a worker's match the deepest it is in) with this
        kind's workers cut to the longest match whose window this group holds."""
        matched = 0
        for mask, _ in groups:
            matched |= mask
        members = self.mask & matched
        if not members:
            return groups
        cut = [(mask & ~members, blocks) for mask, blocks in groups if mask & ~members]
        deepest = min(groups[-1][1], most)
        if deepest <= 0:
            return cut
        held = self.masks
        present = [(held.get(key, 0) | also.get(key, 0)) & members for key in keys[:deepest]]
        found: Groups = []
        for width, sized in self.sizes.items():
            workers = sized & members
            if not workers:
                continue
            window = _window_ands(present, width)
            assigned, deeper, index = 0, 0, len(groups) - 1
            for blocks in range(deepest, 0, -1):
                while index >= 0 and min(groups[index][1], most) >= blocks:
                    deeper |= groups[index][0]  # the workers matching at least ``blocks``
                    index -= 1
                reusable = window[blocks - 1] & deeper & workers & ~assigned
                if reusable:
                    found.append((reusable, blocks))
                    assigned |= reusable
        return sorted(cut + found, key=lambda pair: pair[1])


class _Windows(_Holders):
    """The index's side for hybrid models' sparse groups (see the module docstring)."""

    @property
    def window_mask(self) -> int:
        """Mask of the workers with a sliding-window or mamba group (0: none seen)."""
        return self._sparse[SLIDING_WINDOW].mask | self._sparse[MAMBA].mask

    def window_blocks(self, number: int) -> int:
        """Blocks before a hit's end worker ``number``'s sparse groups need at most (0:
        none): a request leaves about as many of its prompt's last blocks there."""
        return max(group.widths.get(number, 0) for group in self._sparse.values())

    def _learn_group(self, worker: str, group: int | None, kind: str | None) -> None:
        """``worker``'s group ``group`` holds layers of ``kind`` (not full attention)."""
        if group is None or kind is None:
            return
        kinds = self._group_kinds.setdefault(worker, {})
        if group in kinds or len(kinds) < MAX_GROUPS:
            kinds[group] = kind

    def _group_kind(self, worker: str, group: int | None) -> str | None:
        """The kind of ``worker``'s group ``group`` if it is not full attention (as its
        stores named it; None: full attention, or never named)."""
        kinds = self._group_kinds.get(worker)
        return kinds.get(group) if kinds and group is not None else None

    def _defer(self, worker: str, kind: str, event: object) -> None:
        self._deferred.append((worker, kind, event))

    def _apply_deferred(self) -> None:
        """A batch's sparse groups' events, in order, after its other events."""
        deferred, self._deferred = self._deferred, []
        for worker, kind, event in deferred:
            group = self._sparse[kind]
            if isinstance(event, BlockRemoved):
                self._sparse_removed(group, worker, event)
            else:
                self._sparse_stored(group, worker, event)

    def _sparse_stored(self, group: SparseGroup, worker: str, event: Any) -> None:
        """Blocks of a sparse group stored. vLLM names them by the same engine hashes as
        the full-attention group's blocks of the same tokens (one hash chain per
        request), but often without their parent (the block before is rarely in such a
        group): each is keyed as the full-attention block of its hash, which the same
        batch may store after it (hence deferred)."""
        hashes = event.block_hashes
        full = self._workers.get(worker)
        known = full.keys if full is not None else {}
        keys = [key for key in map(known.get, hashes) if key is not None]
        self.unchained += len(hashes) - len(keys)  # never held in full: no key
        if full is None or not keys:
            return
        state = group.workers.get(worker)
        if state is None:
            state = group.workers[worker] = _Worker(full.number, full.block_size)
        group.set_width(full.number, group.width(event, full.block_size))
        state.add_copies(group.masks, keys, MEDIUM_SHIFTS.get(event.medium, 0))
        state.keys.update((h, known[h]) for h in hashes if h in known)
        limit = self.max_blocks_per_worker
        capacity = self._capacity[full.number]
        if capacity:
            limit = min(limit, 2 * capacity + _MIN_REMEMBERED)
        if len(state.held) > limit or len(state.keys) > limit + _MIN_REMEMBERED:
            keep = limit - (limit >> 3)
            self.over_cap += state.forget_oldest(group.masks, keep, keep, keep)

    def _sparse_removed(self, group: SparseGroup, worker: str, event: BlockRemoved) -> None:
        state = group.workers.get(worker)
        hashes = event.block_hashes
        if state is None:
            self.unknown_removals += len(hashes)
            return
        keys = list(map(state.keys.get, hashes))
        shift = MEDIUM_SHIFTS.get(event.medium, 0)
        last, unknown = state.remove_copies(group.masks, hashes, keys, shift)
        self.unknown_removals += unknown
        state.forget(last)

    def _window_clear(self, worker: str, number: int, same_model: bool = False) -> None:
        """``worker`` (``number``) emptied its cache (``same_model``), or restarted
        (maybe as another model): its sparse groups' blocks go, and but for an emptied
        cache what was learned of its groups (their kinds, the windows hits need)."""
        if self._deferred:
            self._deferred = [d for d in self._deferred if d[0] != worker]
        if not same_model:
            self._group_kinds.pop(worker, None)
        for group in self._sparse.values():
            group.clear(worker, number, keep_width=same_model)

    # --- matching ----------------------------------------------------------------------

    def window_cut(
        self,
        groups: Groups,
        keys: Sequence[int],
        most: int,
        also: Mapping[int, int] | None = None,
    ) -> Groups:
        """`match_masks`'s ``groups`` with each hybrid worker's match cut to what its
        engine can reuse (the module docstring), at most ``most`` blocks (the engine
        computes the prompt's last token: ``(tokens - 1) // block_size``). ``also``:
        sparse-group blocks pending per key (the last blocks of requests just routed,
        which their engines keep once they ran). Same shape: pairs of (workers, blocks),
        ascending, a worker's the deepest it is in."""
        kinds = [group for group in self._sparse.values() if group.mask]
        if not kinds or not groups:
            return groups
        extra = also or {}
        for _ in range(4):  # as vLLM's coordinator, to a fixed point (each cut shortens)
            before = groups
            for group in kinds:
                groups = group.cut(groups, keys, most, extra)
            if len(kinds) == 1 or groups == before or not groups:
                break
        return groups


def _window_ands(masks: list[int], width: int) -> list[int]:
    """``out[i]``: the AND of ``masks[max(0, i - width + 1) .. i]`` (van Herk/Gil-Werman:
    a prefix and a suffix AND per run of ``width``, three operations per element)."""
    count = len(masks)
    prefix = masks[:]
    suffix = masks[:]
    for i in range(1, count):
        if i % width:
            prefix[i] &= prefix[i - 1]
    for i in range(count - 2, -1, -1):
        if (i + 1) % width:
            suffix[i] &= suffix[i + 1]
    out = prefix[:]
    for i in range(width - 1, count):
        start = i - width + 1
        if start % width:
            out[i] = suffix[start] & prefix[i]
    return out
