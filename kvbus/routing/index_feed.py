"""Feeding the prefix index: kv messages (or a batch's wire bytes) applied to the holders.

A ``BlockStored`` is keyed (`kvbus.routing.index_keys`) and each block gets one more copy on its
worker; a ``BlockRemoved`` takes one off; ``AllBlocksCleared``, a `Resync` and a new
epoch clear that worker. The usual store and eviction go whole through one native loop
(`kernels.store_new`, `kernels.drop_only_copies`); anything else block by block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Final

from kvbus.bus.subscription import Message, Resync
from kvbus.logs import LimitedLog, shown
from kvbus.routing import _kernels
from kvbus.routing.index_holders import (
    _MIN_REMEMBERED,
    CAPACITY_HEADROOM,
    MEDIUM_SHIFTS,
    _Worker,
)
from kvbus.routing.index_keys import ROOT, keys_of
from kvbus.routing.index_window import SPARSE_KINDS, _Windows
from kvbus.routing.kernels import kernels as kernels  # switched by kvbus.routing.index.use_kernels
from kvbus.wire.envelope import Kind
from kvbus.wire.events import (
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

log = logging.getLogger("kvbus.routing.index")
_limited = LimitedLog(log)

_OFF_GPU: Final = ("CPU", "STORAGE")
_FULL_ATTENTION: Final = {None, "full_attention", "mla_attention", "sink_full_attention"}
MAX_BLOCK_SIZE: Final = 1 << 20
"""Larger (or non-positive) block sizes in an event are malformed; vLLM's are <= 4096."""


class _Feeding(_Windows):
    """`PrefixIndex`'s feeding side: every method that changes what the index holds."""

    def set_capacity(self, worker: str, kv_cache_blocks: int) -> None:
        """The worker's advertised KV cache (``LoadMetrics.kv_cache_blocks``): it may
        hold `CAPACITY_HEADROOM` times as many distinct GPU blocks here, no more."""
        number = self.worker_number(worker)
        self._capacity[number] = max(0, min(kv_cache_blocks, self.max_blocks_per_worker))

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
                self.clear(worker, same_model=True)  # AllBlocksCleared
        if self._deferred:
            self._apply_deferred()
        return True

    def apply_events(self, worker: str, events: Iterable[Any]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear(worker, same_model=True)
        if self._deferred:
            self._apply_deferred()

    def clear(self, worker: str, same_model: bool = False) -> None:
        """Forget everything ``worker`` held (it restarted, or its events were lost).
        ``same_model``: its engine only emptied its cache (``AllBlocksCleared``), so
        what was learned of its model's cache groups still holds: a request routed
        before its next stores is still cut to what a hybrid model can reuse."""
        self.clears += 1
        if worker in self._numbers:
            self._window_clear(worker, self._numbers[worker], same_model)
        state = self._workers.pop(worker, None)
        if state is None:
            return
        self._profiles.join(state.profile, -1)
        _kernels.clear_holder(self._masks, state.held, state.bit)

    # --- stores ----------------------------------------------------------------------

    def _worker(self, worker: str, block_size: int) -> _Worker | None:
        """``worker``'s state, made with ``block_size`` on first sight (None: that would
        add a profile past `MAX_PROFILES`)."""
        state = self._workers.get(worker)
        if state is None:
            state = _Worker(self.worker_number(worker), block_size)
            if not self._profiles.admits(state.profile):
                return None
            self._workers[worker] = state
            self._profiles.join(state.profile, 1)
        return state

    def _stored(self, worker: str, event: BlockStored, data: bytes | None = None) -> None:
        """Apply a store; ``data``: its token ids already as `kernels.token_bytes`.
        Nothing is counted or learned from it before its keys are made: an event that
        fails is skipped whole (counted in ``malformed``)."""
        kind = event.kv_cache_spec_kind
        if kind not in _FULL_ATTENTION:
            self._learn_group(worker, event.group_idx, kind)
            if kind in SPARSE_KINDS:
                self._defer(worker, kind, event)  # after the batch's full-attention blocks
            else:
                self.other_groups += len(event.block_hashes)
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
        parent = ROOT
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
                keys = keys_of(
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
                if not self._profiles.admits((state.block_size, ahead)):
                    self.profile_refused += len(hashes)
                    return
                self._profiles.join(state.profile, -1)
                state.lookahead = ahead
                self._profiles.join(state.profile, 1)
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
            state.add_copies(self._masks, keys, shift)
        if self.awaited:  # some request lingers (`RequestsInFlight.stored`): here?
            self._note_arrivals(state.number, keys)
        self._cap(worker, state)

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
        state.add_copies(self._masks, known, MEDIUM_SHIFTS[event.medium])
        self._cap(worker, state)

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
        gpu_limit -= gpu_limit >> 3
        gone = state.forget_oldest(
            self._masks, limit - (limit >> 3), gpu_limit, hash_limit - (hash_limit >> 3)
        )
        self.over_cap += gone
        _limited.warning(
            "over_cap",
            "kvbus: worker %s held more blocks than its cap (%d; GPU %d): forgot its %d oldest",
            shown(worker),
            self.max_blocks_per_worker,
            gpu_limit,
            gone,
        )

    # --- removals --------------------------------------------------------------------

    def _removed(self, worker: str, event: BlockRemoved) -> None:
        kind = self._group_kind(worker, event.group_idx)
        if kind is not None:  # not the full-attention copies of the same engine hashes
            if kind in SPARSE_KINDS:
                self._defer(worker, kind, event)
            else:
                self.other_groups += len(event.block_hashes)
            return
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
            state.forget(hashes)
        else:
            keys = list(map(state.keys.get, hashes))
            last, unknown = state.remove_copies(self._masks, hashes, keys, shift)
            self.unknown_removals += unknown
            state.forget(last)
