"""Snapshots of the kv stream: what each engine's cache holds, so a consumer that starts
late (after retention trimmed the history, or after a gap) gets exact state back.

A `kvbus.compact.Compactor` follows the stream and folds it per source the way `kvbus.index` does
(residency is a count of copies per block and medium), and every ``interval`` seconds
stores, for each source whose state changed, a `Snapshot`: the events that rebuild that
state, with the exact cursor they stand for (epoch, seq, position). After them it
stores the subscription's cursor under the name ``_cursor``: a consumer starts reading
the stream there, after applying the snapshots (newer ones are fine: what they already
hold is dropped as duplicates).

A snapshot's events are vLLM's own: ``BlockStored`` of each chain of cached blocks (one
per extra copy), parents before children; a block whose parent was evicted while it
stays cached (vLLM does that) comes after a ``BlockStored`` of the parent, removed again
at the end, so any consumer of the kv stream applies a snapshot as it applies a batch,
with no code of its
own. ``kvbus.subscribe(snapshot=True)`` does the reading side.

Where a transport keeps them: memory:// in the process, redis:// in the hash
``kvbus:<stream>:snapshots``, nats:// in the object store ``KVBUS_SNAP_<stream>``;
zmq:// has no store (a compactor there says so and stops).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from kvbus.envelope import nesting_is_malformed
from kvbus.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

CURSOR_NAME: Final = "_cursor"
_MIN_REMEMBERED: Final = 1024


class Snapshot(msgspec.Struct, array_like=True, gc=False):
    """One source's state at (epoch, seq): ``payload`` is a vLLM ``KVEventBatch``."""

    source: str
    epoch: int
    seq: int
    position: int | str | None
    ts: float
    payload: bytes


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _encoder.encode(snapshot)


@nesting_is_malformed
def decode_snapshot(data: bytes) -> Snapshot:
    return _decoder.decode(data)


BlockKey = tuple[int | bytes, str | None, int | None]
"""(engine block hash, medium, KV cache group): what a BlockRemoved names."""


class SourceFold:
    """One source's cache as its events leave it: each cached block's own event and how
    many copies of it are cached, and the events of blocks evicted recently (a cached
    child may still name one as its parent)."""

    def __init__(self) -> None:
        self.held: dict[BlockKey, tuple[BlockStored, int]] = {}
        self.evicted: OrderedDict[BlockKey, BlockStored] = OrderedDict()

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._removed((block_hash, event.medium, event.group_idx))
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.evicted.clear()

    def _stored(self, event: BlockStored) -> None:
        size = event.block_size
        if size < 1:
            return
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            key = (block_hash, event.medium, event.group_idx)
            one = msgspec.structs.replace(
                event,
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=event.token_ids[i * size : (i + 1) * size],
                extra_keys=[event.extra_keys[i]] if event.extra_keys else event.extra_keys,
                lookahead_token_ids=[event.lookahead_token_ids[i]]
                if event.lookahead_token_ids
                else event.lookahead_token_ids,
            )
            _, copies = self.held.get(key, (one, 0))
            self.held[key] = (one, copies + 1)
            self.evicted.pop(key, None)
            parent = block_hash

    def _removed(self, key: BlockKey) -> None:
        found = self.held.get(key)
        if found is None:
            return
        event, copies = found
        if copies > 1:
            self.held[key] = (event, copies - 1)
            return
        del self.held[key]
        self.evicted[key] = event
        while len(self.evicted) > max(_MIN_REMEMBERED, len(self.held)):
            self.evicted.popitem(last=False)

    def events(self) -> list[KVEvent]:
        """Events that rebuild this state from nothing: every cached block, parents
        first; an evicted parent of a cached block (vLLM evicts a parent and keeps its
        child) is stored before its child and removed again at the end, so that a
        consumer chains the child as the live one did. (vLLM names as the parent of a
        block it stores a block cached at that moment, so evicted blocks no cached one
        descends from are not needed.)"""
        out: list[KVEvent] = []
        ghosts: list[BlockKey] = []
        emitted: set[BlockKey] = set()
        by_hash: dict[tuple[int | bytes, int | None], BlockKey] = {}
        for key in [*self.evicted, *self.held]:
            by_hash[(key[0], key[2])] = key
        for key in self.held:
            # Walk up to the first ancestor already emitted (or unknown), then down.
            chain: list[BlockKey] = []
            on_chain: set[BlockKey] = set()  # forged parents can make a cycle
            at: BlockKey | None = key
            while at is not None and at not in emitted and at not in on_chain:
                chain.append(at)
                on_chain.add(at)
                event = self.held[at][0] if at in self.held else self.evicted[at]
                parent = event.parent_block_hash
                at = None if parent is None else by_hash.get((parent, at[2]))
            for link in reversed(chain):
                emitted.add(link)
                if link in self.held:
                    event, copies = self.held[link]
                    out.extend([event] * copies)
                else:
                    out.append(self.evicted[link])
                    ghosts.append(link)
        out = _merge_chains(out)
        for (medium, group), keys in itertools.groupby(ghosts, key=lambda k: (k[1], k[2])):
            out.append(BlockRemoved([k[0] for k in keys], medium, group))
        return out


def _merge_chains(events: list[KVEvent]) -> list[KVEvent]:
    """Runs of single-block events that chain (each the parent of the next) and differ
    in nothing else, as one event each, the way the engine sent them: a consumer then
    applies a snapshot at the speed of live batches."""
    merged: list[KVEvent] = []
    run: list[BlockStored] = []

    def flush() -> None:
        if len(run) == 1:
            merged.append(run[0])
        elif run:
            first = run[0]
            merged.append(
                msgspec.structs.replace(
                    first,
                    block_hashes=[e.block_hashes[0] for e in run],
                    token_ids=[t for e in run for t in e.token_ids],
                    extra_keys=_joined([e.extra_keys for e in run]),
                    lookahead_token_ids=_joined([e.lookahead_token_ids for e in run]),
                )
            )
        run.clear()

    for event in events:
        if not isinstance(event, BlockStored):
            flush()
            merged.append(event)
            continue
        if run and not (
            event.parent_block_hash == run[-1].block_hashes[0] and _same_kind(event, run[-1])
        ):
            flush()
        run.append(event)
    flush()
    return merged


def _same_kind(a: BlockStored, b: BlockStored) -> bool:
    return (a.block_size, a.lora_id, a.medium, a.lora_name, a.group_idx, a.kv_cache_spec_kind,
            a.kv_cache_spec_sliding_window, a.locality, a.ownership, a.session_id) == (
        b.block_size, b.lora_id, b.medium, b.lora_name, b.group_idx, b.kv_cache_spec_kind,
        b.kv_cache_spec_sliding_window, b.locality, b.ownership, b.session_id)  # fmt: skip


def _joined(parts: list[Any]) -> Any:
    """Per-block lists of a run joined, or None when no block had one."""
    if all(p is None for p in parts):
        return None
    return [item for p in parts for item in (p if p is not None else [None])]


__all__ = [
    "CURSOR_NAME",
    "Snapshot",
    "SourceFold",
    "decode_snapshot",
    "encode_snapshot",
]
