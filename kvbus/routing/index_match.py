"""Querying the prefix index: how much of a prompt each worker holds.

A prompt is keyed once per keying in use (`kvbus.routing.index_keys.Profiles`); its keys are
walked once, narrowing the holder mask block by block (`match_masks`), so a query costs
one big-int AND per block whatever the number of workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbus.routing.index_holders import _FIELD, mask_numbers
from kvbus.routing.index_keys import block_keys, prompt_keyings
from kvbus.routing.index_window import _Windows


class _Matching(_Windows):
    """`PrefixIndex`'s querying side: every method that reads a prompt's match."""

    def match(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> dict[str, int]:
        """Prefix tokens of the prompt each worker holds (in any medium), for every
        worker holding at least its first block; each worker's blocks matched with its
        own block size and lookahead."""
        result: dict[str, int] = {}
        keyings = prompt_keyings(token_ids, self._profiles.in_query_order, lora_name, extra_keys)
        for (block_size, _), keys in keyings:
            groups = self.match_masks(keys)
            if self.window_mask:  # hybrid models: what their engines can reuse
                groups = self.window_cut(groups, keys, (len(token_ids) - 1) // block_size)
            for mask, blocks in groups:
                self._add_group(result, mask, blocks * block_size)
        return result

    def keys(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[int]:
        """The router keys of the prompt's full blocks (none before the block size is
        known). Token ids must fit in 32 bits, as the engine's do."""
        if self.block_size is None:
            return []
        return block_keys(
            token_ids, self.block_size, lora_name, extra_keys, lookahead=self.lookahead
        )

    def match_keys(self, keys: Sequence[int]) -> dict[str, int]:
        result: dict[str, int] = {}
        block_size = self.block_size or 0
        for mask, blocks in self.match_masks(keys):
            self._add_group(result, mask, blocks * block_size)
        return result

    def match_masks(
        self, keys: Sequence[int], also: Mapping[int, int] | None = None
    ) -> list[tuple[int, int]]:
        """``(holders, blocks)`` pairs, shallowest first: ``holders`` is a mask of worker
        numbers (see `worker_number`) each holding at least the first ``blocks`` keys. A
        worker's match is the deepest pair it is in (none: it holds no key). ``also``
        adds holders per key (a router's blocks of requests in flight)."""
        masks = self._masks
        extra = also or {}
        alive = (masks.get(keys[0], 0) | extra.get(keys[0], 0)) if keys else 0
        groups: list[tuple[int, int]] = []
        matched = 1
        for key in keys[1:]:
            if not alive:
                break
            still = alive & (masks.get(key, 0) | extra.get(key, 0) if extra else masks.get(key, 0))
            if still != alive:
                # All of ``alive`` but the survivors stop at this depth. The large masks
                # (holders of a shared system prompt) recur from query to query, so they
                # are kept whole and the survivors are overwritten deeper.
                groups.append((alive, matched))
            alive = still
            matched += 1
        if alive:
            groups.append((alive, matched))
        return groups

    def _add_group(self, result: dict[str, int], mask: int, tokens: int) -> None:
        """``result[w] = tokens`` for every worker in ``mask``. Large groups recur
        (everyone holding the system prompt), so their dicts are cached; a mask's names
        never go stale because worker numbers are never reused."""
        names = self._names
        if mask.bit_count() <= 64:  # few workers: walk the set bits
            for number in mask_numbers(mask):
                result[names[number]] = tokens
            return
        group = self._groups.get((mask, tokens))
        if group is None:
            if len(self._groups) >= 256:
                self._groups.clear()
            bits = bin(mask)[:1:-1]  # least significant first
            members = (names[i] for i, b in enumerate(bits) if b == "1")
            group = self._groups[(mask, tokens)] = dict.fromkeys(members, tokens)
        result.update(group)

    def match_weighted(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> dict[str, float]:
        """Like `match`, in blocks each weighted by the best medium holding it (GPU 1,
        CPU 0.5, STORAGE 0.25 by default)."""
        result: dict[str, float] = {}
        keyings = prompt_keyings(token_ids, self._profiles.in_query_order, lora_name, extra_keys)
        for _, keys in keyings:
            for mask, blocks in self.match_masks(keys):
                for worker in self._mask_names(mask):
                    result[worker] = self.weighted_blocks(worker, keys[:blocks])
        return result

    def _mask_names(self, mask: int) -> list[str]:
        return [self._names[number] for number in mask_numbers(mask)]

    def _weight(self, copies: int) -> float:
        for shift, weight in self._shift_weights:
            if (copies >> shift) & _FIELD:
                return weight
        return 0.0

    def weighted_blocks(self, worker: str, keys: Sequence[int]) -> float:
        """``keys`` (held by ``worker``) counted by the weight of their best medium; 0
        for a worker that has sent no event yet (its blocks are only routed there)."""
        state = self._workers.get(worker)
        if state is None:
            return 0.0
        return sum(self._weight(state.held.get(k, 0)) for k in keys)
