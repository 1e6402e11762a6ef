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

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec

from kvbus import _kernels
from kvbus.envelope import Kind
from kvbus.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LoadMetrics,
    PackedBlockStored,
    SourceStarted,
    decode_kv_batch,
    decode_packed_kv_batch,
)
from kvbus.kernels import kernels
from kvbus.logs import LimitedLog, shown
from kvbus.subscribe import Message, Resync

log = logging.getLogger("kvbus.index")
_limited = LimitedLog(log)

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
DEFAULT_MAX_BLOCKS_PER_WORKER: Final = 1 << 20
"""Distinct blocks (all media) one worker may make the index hold (about 200 MiB of
index); past it the worker's oldest blocks are forgotten (`PrefixIndex.over_cap`)."""
CAPACITY_HEADROOM: Final = 2
"""A worker that advertised its KV cache (``LoadMetrics.kv_cache_blocks``) may hold this
many times as many distinct GPU blocks (plus `_MIN_REMEMBERED`) before its oldest are
forgotten: the engine itself never holds more than its capacity."""
MAX_PROFILES: Final = 8
"""Distinct (block size, lookahead) pairs among the workers; a worker whose events would
add another is skipped (`PrefixIndex.profile_refused`), as a query keys the prompt once
per pair."""


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    parent: int = _ROOT,
    lookahead: int | Sequence[Sequence[int]] = 0,
) -> list[int]:
    """Router keys of the full blocks of ``token_ids``, chained from ``parent``.

    Each key is a 64-bit BLAKE2b of the parent key and the block's token bytes, and
    for a block with any, of `block_salt`'s canonical bytes of its LoRA, extra keys and
    lookahead tokens (`kvbus._kernels.block_key`): independent of the engine's seed and
    algorithm, and the same in every process, so router replicas can share them (token
    ids hash as `kernels.token_bytes` writes them: native uint32, little-endian on every
    platform vLLM runs on).
    ``extra_keys`` hold any msgpack value (a list or map inside included).
    ``lookahead`` is either how many tokens after each block went into its hash (a
    prompt: a block without that many tokens after it gets no key, as the engine does
    not cache it) or those tokens per block (a ``BlockStored``).
    """
    data = kernels.token_bytes(token_ids)
    return _keys_of(data, block_size, lora_name, extra_keys, parent, lookahead)


_canonical: Final = msgspec.msgpack.Encoder()


def block_salt(lora_name: str | None, extra: Any, tail: bytes) -> bytes:
    """What a block's key hashes after its tokens, beside its parent: nothing for a
    plain block, else the msgpack of (LoRA name, the block's extra keys, its lookahead
    tokens' bytes). msgpack writes an array the same whether it was a list or a tuple
    and a map in the order it came in (as decoded from an event), so every process
    that reads one event, or is given the same values, gets the same bytes. The salt
    follows the block's fixed-size bytes and is itself one msgpack value: no two
    (block, salt) pairs give the same input."""
    if lora_name is None and extra is None and not tail:
        return b""
    return _canonical.encode((lora_name, extra, tail))


def _keys_of(
    data: bytes,
    block_size: int,
    lora_name: str | None,
    extra_keys: Sequence[Any] | None,
    parent: int,
    lookahead: int | Sequence[Sequence[int]],
) -> list[int]:
    """`block_keys` of the tokens in ``data`` (`kernels.token_bytes`' uint32 bytes).
    Raises OverflowError (a token id past 32 bits, a parent past 64) and nothing else
    for any decoded event."""
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
            if (
                isinstance(extra, (tuple, list))
                and extra
                and lora_name is not None
                and extra[0] == lora_name
            ):
                # vLLM puts the LoRA name first in every block's extra keys; it is hashed
                # on its own here, so a query needs only ``lora_name``.
                extra = tuple(extra[1:]) or None
        tail = tails[i] if tails is not None and i < len(tails) else b""
        block = data[i * step : (i + 1) * step]
        parent = _kernels.block_key(parent, block + block_salt(lora_name, extra, tail))
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
    __slots__ = (
        "bit",
        "block_size",
        "forgotten",
        "held",
        "keys",
        "lookahead",
        "number",
        "resident",
    )

    def __init__(self, number: int, block_size: int) -> None:
        self.number = number
        self.block_size = block_size
        """Tokens per block of this worker's engine (its first full store's, or the
        index's configured one): its keys are made with it, never another worker's."""
        self.lookahead = 0
        """Tokens after a block that this worker's hashes cover (vLLM >= 0.33 with
        lookahead hashing), learned from its own applied events."""
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

    @property
    def profile(self) -> tuple[int, int]:
        return (self.block_size, self.lookahead)


class PrefixIndex:
    def __init__(
        self,
        block_size: int | None = None,
        medium_weights: Mapping[str, float] = DEFAULT_MEDIUM_WEIGHTS,
        max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER,
    ) -> None:
        self.configured_block_size = block_size
        """The operator's block size: a store of another size is skipped (vLLM sends
        partial-block entries too). ``None``: each worker's first full-attention store
        gives that worker's own block size."""
        self.max_blocks_per_worker = max_blocks_per_worker
        """Distinct blocks one worker may make this index hold (`DEFAULT_MAX_BLOCKS_PER_WORKER`)."""
        # Workers per (block size, lookahead), in order of first sight; the one most
        # workers share keys `keys()` (one worker's odd events blind only itself).
        self._profiles: dict[tuple[int, int], int] = {}
        self._fleet: tuple[int | None, int] = (block_size, 0)
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
        self._capacity: list[int] = []
        """per worker number: its advertised KV cache blocks (0: not advertised)"""
        self.unchained = 0
        """Stored blocks skipped because their parent was unknown (joined mid-stream)."""
        self.malformed = 0
        """Stored events skipped for a block size no engine uses (0, negative, huge) or
        a token id outside 32 bits."""
        self.unknown_removals = 0
        """Removed blocks this index never saw stored (joined mid-stream, or skipped)."""
        self.offloaded = False
        """Whether a block was ever stored outside the GPU (CPU, STORAGE)."""
        self.other_block_size = 0
        """Stored blocks skipped for a block size other than their worker's (vLLM's
        partial-block entries; or a worker disagreeing with ``--block-size``)."""
        self.profile_refused = 0
        """Stored blocks skipped because their worker would add a (block size,
        lookahead) pair past `MAX_PROFILES`."""
        self.over_cap = 0
        """Blocks forgotten because their worker held more than its cap (see
        `DEFAULT_MAX_BLOCKS_PER_WORKER`, `set_capacity`)."""

    @property
    def block_size(self) -> int | None:
        """Tokens per block of the fleet's keys (`keys`): the configured one, else the
        one most workers use (ties: the one seen first); ``None`` before any store."""
        return self._fleet[0]

    @property
    def lookahead(self) -> int:
        """Lookahead tokens of the fleet's keys: the one most workers of the fleet's
        block size use (ties: the one seen first)."""
        return self._fleet[1]

    def profiles(self) -> dict[tuple[int, int], int]:
        """Workers per (block size, lookahead) they key their blocks with."""
        return dict(self._profiles)

    def _join_profile(self, state: _Worker, delta: int) -> None:
        profile = state.profile
        count = self._profiles.get(profile, 0) + delta
        if count > 0:
            self._profiles[profile] = count
        else:
            self._profiles.pop(profile, None)
        if not self._profiles:
            return  # the last worker left: keep keying as before
        sizes: dict[int, int] = {}
        for (size, _), workers in self._profiles.items():
            sizes[size] = sizes.get(size, 0) + workers
        block_size = self.configured_block_size or max(sizes, key=sizes.__getitem__)
        of_size = [(ahead, n) for (size, ahead), n in self._profiles.items() if size == block_size]
        lookahead = max(of_size, key=lambda an: an[1])[0] if of_size else 0
        self._fleet = (block_size, lookahead)

    def set_capacity(self, worker: str, kv_cache_blocks: int) -> None:
        """The worker's advertised KV cache (``LoadMetrics.kv_cache_blocks``): it may
        hold `CAPACITY_HEADROOM` times as many distinct GPU blocks here, no more."""
        number = self.worker_number(worker)
        self._capacity[number] = max(0, min(kv_cache_blocks, self.max_blocks_per_worker))

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
        elif isinstance(item.body, LoadMetrics):
            self.set_capacity(item.source, item.body.kv_cache_blocks)

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

    def _worker(self, worker: str, block_size: int) -> _Worker | None:
        """``worker``'s state, made with ``block_size`` on first sight (None: that would
        add a profile past `MAX_PROFILES`)."""
        state = self._workers.get(worker)
        if state is None:
            state = _Worker(self.worker_number(worker), block_size)
            if not self._admits(state.profile):
                return None
            self._workers[worker] = state
            self._join_profile(state, 1)
        return state

    def _admits(self, profile: tuple[int, int]) -> bool:
        return profile in self._profiles or len(self._profiles) < MAX_PROFILES

    def _stored(self, worker: str, event: BlockStored, data: bytes | None = None) -> None:
        """Apply a store; ``data``: its token ids already as `kernels.token_bytes`.
        Nothing is counted or learned from it before its keys are made: an event that
        fails is skipped whole (counted in ``malformed``)."""
        if event.kv_cache_spec_kind not in _FULL_ATTENTION:
            return
        if not 0 < event.block_size <= MAX_BLOCK_SIZE:
            tokenless = not event.token_ids if data is None else not data
            if event.block_size == 0 and tokenless and event.medium in _OFF_GPU:
                self._copied(worker, event)
                return
            self.malformed += 1  # would poison every later match (block_size 0 divides)
            return
        hashes = event.block_hashes
        state = self._workers.get(worker)
        block_size = state.block_size if state is not None else self.configured_block_size
        if block_size is not None and event.block_size != block_size:
            self.other_block_size += len(hashes)  # a partial-block entry, or a stranger's
            return
        block_size = event.block_size
        parent = _ROOT
        if event.parent_block_hash is not None:
            found = None if state is None else state.keys.get(event.parent_block_hash)
            if found is None:
                if state is not None and MEDIUM_SHIFTS.get(event.medium, 0) == 0:
                    self._stored_blocks[state.number] += len(hashes)
                self.unchained += len(hashes)
                return
            parent = found
        lookahead = event.lookahead_token_ids
        try:
            if data is None:
                data = kernels.token_bytes(event.token_ids)
            if event.lora_name is None and event.extra_keys is None and not lookahead:
                keys = self._plain_keys(data, parent, block_size)
            else:
                keys = _keys_of(
                    data,
                    block_size,
                    event.lora_name,
                    event.extra_keys,
                    parent,
                    lookahead or 0,
                )
        except (OverflowError, TypeError, ValueError):
            # A token id below 0 or above 32 bits (no vocabulary's), or extra keys that
            # cannot be keyed: the whole event is skipped, nothing of it counted.
            self.malformed += 1
            return
        if state is None:
            state = self._worker(worker, block_size)
            if state is None:
                self.profile_refused += len(hashes)
                return
        if lookahead is not None:
            # Learned only from an event that applied, and for its worker only: another
            # worker's prompts are keyed with that worker's own lookahead.
            ahead = max((len(t) for t in lookahead), default=0)
            if ahead != state.lookahead:
                if not self._admits((state.block_size, ahead)):
                    self.profile_refused += len(hashes)
                    return
                self._join_profile(state, -1)
                state.lookahead = ahead
                self._join_profile(state, 1)
        shift = MEDIUM_SHIFTS.get(event.medium, 0)
        if shift:
            self.offloaded = True
        else:
            self._stored_blocks[state.number] += len(hashes)
        if len(keys) > len(hashes):
            keys = keys[: len(hashes)]
        if not state.keys.keys().isdisjoint(hashes):
            self._release_rekeyed(worker, state, hashes, keys, event.medium)
        # An event's blocks are nearly always new to the worker (one copy each), whole
        # in one call; copies and full counts take the per-block way.
        if kernels.store_new(
            state.keys, state.held, self._masks, hashes, keys, state.bit, 1 << shift
        ):
            if not shift:
                state.resident += len(keys)
        else:
            self._add_copies(state, keys, shift)
        self._cap(worker, state)

    def _release_rekeyed(
        self,
        worker: str,
        state: _Worker,
        hashes: Sequence[int | bytes],
        keys: Sequence[int],
        medium: str | None,
    ) -> None:
        """Engine hashes stored again under another key than before (a forged event, or a
        collision): their old copies are removed first, as a ``BlockRemoved`` would, or
        the old keys would stay held with no hash pointing to them (credited for ever,
        beyond the reach of removals and of the cap)."""
        known = state.keys
        rekeyed = [h for h, key in zip(hashes, keys, strict=False) if known.get(h, key) != key]
        if rekeyed:
            self._removed(worker, BlockRemoved(block_hashes=rekeyed, medium=medium))

    def _cap(self, worker: str, state: _Worker) -> None:
        """Forget ``state``'s oldest blocks (first stored first) while it holds more than
        its cap, down to 7/8 of it, so that the work is amortized over the stores that
        filled it. Forgetting a held block only loses routing credit for it: its later
        removal counts as unknown, its children as unchained."""
        limit = self.max_blocks_per_worker
        capacity = self._capacity[state.number]
        gpu_limit = capacity * CAPACITY_HEADROOM + _MIN_REMEMBERED if capacity else limit
        # Engine hashes count too: a source can name one block by many hashes (each a
        # dict entry here) without holding more blocks.
        hash_limit = limit + _MIN_REMEMBERED
        if len(state.held) <= limit and state.resident <= gpu_limit:
            if len(state.keys) <= hash_limit:
                return
        limit -= limit >> 3
        gpu_limit -= gpu_limit >> 3
        hash_limit -= hash_limit >> 3
        held, known = state.held, state.keys
        victims: list[int | bytes] = []
        excess, gpu_excess = len(held) - limit, state.resident - gpu_limit
        hash_excess = len(known) - hash_limit
        for engine_hash in known:  # insertion order: first stored first
            if excess <= 0 and gpu_excess <= 0 and hash_excess <= 0:
                break
            victims.append(engine_hash)
            hash_excess -= 1
            count = held.get(known[engine_hash], 0)
            if count:
                excess -= 1
                gpu_excess -= 1 if count & _FIELD else 0
        gone = []
        for engine_hash in victims:
            key = known.pop(engine_hash)
            count = held.pop(key, 0)
            if count:
                gone.append(key)
                state.resident -= 1 if count & _FIELD else 0
        _kernels.clear_holder(self._masks, gone, state.bit)
        self.over_cap += len(gone)
        _limited.warning(
            "over_cap",
            "kvbus: worker %s held more blocks than its cap (%d; GPU %d): forgot its %d oldest",
            shown(worker),
            self.max_blocks_per_worker,
            gpu_limit,
            len(gone),
        )

    def _plain_keys(self, data: bytes, parent: int, block_size: int) -> list[int]:
        """`block_keys` of a plain event's blocks (``data``: its token bytes), shared by
        every worker that stores the same blocks under the same parent (a fleet caches
        its popular prefixes on many workers): one hash over the event's tokens finds
        them. That hash is as
        hard to collide as the keys themselves (the same keyed hash of the same bytes),
        and the shared keys are the very objects the index's dicts hold, quicker to
        find there."""
        event_key = hash((parent, block_size, data))
        keys = self._chains.get(event_key)
        if keys is None:
            keys = kernels.chain(data, 4 * block_size, parent)
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
        self._cap(worker, state)

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
        self._join_profile(state, -1)
        _kernels.clear_holder(self._masks, state.held, state.bit)

    # --- querying --------------------------------------------------------------------

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
        for (block_size, _), keys in self._keyings(token_ids, lora_name, extra_keys):
            for mask, blocks in self.match_masks(keys):
                self._add_group(result, mask, blocks * block_size)
        return result

    def _keyings(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        extra_keys: Sequence[Any] | None,
    ) -> list[tuple[tuple[int, int], list[int]]]:
        """The prompt's keys under each profile the workers use (at most `MAX_PROFILES`),
        the fleet's first. A worker's blocks are keyed with its own profile only, so
        the keys of one profile find no other's workers."""
        profiles = [p for p in self._profiles if p != self._fleet]
        if self._fleet[0] is not None:
            profiles.insert(0, (self._fleet[0], self._fleet[1]))
        data = kernels.token_bytes(token_ids)
        return [(p, _keys_of(data, p[0], lora_name, extra_keys, _ROOT, p[1])) for p in profiles]

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
        for _, keys in self._keyings(token_ids, lora_name, extra_keys):
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
            self._capacity.append(0)
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
