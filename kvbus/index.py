"""`PrefixIndex`: which worker holds which prefix blocks, rebuilt from kv messages.

Feed it every item of ``kvbus.subscribe()`` (`PrefixIndex.apply`); ask it how much of a
prompt each worker already holds (`PrefixIndex.match`).

Blocks are keyed on the router's side by a hash chained over their token ids (and the
LoRA adapter, the per-block extra keys and, for vLLM >= 0.33 engines that hash ahead,
the lookahead tokens), so the index never depends on the engine's hash seed or
algorithm. A worker is a kvbus source (``NAME/dp<rank>`` for vLLM engines). Blocks are
tracked per medium (GPU, CPU, STORAGE); for hybrid models only full-attention groups
count. ``AllBlocksCleared``, a `Resync` and a new epoch clear exactly that worker.

Residency is a count, as in the engine: vLLM may cache several copies of one block
hash (a prompt recomputes its last block even when all of it is cached) and sends a
``BlockStored`` and, on eviction, a ``BlockRemoved`` for each copy, so a block stays
held until its last copy goes. Each worker remembers the router key of engine hashes
for a while after their last copy went, so a block stored under an evicted parent
still chains (bounded: at most as many remembered as held, and at least 1,024).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, cast

from kvbus import _kernels
from kvbus.envelope import Kind
from kvbus.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    PackedBlockStored,
    SourceStarted,
    decode_kv_batch,
    decode_packed_kv_batch,
)
from kvbus.kernels import kernels
from kvbus.subscribe import Message, Resync

# A worker's copies of a block in each medium are packed in one int (a field of
# _FIELD_BITS bits per medium): one dict lookup per stored or removed block, and a
# GPU-only count is a small int.
_FIELD_BITS: Final = 21
_FIELD: Final = (1 << _FIELD_BITS) - 1
MEDIUM_SHIFTS: Final = {None: 0, "GPU": 0, "CPU": _FIELD_BITS, "STORAGE": 2 * _FIELD_BITS}
DEFAULT_MEDIUM_WEIGHTS: Final = {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25}
_OFF_GPU: Final = ("CPU", "STORAGE")
_FULL_ATTENTION: Final = {None, "full_attention", "mla_attention", "sink_full_attention"}
_ROOT: Final = 0
MAX_BLOCK_SIZE: Final = 1 << 20
"""Larger (or non-positive) block sizes in an event are malformed; vLLM's are <= 4096."""
_MIN_REMEMBERED: Final = 1024


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    parent: int = _ROOT,
    lookahead: int | Sequence[Sequence[int]] = 0,
) -> list[int]:
    """Router keys of the full blocks of ``token_ids``, chained from ``parent``.

    Each key hashes (parent key, LoRA, the block's extra keys, the block's token bytes
    and its lookahead tokens) with Python's own hash: fast, and independent of the
    engine's seed and algorithm, but private to this process (never send keys to
    another one). ``lookahead`` is either how many tokens after each block went into
    its hash (a prompt: a block without that many tokens after it gets no key, as the
    engine does not cache it) or those tokens per block (a ``BlockStored``).
    """
    data = kernels.token_bytes(token_ids)
    return _keys_of(data, block_size, lora_name, extra_keys, parent, lookahead)


def _keys_of(
    data: bytes,
    block_size: int,
    lora_name: str | None,
    extra_keys: Sequence[Any] | None,
    parent: int,
    lookahead: int | Sequence[Sequence[int]],
) -> list[int]:
    """`block_keys` of the tokens in ``data`` (`kernels.token_bytes`' uint32 bytes)."""
    step = block_size * 4
    if lora_name is None and extra_keys is None and not lookahead:
        return kernels.chain(data, step, parent)
    count = len(data) // step
    tails: list[bytes] | None = None  # per block: the lookahead tokens in its hash
    if isinstance(lookahead, int):
        if lookahead:
            count = max(0, (len(data) // 4 - lookahead) // block_size)
            ahead = lookahead * 4
            tails = [data[(i + 1) * step : (i + 1) * step + ahead] for i in range(count)]
    else:
        tails = [kernels.token_bytes(tokens) for tokens in lookahead]
    keys = []
    for i in range(count):
        extra = None
        if extra_keys is not None and i < len(extra_keys):
            extra = extra_keys[i]
            if extra and lora_name is not None and extra[0] == lora_name:
                # vLLM puts the LoRA name first in every block's extra keys; it is hashed
                # on its own here, so a query needs only ``lora_name``.
                extra = tuple(extra[1:]) or None
        block = data[i * step : (i + 1) * step]
        if tails is not None:
            block += tails[i] if i < len(tails) else b""
        parent = hash((parent, lora_name, extra, block))
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
    __slots__ = ("bit", "forgotten", "held", "keys", "number", "resident")

    def __init__(self, number: int) -> None:
        self.number = number
        self.bit = 1 << number
        """1 << this worker's number: its place in the index's holder masks."""
        self.keys: dict[int | bytes, int] = {}
        """engine block hash -> router key, for held blocks and recently evicted ones"""
        self.held: dict[int, int] = {}
        """router key -> cached copies per medium, packed (see MEDIUM_SHIFTS)"""
        self.resident = 0
        """Distinct blocks with a copy on the GPU."""
        self.forgotten: deque[int | bytes] = deque()
        """engine hashes whose last copy went, oldest first (their keys are dropped
        from ``keys`` once more of them are remembered than blocks are held)"""


class PrefixIndex:
    def __init__(
        self,
        block_size: int | None = None,
        medium_weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS,
    ) -> None:
        self.block_size = block_size
        """Tokens per block; ``None`` adopts the first full-attention ``BlockStored``'s."""
        self.lookahead = 0
        """Tokens after a block that its hash covers (vLLM >= 0.33 with lookahead
        hashing), learned from the events."""
        self._shift_weights = sorted(
            ((MEDIUM_SHIFTS[m], w) for m, w in medium_weights.items()), key=lambda sw: -sw[1]
        )
        # Which workers hold a block is an integer bitmask (bit n: the n-th worker ever
        # seen; numbers are never reused), so narrowing the candidates of a long prompt
        # is one big-int AND per block, whatever the number of workers.
        self._masks: dict[int, int] = {}
        """router key -> mask of the workers holding it (any medium)"""
        self._workers: dict[str, _Worker] = {}
        self._chains: dict[int, list[int]] = {}
        """hash of (parent key, an event's token bytes) -> the keys of its blocks"""
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []
        self._groups: dict[tuple[int, int], dict[str, int]] = {}
        self._stored_blocks: list[int] = []
        """per worker number: GPU blocks stored since first seen (copies included)"""
        self.unchained = 0
        """Stored blocks skipped because their parent was unknown (joined mid-stream)."""
        self.malformed = 0
        """Stored events skipped for a block size no engine uses (0, negative, huge) or
        a token id outside 32 bits."""
        self.unknown_removals = 0
        """Removed blocks this index never saw stored (joined mid-stream, or skipped)."""
        self.offloaded = False
        """Whether a block was ever stored outside the GPU (CPU, STORAGE)."""

    # --- feeding ---------------------------------------------------------------------

    def apply(self, item: Message | Resync) -> None:
        """Apply one item of ``kvbus.subscribe()``. A KV batch whose ``body`` nobody
        has read yet is applied from its ``packed_events`` (token ids read straight
        into keys: see `apply_payload`), its ``body`` left undecoded."""
        if isinstance(item, Resync):
            self.clear(item.source)
        elif item.kind == Kind.KV:
            packed = item.packed_events
            if packed is None or not self._apply_packed(item.source, packed):
                # Decoded as the subscriber does, which counts the events it skips.
                body = item.body
                if isinstance(body, KVEventBatch):
                    self.apply_events(item.source, body.events)
        elif isinstance(item.body, SourceStarted):
            self.clear(item.source)

    def apply_payload(self, worker: str, payload: bytes) -> int:
        """Apply a ``KVEventBatch`` straight from its msgpack bytes (``Message.payload``,
        or vLLM's own ZMQ payload): the quickest way in, as each event's token ids go
        into the index's keys without an int object per token. A batch the quick way
        does not take (vLLM's older dialect, an event type or a field this kvbus does
        not know, a token id that is no uint32) is decoded as `kvbus.subscribe()` does.
        Returns how many events were skipped as unknown or malformed; raises msgspec's
        errors when ``payload`` is no batch at all."""
        packed = decode_packed_kv_batch(payload)
        if packed is not None and self._apply_packed(worker, packed.events):
            return 0
        batch, skipped = decode_kv_batch(payload)
        self.apply_events(worker, batch.events)
        return skipped

    def _apply_packed(self, worker: str, events: list[Any]) -> bool:
        """Apply a batch's packed events, or (nothing applied) False where any store's
        token ids are not uint32s: all are read before the first event applies, so the
        caller can take the whole batch the usual way."""
        try:  # every store's token bytes, in order
            tokens = [
                kernels.packed_token_bytes(e.token_ids)
                for e in events
                if type(e) is PackedBlockStored
            ]
        except (ValueError, OverflowError):  # msgspec's error when not ints
            return False
        data = iter(tokens)
        for event in events:
            kind = type(event)
            if kind is PackedBlockStored:
                self._stored(worker, event, next(data))
            elif kind is BlockRemoved:
                self._removed(worker, event)
            else:
                self.clear(worker)  # AllBlocksCleared
        return True

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
            state = self._workers[worker] = _Worker(self.worker_number(worker))
        return state

    def _stored(self, worker: str, event: BlockStored, data: bytes | None = None) -> None:
        """Apply a store; ``data``: its token ids already as `kernels.token_bytes`."""
        if event.kv_cache_spec_kind not in _FULL_ATTENTION:
            return
        if not 0 < event.block_size <= MAX_BLOCK_SIZE:
            tokenless = not event.token_ids if data is None else not data
            if event.block_size == 0 and tokenless and event.medium in _OFF_GPU:
                self._copied(worker, event)
                return
            self.malformed += 1  # would poison every later match (block_size 0 divides)
            return
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            return  # a partial-block entry (fine-grained hashing): never a full block
        state = self._worker(worker)
        hashes = event.block_hashes
        shift = MEDIUM_SHIFTS.get(event.medium, 0)
        if shift:
            self.offloaded = True
        else:
            self._stored_blocks[state.number] += len(hashes)
        parent = _ROOT
        if event.parent_block_hash is not None:
            found = state.keys.get(event.parent_block_hash)
            if found is None:
                self.unchained += len(hashes)
                return
            parent = found
        lookahead = event.lookahead_token_ids
        try:
            if data is None:
                data = kernels.token_bytes(event.token_ids)
            if event.lora_name is None and event.extra_keys is None and not lookahead:
                keys = self._plain_keys(data, parent)
            else:
                keys = _keys_of(
                    data,
                    self.block_size,
                    event.lora_name,
                    event.extra_keys,
                    parent,
                    lookahead or 0,
                )
        except OverflowError:  # a token id below 0 or above 32 bits: no vocabulary's
            self.malformed += 1
            return
        if lookahead is not None:
            # Learned only from an event that applied: a skipped one must not change
            # how every later prompt is keyed.
            self.lookahead = max((len(t) for t in lookahead), default=0)
        if len(keys) > len(hashes):
            keys = keys[: len(hashes)]
        # An event's blocks are nearly always new to the worker (one copy each), whole
        # in one call; copies and full counts take the per-block way.
        if kernels.store_new(
            state.keys, state.held, self._masks, hashes, keys, state.bit, 1 << shift
        ):
            if not shift:
                state.resident += len(keys)
        else:
            self._add_copies(state, keys, shift)

    def _plain_keys(self, data: bytes, parent: int) -> list[int]:
        """`block_keys` of a plain event's blocks (``data``: its token bytes), shared by
        every worker that stores the same blocks under the same parent (a fleet caches
        its popular prefixes on many workers): one hash over the event's tokens finds
        them. That hash is as
        hard to collide as the keys themselves (the same keyed hash of the same bytes),
        and the shared keys are the very objects the index's dicts hold, quicker to
        find there."""
        event_key = hash((parent, data))
        keys = self._chains.get(event_key)
        if keys is None:
            keys = kernels.chain(data, 4 * cast(int, self.block_size), parent)
            if len(self._chains) >= max(_MIN_REMEMBERED, len(self._masks) >> 3):
                self._chains.clear()  # the popular ones come back at once
            self._chains[event_key] = keys
        return keys

    def _add_copies(self, state: _Worker, keys: Iterable[int], shift: int) -> None:
        """One more copy in the medium at ``shift`` of each of ``keys``, block by block."""
        held, masks, unit = state.held, self._masks, 1 << shift
        for key in keys:
            count = held.get(key, 0)
            if not count:
                masks[key] = masks.get(key, 0) | state.bit
            elif (count >> shift) & _FIELD == _FIELD:
                continue  # as many copies as a field holds: count no more
            held[key] = count + unit
            if not shift and not count & _FIELD:
                state.resident += 1

    def _copied(self, worker: str, event: BlockStored) -> None:
        """A tokenless store off the GPU (vLLM's offloading connector by default, whose
        events name the offloaded blocks by their engine hash only): another copy, in
        that medium, of blocks this worker stored on the GPU before."""
        state = self._workers.get(worker)
        if state is None:
            self.unchained += len(event.block_hashes)
            return
        self.offloaded = True
        keys = [state.keys.get(engine_hash) for engine_hash in event.block_hashes]
        known = [key for key in keys if key is not None]
        self.unchained += len(keys) - len(known)
        self._add_copies(state, known, MEDIUM_SHIFTS[event.medium])

    def _removed(self, worker: str, event: BlockRemoved) -> None:
        state = self._workers.get(worker)
        if state is None:
            self.unknown_removals += len(event.block_hashes)
            return
        shift = MEDIUM_SHIFTS.get(event.medium, 0)
        hashes = event.block_hashes
        # The usual eviction, whole in one call: distinct known blocks, each the
        # worker's only copy; anything else block by block.
        if kernels.drop_only_copies(
            state.keys, state.held, self._masks, hashes, state.bit, 1 << shift
        ):
            if not shift:
                state.resident -= len(hashes)
            self._forget(state, hashes)
        else:
            keys = list(map(state.keys.get, hashes))
            self._forget(state, self._remove_copies(state, hashes, keys, shift))

    def _remove_copies(
        self, state: _Worker, hashes: Iterable[int | bytes], keys: Iterable[int | None], shift: int
    ) -> list[int | bytes]:
        """One copy less in the medium at ``shift`` of each block, block by block;
        returns the engine hashes of the blocks whose last copy went."""
        unit, held, gone, last = 1 << shift, state.held, [], []
        for engine_hash, key in zip(hashes, keys, strict=True):
            count = 0 if key is None else held.get(key, 0)
            if key is None or not (count >> shift) & _FIELD:
                self.unknown_removals += 1
                continue
            count -= unit
            if not shift and not count & _FIELD:
                state.resident -= 1
            if count:
                held[key] = count  # another copy (or medium) still holds it
            else:
                del held[key]
                gone.append(key)
                last.append(engine_hash)
        _kernels.clear_holder(self._masks, gone, state.bit)
        return last

    def _forget(self, state: _Worker, engine_hashes: Iterable[int | bytes]) -> None:
        """Remember the keys of ``engine_hashes`` (just removed) a while, as their
        children may still be stored, and forget the oldest remembered ones beyond the
        bound (checked once per event)."""
        forgotten, known, held = state.forgotten, state.keys, state.held
        forgotten.extend(engine_hashes)
        for _ in range(len(forgotten) - max(_MIN_REMEMBERED, len(held))):
            oldest = forgotten.popleft()
            key = known.get(oldest)
            if key is not None and key not in held:
                del known[oldest]

    def clear(self, worker: str) -> None:
        """Forget everything ``worker`` held (it restarted, or its events were lost)."""
        state = self._workers.pop(worker, None)
        if state is None:
            return
        _kernels.clear_holder(self._masks, state.held, state.bit)

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
        keys = self.keys(token_ids, lora_name, extra_keys)
        block_size = self.block_size or 0
        return {
            worker: self.weighted_blocks(worker, keys[: tokens // block_size])
            for worker, tokens in self.match_keys(keys).items()
        }

    def _weight(self, copies: int) -> float:
        for shift, weight in self._shift_weights:
            if (copies >> shift) & _FIELD:
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
            self._stored_blocks.append(0)
        return number

    def worker_name(self, number: int) -> str:
        return self._names[number]

    def workers(self) -> list[str]:
        return list(self._workers)

    def blocks(self, worker: str) -> set[int | bytes]:
        """The engine block hashes ``worker`` holds (any medium)."""
        state = self._workers.get(worker)
        if state is None:
            return set()
        return {h for h, key in state.keys.items() if key in state.held}

    def copies(self, worker: str, medium: str = "GPU") -> int:
        """Cached block copies ``worker`` holds in ``medium`` (the engine's count)."""
        state = self._workers.get(worker)
        shift = MEDIUM_SHIFTS[medium]
        return sum((c >> shift) & _FIELD for c in state.held.values()) if state else 0

    def resident(self, worker: str) -> int:
        """Distinct blocks ``worker`` holds on the GPU."""
        state = self._workers.get(worker)
        return state.resident if state else 0

    def stored(self, number: int) -> int:
        """GPU blocks worker ``number`` stored since first seen (each copy; clears and
        restarts do not reset it): how fast its cache turns over."""
        return self._stored_blocks[number]

    def __len__(self) -> int:
        """Distinct prefix blocks indexed."""
        return len(self._masks)
