"""Hybrid models' sliding-window groups in the prefix index: what a worker's engine can
reuse of a prompt when some of its layers attend to a window only.

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

The index keeps each worker's sliding-window blocks apart (their own holder masks: a
window block evicted must not take the full-attention copy of the same engine hash
with it), each keyed as the full-attention block of the same engine hash, and cuts each
hybrid worker's match to the longest ``L`` its window allows (`window_cut`): one pass
over the prompt's matched blocks, a few big-int operations per block, whatever the
number of workers. Groups of other kinds (mamba, chunked local attention) are skipped,
their removals too. A worker whose model has only sliding-window layers stores no
full-attention block to key its window blocks as: they are not indexed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvbus.routing import _kernels
from kvbus.routing.index_holders import _MIN_REMEMBERED, MEDIUM_SHIFTS, _Holders, _Worker
from kvbus.wire.events import BlockRemoved

SLIDING_WINDOW: Final = "sliding_window"
MAX_GROUPS: Final = 16
"""KV cache groups remembered per worker (vLLM's models have a handful)."""


class _Windows(_Holders):
    """The index's sliding-window side (see the module docstring)."""

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

    def _defer(self, worker: str, event: object) -> None:
        self._deferred.append((worker, event))

    def _apply_deferred(self) -> None:
        """A batch's sliding-window events, in order, after its other events."""
        deferred, self._deferred = self._deferred, []
        for worker, event in deferred:
            if isinstance(event, BlockRemoved):
                self._window_removed(worker, event)
            else:
                self._window_stored(worker, event)

    def _drop_deferred(self, worker: str) -> None:
        if self._deferred:
            self._deferred = [d for d in self._deferred if d[0] != worker]

    def _window_stored(self, worker: str, event: Any) -> None:
        """Window blocks stored. vLLM names them by the same engine hashes as the
        full-attention group's blocks of the same tokens (one hash chain per request),
        but without their parent (the block before is rarely in the window group): each
        is keyed as the full-attention block of its hash, which the same batch may
        store after it (hence deferred)."""
        hashes = event.block_hashes
        full = self._workers.get(worker)
        known = full.keys if full is not None else {}
        keys = [key for key in map(known.get, hashes) if key is not None]
        self.unchained += len(hashes) - len(keys)  # never held in full: no key
        if full is None or not keys:
            return
        window = self._window_workers.get(worker)
        if window is None:
            window = self._window_workers[worker] = _Worker(full.number, full.block_size)
        self._set_window(full.number, full.block_size, event.kv_cache_spec_sliding_window)
        window.add_copies(self._window_masks, keys, MEDIUM_SHIFTS.get(event.medium, 0))
        window.keys.update((h, known[h]) for h in hashes if h in known)
        limit = self.max_blocks_per_worker
        capacity = self._capacity[full.number]
        if capacity:
            limit = min(limit, 2 * capacity + _MIN_REMEMBERED)
        if len(window.held) > limit or len(window.keys) > limit + _MIN_REMEMBERED:
            keep = limit - (limit >> 3)
            self.over_cap += window.forget_oldest(self._window_masks, keep, keep, keep)

    def _set_window(self, number: int, block_size: int, tokens: int | None) -> None:
        """Worker ``number`` keeps a sliding window of ``tokens``: a hit needs that
        many blocks before its end in the window group (the widest of its windows)."""
        blocks = max(1, math.ceil(((tokens or 1) - 1) / block_size)) if tokens else 1
        blocks = min(blocks, 1 << 20)  # a forged window: bounded like a block count
        before = self._windows.get(number, 0)
        if blocks <= before:
            return
        bit = 1 << number
        if before:
            self._window_sizes[before] &= ~bit
            if not self._window_sizes[before]:
                del self._window_sizes[before]
        self._windows[number] = blocks
        self._window_sizes[blocks] = self._window_sizes.get(blocks, 0) | bit
        self.window_mask |= bit

    def _window_removed(self, worker: str, event: BlockRemoved) -> None:
        window = self._window_workers.get(worker)
        hashes = event.block_hashes
        if window is None:
            self.unknown_removals += len(hashes)
            return
        keys = list(map(window.keys.get, hashes))
        shift = MEDIUM_SHIFTS.get(event.medium, 0)
        last, unknown = window.remove_copies(self._window_masks, hashes, keys, shift)
        self.unknown_removals += unknown
        window.forget(last)

    def _window_clear(self, worker: str, number: int) -> None:
        """``worker`` (``number``) emptied its cache, or restarted (maybe as another
        model): its window blocks and what was learned of its groups go."""
        self._drop_deferred(worker)
        self._group_kinds.pop(worker, None)
        window = self._window_workers.pop(worker, None)
        if window is not None:
            _kernels.clear_holder(self._window_masks, window.held, window.bit)
        blocks = self._windows.pop(number, 0)
        if blocks:
            bit = 1 << number
            self._window_sizes[blocks] &= ~bit
            if not self._window_sizes[blocks]:
                del self._window_sizes[blocks]
            self.window_mask &= ~bit

    def window_blocks(self, number: int) -> int:
        """Blocks of worker ``number``'s sliding window (0: no hybrid model seen there)."""
        return self._windows.get(number, 0)

    # --- matching ----------------------------------------------------------------------

    def window_cut(
        self,
        groups: list[tuple[int, int]],
        keys: Sequence[int],
        most: int,
        also: Mapping[int, int] | None = None,
    ) -> list[tuple[int, int]]:
        """`match_masks`'s ``groups`` with each hybrid worker's match cut to what its
        engine can reuse (the module docstring), at most ``most`` blocks (the engine
        computes the prompt's last token: ``(tokens - 1) // block_size``). ``also``:
        window blocks pending per key (the last window of requests just routed, which
        their engines keep once they ran). Same shape: pairs of
        (workers, blocks), shallowest first, a worker's the deepest it is in."""
        hybrid = self.window_mask
        if not hybrid or not groups or not groups[0][0] & hybrid:
            return groups
        cut = [(mask & ~hybrid, blocks) for mask, blocks in groups if mask & ~hybrid]
        deepest = min(groups[-1][1], most)
        if deepest <= 0:
            return cut
        held, extra = self._window_masks, also or {}
        present = [(held.get(key, 0) | extra.get(key, 0)) & hybrid for key in keys[:deepest]]
        found: list[tuple[int, int]] = []
        for width, members in self._window_sizes.items():
            if not members & groups[0][0]:
                continue
            window = _window_ands(present, width)
            assigned, deeper, index = 0, 0, len(groups) - 1
            for blocks in range(deepest, 0, -1):
                while index >= 0 and min(groups[index][1], most) >= blocks:
                    deeper |= groups[index][0]  # the workers matching at least ``blocks``
                    index -= 1
                reusable = window[blocks - 1] & deeper & members & ~assigned
                if reusable:
                    found.append((reusable, blocks))
                    assigned |= reusable
        found.sort(key=lambda pair: pair[1])
        return cut + found


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
