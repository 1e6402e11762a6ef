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
        parent = hash((parent, lora_name, extra, data[i * step : (i + 1) * step]))
        keys.append(parent)
    return keys


class _Worker:
    __slots__ = ("media",)

    def __init__(self) -> None:
        self.media: dict[int, dict[int | bytes, int]] = {1: {}, 2: {}, 4: {}}
        """medium bit -> {engine block hash -> router key}"""


class PrefixIndex:
    def __init__(
        self, block_size: int, medium_weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS
    ) -> None:
        self.block_size = block_size
        self._bit_weights = sorted(
            ((MEDIUM_BITS[m], w) for m, w in medium_weights.items()), key=lambda bw: -bw[1]
        )
        self._holders: dict[int, dict[str, int]] = {}
        """router key -> {worker: bitmask of the media holding it}"""
        self._workers: dict[str, _Worker] = {}
        self.unchained = 0
        """Stored blocks skipped because their parent was unknown (joined mid-stream)."""

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

    def _stored(self, worker: str, event: BlockStored) -> None:
        if event.kv_cache_spec_kind not in _FULL_ATTENTION or event.block_size != self.block_size:
            return
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _Worker()
        bit = MEDIUM_BITS.get(event.medium, 1)
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
        holders = self._holders
        blocks = state.media[bit]
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            blocks[engine_hash] = key
            held = holders.get(key)
            if held is None:
                holders[key] = {worker: bit}
            else:
                held[worker] = held.get(worker, 0) | bit

    def _removed(self, worker: str, event: BlockRemoved) -> None:
        state = self._workers.get(worker)
        if state is None:
            return
        bit = MEDIUM_BITS.get(event.medium, 1)
        blocks = state.media[bit]
        for engine_hash in event.block_hashes:
            key = blocks.pop(engine_hash, None)
            if key is not None:
                self._drop(worker, key, bit)

    def _drop(self, worker: str, key: int, bit: int) -> None:
        held = self._holders.get(key)
        if held is None or worker not in held:
            return
        left = held[worker] & ~bit
        if left:
            held[worker] = left
        else:
            del held[worker]
            if not held:
                del self._holders[key]

    def clear(self, worker: str) -> None:
        """Forget everything ``worker`` held (it restarted, or its events were lost)."""
        state = self._workers.pop(worker, None)
        if state is not None:
            for bit, blocks in state.media.items():
                for key in blocks.values():
                    self._drop(worker, key, bit)

    # --- querying --------------------------------------------------------------------

    def match(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> dict[str, int]:
        """Prefix tokens of the prompt each worker holds (in any medium), for every
        worker holding at least its first block."""
        return self.match_keys(block_keys(token_ids, self.block_size, lora_name, extra_keys))

    def match_keys(self, keys: Sequence[int]) -> dict[str, int]:
        holders = self._holders
        first = holders.get(keys[0]) if keys else None
        if not first:
            return {}
        # Survivors shrink by C-level set intersections and results are filled a group
        # at a time, so a query costs little more than hashing its blocks even when a
        # shared system prompt is held by every worker.
        result: dict[str, int] = {}
        alive: Any = first.keys()
        matched = 1
        for key in keys[1:]:
            held = holders.get(key)
            still = alive & held.keys() if held else set()
            if len(still) < len(alive):
                result.update(dict.fromkeys(alive - still, matched * self.block_size))
            alive = still
            if not alive:
                break
            matched += 1
        result.update(dict.fromkeys(alive, matched * self.block_size))
        return result

    def match_weighted(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
    ) -> dict[str, float]:
        """Like `match`, in blocks each weighted by the best medium holding it (GPU 1,
        CPU 0.5, STORAGE 0.25 by default)."""
        keys = block_keys(token_ids, self.block_size, lora_name, extra_keys)
        holders = self._holders
        return {
            worker: sum(self._weight(holders[k][worker]) for k in keys[: tokens // self.block_size])
            for worker, tokens in self.match_keys(keys).items()
        }

    def _weight(self, bits: int) -> float:
        for bit, weight in self._bit_weights:
            if bits & bit:
                return weight
        return 0.0

    # --- introspection ---------------------------------------------------------------

    def workers(self) -> list[str]:
        return list(self._workers)

    def blocks(self, worker: str) -> set[int | bytes]:
        """The engine block hashes ``worker`` holds (any medium)."""
        state = self._workers.get(worker)
        return {h for blocks in state.media.values() for h in blocks} if state else set()

    def __len__(self) -> int:
        """Distinct prefix blocks indexed."""
        return len(self._holders)


def _any_medium(state: _Worker, engine_hash: int | bytes) -> int | None:
    for blocks in state.media.values():
        key = blocks.get(engine_hash)
        if key is not None:
            return key
    return None
