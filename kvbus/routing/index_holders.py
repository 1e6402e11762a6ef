"""Who holds which block: each worker's blocks (`_Worker`) and the holder masks over
all workers (`_Holders`, the state the index's feeding and querying sides share).

A worker's copies of a block in each medium are counted, as the engine counts them,
and it remembers the router key of engine hashes a while after their last copy went
(a block stored under an evicted parent still chains). What one worker may make the
index hold is capped; past its cap its oldest blocks are forgotten.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kvbus.routing import _kernels
from kvbus.routing.index_keys import Profiles

# A worker's copies of a block in each medium are packed in one int (a field of
# _FIELD_BITS bits per medium): one dict lookup per stored or removed block, and a
# GPU-only count is a small int.
_FIELD_BITS: Final = 21
_FIELD: Final = (1 << _FIELD_BITS) - 1
MEDIUM_SHIFTS: Final = {None: 0, "GPU": 0, "CPU": _FIELD_BITS, "STORAGE": 2 * _FIELD_BITS}
DEFAULT_MEDIUM_WEIGHTS: Final = {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25}
_MIN_REMEMBERED: Final = 1024
DEFAULT_MAX_BLOCKS_PER_WORKER: Final = 1 << 20
"""Distinct blocks (all media) one worker may make the index hold (about 200 MiB of
index); past it the worker's oldest blocks are forgotten (`PrefixIndex.over_cap`)."""
CAPACITY_HEADROOM: Final = 2
"""A worker that advertised its KV cache (``LoadMetrics.kv_cache_blocks``) may hold this
many times as many distinct GPU blocks (plus `_MIN_REMEMBERED`) before its oldest are
forgotten: the engine itself never holds more than its capacity."""


def mask_numbers(mask: int) -> list[int]:
    """The set bits of a holder mask (worker numbers), lowest first; quick for few bits."""
    numbers = []
    while mask:
        lowest = mask & -mask
        numbers.append(lowest.bit_length() - 1)
        mask ^= lowest
    return numbers


class _Worker:
    """One worker's blocks. Its per-block bookkeeping takes the index's holder masks
    (router key -> mask of holders) and keeps this worker's bit in them right."""

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

    def add_copies(self, masks: dict[int, int], keys: Iterable[int], shift: int) -> None:
        """One more copy in the medium at ``shift`` of each of ``keys``, block by block."""
        held, unit = self.held, 1 << shift
        for key in keys:
            count = held.get(key, 0)
            if not count:
                masks[key] = masks.get(key, 0) | self.bit
            elif (count >> shift) & _FIELD == _FIELD:
                continue  # as many copies as a field holds: count no more
            held[key] = count + unit
            if not shift and not count & _FIELD:
                self.resident += 1

    def remove_copies(
        self,
        masks: dict[int, int],
        hashes: Iterable[int | bytes],
        keys: Iterable[int | None],
        shift: int,
    ) -> tuple[list[int | bytes], int]:
        """One copy less in the medium at ``shift`` of each block, block by block;
        returns the engine hashes of the blocks whose last copy went, and how many of
        the blocks had no copy there (unknown removals)."""
        unit, held, gone, last, unknown = 1 << shift, self.held, [], [], 0
        for engine_hash, key in zip(hashes, keys, strict=True):
            count = 0 if key is None else held.get(key, 0)
            if key is None or not (count >> shift) & _FIELD:
                unknown += 1
                continue
            count -= unit
            if not shift and not count & _FIELD:
                self.resident -= 1
            if count:
                held[key] = count  # another copy (or medium) still holds it
            else:
                del held[key]
                gone.append(key)
                last.append(engine_hash)
        _kernels.clear_holder(masks, gone, self.bit)
        return last, unknown

    def forget(self, engine_hashes: Iterable[int | bytes]) -> None:
        """Remember the keys of ``engine_hashes`` (just removed) a while, as their
        children may still be stored, and forget the oldest remembered ones beyond the
        bound (checked once per event)."""
        forgotten, known, held = self.forgotten, self.keys, self.held
        forgotten.extend(engine_hashes)
        for _ in range(len(forgotten) - max(_MIN_REMEMBERED, len(held))):
            oldest = forgotten.popleft()
            key = known.get(oldest)
            if key is not None and key not in held:
                del known[oldest]

    def forget_oldest(
        self, masks: dict[int, int], limit: int, gpu_limit: int, hash_limit: int
    ) -> int:
        """Forget the oldest blocks (first stored first) until at most ``limit`` are
        held, ``gpu_limit`` on the GPU and ``hash_limit`` engine hashes known; returns
        how many held blocks went."""
        held, known = self.held, self.keys
        victims: list[int | bytes] = []
        excess, gpu_excess = len(held) - limit, self.resident - gpu_limit
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
                self.resident -= 1 if count & _FIELD else 0
        _kernels.clear_holder(masks, gone, self.bit)
        return len(gone)


class _Holders:
    """The index's state: the workers, their numbers (bits of the holder masks) and
    the masks, the keyings in use, and what was skipped (counted); and its plain reads
    (who holds what, how many copies, the turnover). `PrefixIndex` is this state, fed
    (`kvbus.routing.index_feed`) and queried (`kvbus.routing.index_match`)."""

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
        self._profiles = Profiles(block_size)
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
        self.clears = 0
        """Times a worker's blocks were forgotten whole (``AllBlocksCleared``, a
        `Resync`, a new epoch): a feeder compares it around ``apply``."""
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
        # Hybrid models (`kvbus.routing.index_window`): each worker's sliding-window and
        # mamba groups apart from its full-attention blocks, and the kind of its groups.
        from kvbus.routing.index_window import SPARSE_KINDS, SparseGroup

        self._sparse = {kind: SparseGroup(kind) for kind in SPARSE_KINDS}
        self._group_kinds: dict[str, dict[int, str]] = {}
        """worker -> its KV cache groups' kinds, as its stores name them"""
        self._deferred: list[tuple[str, str, object]] = []
        """A batch's sliding-window events, applied after its others (they are keyed as
        full-attention blocks the same batch may store after them)."""
        self.other_groups = 0
        """Blocks of groups neither full-attention, sliding-window nor mamba (chunked
        local attention) skipped, stored or removed."""
        self.awaited: dict[int, dict[int, Any]] = {}
        """worker number -> the keys a feeder waits to see it store, as the feeder keeps
        them (`kvbus.routing.in_flight.RequestsInFlight` shares its own)"""
        self.arrived: list[tuple[int, int]] = []
        """(worker number, key) of awaited stores applied since `take_arrived`: the
        feeder takes them after each item it applies"""

    @property
    def block_size(self) -> int | None:
        """Tokens per block of the fleet's keys (`keys`): the configured one, else the
        one most workers use (ties: the one seen first); ``None`` before any store."""
        return self._profiles.fleet[0]

    @property
    def lookahead(self) -> int:
        """Lookahead tokens of the fleet's keys: the one most workers of the fleet's
        block size use (ties: the one seen first)."""
        return self._profiles.fleet[1]

    def profiles(self) -> dict[tuple[int, int], int]:
        """Workers per (block size, lookahead) they key their blocks with."""
        return dict(self._profiles.counts)

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

    def hint_block_size(self, block_size: int) -> None:
        """An engine says its blocks hold ``block_size`` tokens: key prompts so until
        the first store (a configured block size, or any store, wins)."""
        self._profiles.hint(block_size)

    def worker_count(self) -> int:
        """Workers numbered so far (`worker_number`): numbers ``0..count-1``."""
        return len(self._names)

    def workers(self) -> list[str]:
        return list(self._workers)

    def take_arrived(self) -> list[tuple[int, int]]:
        """The awaited stores applied since the last call."""
        arrived, self.arrived = self.arrived, []
        return arrived

    def _note_arrivals(self, number: int, keys: list[int]) -> None:
        """Of ``keys`` just stored on worker ``number``, those awaited there: a feeder
        that assumed the blocks there learns that the engine's events caught up."""
        awaited = self.awaited.get(number)
        if awaited is not None and not awaited.keys().isdisjoint(keys):
            self.arrived.extend((number, key) for key in awaited.keys() & keys)

    def holds(self, worker: str, key: int) -> bool:
        state = self._workers.get(worker)
        return state is not None and key in state.held

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
