"""`PrefixIndex`: which worker holds which prefix blocks, rebuilt from kv messages.

Feed it every item of ``kvbus.subscribe()`` (`PrefixIndex.apply`); ask it how much of a
prompt each worker already holds (`PrefixIndex.match`).

Blocks are keyed on the router's side by a hash chained over their token ids (and the
LoRA adapter and per-block extra keys), so the index never depends on the engine's hash
seed or algorithm; each worker keeps a map from the engine's block hash to that key so
``BlockRemoved`` applies. A worker is a kvbus source (``NAME/dp<rank>`` for vLLM
engines). Blocks are tracked per medium (GPU, CPU, STORAGE); for hybrid models only
full-attention groups count. ``AllBlocksCleared``, a `Resync` and a new epoch clear
exactly that worker's blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from kvbus.envelope import Kind
from kvbus.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, SourceStarted
from kvbus.subscribe import Message, Resync

MEDIUM_BITS: Final = {None: 1, "GPU": 1, "CPU": 2, "STORAGE": 4}
DEFAULT_MEDIUM_WEIGHTS: Final = {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25}
_FULL_ATTENTION: Final = {None, "full_attention", "mla_attention", "sink_full_attention"}
_ROOT: Final = 0


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    parent: int = _ROOT,
) -> list[int]:
    """Router keys of the full blocks of ``token_ids``, chained from ``parent``.

    Each key hashes (parent key, LoRA, the block's extra keys, the block's token bytes)
    with Python's own hash: fast, and independent of the engine's seed and algorithm,
    but private to this process (never send keys to another one).
    """
    data = array("I", token_ids).tobytes()
    step = block_size * 4
    keys = []
    for i in range(len(token_ids) // block_size):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        if extra and lora_name is not None and extra[0] == lora_name:
            # vLLM puts the LoRA name first in every block's extra keys; it is hashed on
            # its own here, so a query needs only ``lora_name``, not per-block keys.
            extra = tuple(extra[1:]) or None
        parent = hash((parent, lora_name, extra, data[i * step : (i + 1) * step]))
        keys.append(parent)
    return keys


def mask_numbers(mask: int) -> list[int]:
    """The set bits of a holder mask (worker numbers), lowest first; quick for few bits."""
    numbers = []
    while mask:
        lowest = mask & -mask
        numbers.append(lowest.bit_length() - 1)
        mask ^= lowest
    return numbers


class _Worker:
    __slots__ = ("bit", "held", "media")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        """1 << this worker's number: its place in the index's holder masks."""
        self.media: dict[int, dict[int | bytes, int]] = {1: {}, 2: {}, 4: {}}
        """medium bit -> {engine block hash -> router key}"""
        self.held: dict[int, int] = {}
        """router key -> bits of the media holding it"""


class PrefixIndex:
    def __init__(
        self,
        block_size: int | None = None,
        medium_weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS,
    ) -> None:
        self.block_size = block_size
        """Tokens per block; ``None`` adopts the first full-attention ``BlockStored``'s."""
        self._bit_weights = sorted(
            ((MEDIUM_BITS[m], w) for m, w in medium_weights.items()), key=lambda bw: -bw[1]
        )
        # Which workers hold a block is an integer bitmask (bit n: the n-th worker ever
        # seen; numbers are never reused), so narrowing the candidates of a long prompt
        # is one big-int AND per block, whatever the number of workers.
        self._masks: dict[int, int] = {}
        """router key -> mask of the workers holding it (any medium)"""
        self._workers: dict[str, _Worker] = {}
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []
        self._groups: dict[tuple[int, int], dict[str, int]] = {}
        self.unchained = 0
        """Stored blocks skipped because their parent was unknown (joined mid-stream)."""
        self.offloaded = False
        """Whether a block was ever stored outside the GPU (CPU, STORAGE)."""

    # --- feeding ---------------------------------------------------------------------

    def apply(self, item: Message | Resync) -> None:
        """Apply one item of ``kvbus.subscribe()``."""
        if isinstance(item, Resync):
            self.clear(item.source)
        elif item.kind == Kind.KV and isinstance(item.body, KVEventBatch):
            self.apply_events(item.source, item.body.events)
        elif isinstance(item.body, SourceStarted):
            self.clear(item.source)

    def apply_events(self, worker: str, events: Iterable[Any]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker)

    def _worker(self, worker: str) -> _Worker:
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _Worker(1 << self.worker_number(worker))
        return state

    def _stored(self, worker: str, event: BlockStored) -> None:
        if event.kv_cache_spec_kind not in _FULL_ATTENTION:
            return
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            return
        state = self._worker(worker)
        bit = MEDIUM_BITS.get(event.medium, 1)
        if bit != 1:
            self.offloaded = True
        parent = _ROOT
        if event.parent_block_hash is not None:
            found = _any_medium(state, event.parent_block_hash)
            if found is None:
                self.unchained += len(event.block_hashes)
                return
            parent = found
        keys = block_keys(
            event.token_ids, self.block_size, event.lora_name, event.extra_keys, parent
        )
        masks, held, blocks, worker_bit = self._masks, state.held, state.media[bit], state.bit
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            blocks[engine_hash] = key
            bits = held.get(key, 0)
            if not bits:
                masks[key] = masks.get(key, 0) | worker_bit
            held[key] = bits | bit

    def _removed(self, worker: str, event: BlockRemoved) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        bit = MEDIUM_BITS.get(event.medium, 1)
        blocks = state.media[bit]
        for engine_hash in event.block_hashes:
            key = blocks.pop(engine_hash, None)
            if key is not None:
                self._drop(state, key, bit)

    def _drop(self, state: _Worker, key: int, bit: int) -> None:
        bits = state.held.get(key, 0) & ~bit
        if bits:
            state.held[key] = bits
            return
        state.held.pop(key, None)
        self._unmask(key, state.bit)

    def _unmask(self, key: int, worker_bit: int) -> None:
        mask = self._masks.get(key, 0) & ~worker_bit
        if mask:
            self._masks[key] = mask
        else:
            self._masks.pop(key, None)

    def clear(self, worker: str) -> None:
        """Forget everything ``worker`` held (it restarted, or its events were lost)."""
        state = self._workers.pop(worker, None)
        if state is not None:
            for key in state.held:
                self._unmask(key, state.bit)

    # --- querying --------------------------------------------------------------------

    def match(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> dict[str, int]:
        """Prefix tokens of the prompt each worker holds (in any medium), for every
        worker holding at least its first block."""
        return self.match_keys(self.keys(token_ids, lora_name, extra_keys))

    def keys(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[int]:
        """The router keys of the prompt's full blocks (none before the block size is known)."""
        if self.block_size is None:
            return []
        return block_keys(token_ids, self.block_size, lora_name, extra_keys)

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
        keys = self.keys(token_ids, lora_name, extra_keys)
        block_size = self.block_size or 0
        return {
            worker: self.weighted_blocks(worker, keys[: tokens // block_size])
            for worker, tokens in self.match_keys(keys).items()
        }

    def _weight(self, bits: int) -> float:
        for bit, weight in self._bit_weights:
            if bits & bit:
                return weight
        return 0.0

    def weighted_blocks(self, worker: str, keys: Sequence[int]) -> float:
        """``keys`` (held by ``worker``) counted by the weight of their best medium."""
        held = self._workers[worker].held
        return sum(self._weight(held.get(k, 0)) for k in keys)

    def holds(self, worker: str, key: int) -> bool:
        state = self._workers.get(worker)
        return state is not None and key in state.held

    # --- introspection ---------------------------------------------------------------

    def worker_number(self, worker: str) -> int:
        """The worker's bit in `match_masks` (assigned on first sight, never reused)."""
        number = self._numbers.get(worker)
        if number is None:
            number = self._numbers[worker] = len(self._names)
            self._names.append(worker)
        return number

    def worker_name(self, number: int) -> str:
        return self._names[number]

    def workers(self) -> list[str]:
        return list(self._workers)

    def blocks(self, worker: str) -> set[int | bytes]:
        """The engine block hashes ``worker`` holds (any medium)."""
        state = self._workers.get(worker)
        return {h for blocks in state.media.values() for h in blocks} if state else set()

    def __len__(self) -> int:
        """Distinct prefix blocks indexed."""
        return len(self._masks)


def _any_medium(state: _Worker, engine_hash: int | bytes) -> int | None:
    for blocks in state.media.values():
        key = blocks.get(engine_hash)
        if key is not None:
            return key
    return None
