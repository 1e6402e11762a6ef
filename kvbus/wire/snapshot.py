"""Snapshots of the kv stream: what each engine's cache holds, so a consumer that starts
late (after retention trimmed the history, or after a gap) gets exact state back.

A `kvbus.ops.compact.Compactor` follows the stream and folds it per source the way
`kvbus.routing.index` does (residency is a count of copies per block and medium), and
every ``interval`` seconds stores, for each source whose state changed, a `Snapshot`:
the events that rebuild that state, with the exact cursor they stand for (epoch, seq,
position). After them it stores the subscription's cursor under the name ``_cursor``: a
consumer starts reading the stream there, after applying the snapshots (newer ones are
fine: what they already hold is dropped as duplicates).

A snapshot's events are vLLM's own: ``BlockStored`` of each chain of cached blocks,
parents before children, then the extra copies (a block cached twice stored again, the
chains of second copies merged as the chains of first ones are); a block whose parent
was evicted while it stays cached (vLLM does that) comes after a ``BlockStored`` of the
parent, removed again at the end, so any consumer of the kv stream applies a snapshot as
it applies a batch, with no code of its own. ``kvbus.subscribe(snapshot=True)`` does the
reading side.

Where a transport keeps them: memory:// in the process, redis:// in the hash
``kvbus:<stream>:snapshots``, nats:// in the object store ``KVBUS_SNAP_<stream>``;
zmq:// has no store (a compactor there says so and stops).

What a fold holds is bounded by the live state the source claims, whatever it sends: at
most ``max_copies`` copies of one block in one medium (`DEFAULT_MAX_COPIES`, 64: an
engine caches a block more than once only when requests race to compute it; stores past
that are not counted, as `kvbus.routing.index` saturates its own count, and are counted in
``SourceFold.capped_copies``), and at most ``max_blocks`` cached copies in all
(`DEFAULT_MAX_BLOCKS`, 2**20: more than the GPU and CPU tiers of one engine hold). A
source that claims more than ``max_blocks`` is no engine's state: its fold is dropped
(``SourceFold.overflowed``) and it gets no snapshot until an ``AllBlocksCleared`` or a
new epoch makes its state known again. So a snapshot's size, and a compactor's memory,
are bounded by the live state, never by all that a source ever sent.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from kvbus.wire.envelope import Kind, decode_envelope, nesting_is_malformed
from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    SourceStarted,
    decode_control,
    decode_kv_batch,
    encode,
)

CURSOR_NAME: Final = "_cursor"
DEFAULT_MAX_COPIES: Final = 64
"""Copies of one block (in one medium and KV cache group) a fold counts."""
DEFAULT_MAX_BLOCKS: Final = 1 << 20
"""Cached copies of blocks, in all, a fold holds for one source before it calls the
source's state unknown (see the module's docstring)."""
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
    """One source's cache as its events leave it: for each cached block, the event that
    stored it (and its place in it) and how many copies are cached; the same for blocks
    evicted recently (a cached child may still name one as its parent). No per-block
    object is made until a snapshot is taken: folding costs a tuple per block.

    At most ``max_copies`` copies of a block are counted (the rest in
    ``capped_copies``) and ``max_blocks`` copies in all: a source that claims more is
    dropped (``overflowed``: held no more, and no snapshot) until it clears its cache."""

    def __init__(
        self, max_copies: int = DEFAULT_MAX_COPIES, max_blocks: int = DEFAULT_MAX_BLOCKS
    ) -> None:
        if max_copies < 1 or max_blocks < 1:
            raise ValueError("max_copies and max_blocks must be positive")
        self.max_copies = max_copies
        self.max_blocks = max_blocks
        self.held: dict[BlockKey, tuple[BlockStored, int, int]] = {}
        """key -> (event, index of the block in it, copies cached)"""
        self.evicted: OrderedDict[BlockKey, tuple[BlockStored, int]] = OrderedDict()
        self.copies = 0
        """Copies held, in all (``held``'s counts summed)."""
        self.capped_copies = 0
        """Stores of a block already held ``max_copies`` times: not counted."""
        self.overflowed = False
        """The source claimed more than ``max_blocks`` copies: its state is unknown (and
        nothing of it held) until an ``AllBlocksCleared``."""

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._clear()
                self.overflowed = False  # an empty cache is known state again
            elif self.overflowed:
                continue
            elif isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._removed((block_hash, event.medium, event.group_idx))

    def _clear(self) -> None:
        self.held.clear()
        self.evicted.clear()
        self.copies = 0

    def _stored(self, event: BlockStored) -> None:
        if event.block_size < 1 and not _tokenless(event):
            return
        held, evicted, medium, group = self.held, self.evicted, event.medium, event.group_idx
        for i, block_hash in enumerate(event.block_hashes):
            key = (block_hash, medium, group)
            found = held.get(key)
            copies = 1 if found is None else found[2] + 1
            if copies > self.max_copies:
                self.capped_copies += 1
                copies = self.max_copies
            else:
                self.copies += 1
                if self.copies > self.max_blocks:
                    self.overflowed = True
                    self._clear()  # what is left is no engine's state: hold none of it
                    return
            held[key] = (event, i, copies)
            if evicted:
                evicted.pop(key, None)

    def _removed(self, key: BlockKey) -> None:
        found = self.held.get(key)
        if found is None:
            return
        event, index, copies = found
        self.copies -= 1
        if copies > 1:
            self.held[key] = (event, index, copies - 1)
            return
        del self.held[key]
        self.evicted[key] = (event, index)
        while len(self.evicted) > max(_MIN_REMEMBERED, len(self.held)):
            self.evicted.popitem(last=False)

    def copy(self) -> SourceFold:
        """A copy that later events to this fold leave as it is (the events it refers
        to are never changed): a snapshot can be taken of it without a lock."""
        twin = SourceFold(self.max_copies, self.max_blocks)
        twin.held, twin.evicted = dict(self.held), OrderedDict(self.evicted)
        twin.copies, twin.capped_copies = self.copies, self.capped_copies
        twin.overflowed = self.overflowed
        return twin

    def _stored_by(self, key: BlockKey) -> tuple[BlockStored, int]:
        found = self.held.get(key)
        return (found[0], found[1]) if found is not None else self.evicted[key]

    def events(self) -> list[KVEvent]:
        """Events that rebuild this state from nothing: every cached block, parents
        first; an evicted parent of a cached block (vLLM evicts a parent and keeps its
        child) is stored before its child and removed again at the end, so that a
        consumer chains the child as the live one did. (vLLM names as the parent of a
        block it stores a block cached at that moment, so evicted blocks no cached one
        descends from are not needed.)"""
        out: list[KVEvent] = []
        extra: list[tuple[BlockStored, int]] = []  # (a block's event, copies beyond one)
        copied: list[BlockStored] = []  # tokenless copies, one event per copy
        ghosts: list[BlockKey] = []
        emitted: set[BlockKey] = set()
        by_hash: dict[tuple[int | bytes, int | None], BlockKey] = {}
        for key in [*self.evicted, *self.held]:
            if not _tokenless(self._stored_by(key)[0]):
                by_hash[(key[0], key[2])] = key
        for key in self.held:
            # Walk up to the first ancestor already emitted (or unknown), then down. A
            # tokenless copy (offloaded, named by hash only) comes after the block it
            # copies, stored for it (and removed at the end) if no longer cached.
            chain: list[BlockKey] = []
            on_chain: set[BlockKey] = set()  # forged parents can make a cycle
            at: BlockKey | None = key
            while at is not None and at not in emitted and at not in on_chain:
                chain.append(at)
                on_chain.add(at)
                event, index = self._stored_by(at)
                if _tokenless(event):
                    at = by_hash.get((at[0], at[2]))
                    continue
                parent = event.block_hashes[index - 1] if index else event.parent_block_hash
                at = None if parent is None else by_hash.get((parent, at[2]))
            for link in reversed(chain):
                emitted.add(link)
                event, index = self._stored_by(link)
                one = _one_block(event, index)
                if link not in self.held:
                    out.append(one)
                    ghosts.append(link)
                elif _tokenless(event):
                    copied.extend([one] * self.held[link][2])
                else:
                    out.append(one)
                    if self.held[link][2] > 1:
                        extra.append((one, self.held[link][2] - 1))
        # Extra copies after every first one, a layer per copy: each layer keeps the
        # chains' order, so its runs merge into one event each, as the first layer's do.
        # Then the tokenless copies (their blocks all stored by then), one event a kind.
        layers: list[list[BlockStored]] = []
        for one, more in extra:
            layers.extend([] for _ in range(more - len(layers)))
            for layer in layers[:more]:
                layer.append(one)
        out.extend(itertools.chain.from_iterable(layers))
        copied.sort(key=lambda e: (e.medium or "", e.group_idx or 0))
        out.extend(copied)
        out = _merge_chains(out)
        for (medium, group), keys in itertools.groupby(ghosts, key=lambda k: (k[1], k[2])):
            out.append(BlockRemoved([k[0] for k in keys], medium, group))
        return out


def _one_block(event: BlockStored, i: int) -> BlockStored:
    """Block ``i`` of ``event`` as an event of its own."""
    size = event.block_size
    parent = event.block_hashes[i - 1] if i else event.parent_block_hash
    return msgspec.structs.replace(
        event,
        block_hashes=[event.block_hashes[i]],
        parent_block_hash=None if _tokenless(event) else parent,
        token_ids=event.token_ids[i * size : (i + 1) * size],
        extra_keys=[event.extra_keys[i]] if event.extra_keys else event.extra_keys,
        lookahead_token_ids=[event.lookahead_token_ids[i]]
        if event.lookahead_token_ids
        else event.lookahead_token_ids,
    )


def _tokenless(event: BlockStored) -> bool:
    """An offloading connector's store that names blocks by hash only (vLLM's default
    for CPU/STORAGE tiers): a copy of blocks stored with their tokens before."""
    return event.block_size == 0 and not event.token_ids and event.medium in ("CPU", "STORAGE")


def _merge_chains(events: list[KVEvent]) -> list[KVEvent]:
    """Runs of single-block events that chain (each the parent of the next) and differ
    in nothing else, as one event each, the way the engine sent them: a consumer then
    applies a snapshot at the speed of live batches. Tokenless copies (named by hash
    only, in no chain) of one kind run together the same way."""
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
            (event.parent_block_hash == run[-1].block_hashes[0] or _tokenless(event))
            and _same_kind(event, run[-1])
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


class _Published:
    __slots__ = ("epoch", "exact", "fold", "position", "seq")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.seq = 0
        self.position: int | str | None = None
        self.fold = SourceFold()
        self.exact = True


class PublishedFolds:
    """Snapshots of what one process publishes on one stream, for a transport with no
    server to keep them (zmq://): the publishing process folds its own kv envelopes as it
    appends them (one decode per batch, in the sender's thread, never the engine's) and
    serves the result. Its own stream has no gaps; a batch it dropped (``lost_from``)
    makes that source inexact, and unserved, until its next epoch.

    Taking the snapshots costs time in the size of the folds, so whoever serves them to
    peers keeps the result and takes them again only once `due` (the folds changed by
    as many blocks as they hold): what a peer's request costs is then paid for by the
    publishing, a constant factor on top of folding, however often peers ask."""

    def __init__(self) -> None:
        self._sources: dict[str, _Published] = {}
        self._position: int | str | None = None
        self.work = 0
        """Blocks (and messages) folded so far: what taking the snapshots is paid by."""

    def add(self, position: int | str, data: bytes) -> None:
        self._position = position
        self.work += 1
        try:
            envelope = decode_envelope(data)
            if envelope.kind == Kind.CONTROL:
                body: object = decode_control(envelope.payload)
            elif envelope.kind == Kind.KV:
                body, _ = decode_kv_batch(envelope.payload)
            else:
                return
        except (msgspec.DecodeError, ValueError):
            return  # its own bytes: only a newer kvbus writes what this one cannot read
        state = self._sources.get(envelope.source)
        if state is None or envelope.epoch != state.epoch or isinstance(body, SourceStarted):
            state = self._sources[envelope.source] = _Published(envelope.epoch)
            state.exact = isinstance(body, SourceStarted) or envelope.seq == 1
        if envelope.lost_from:
            state.exact = False
        state.seq, state.position = envelope.seq, position
        if isinstance(body, KVEventBatch):
            state.fold.apply(body.events)
            self.work += sum(len(getattr(e, "block_hashes", ())) for e in body.events)

    def due(self, taken_at_work: int) -> bool:
        """Whether snapshots taken when `work` was ``taken_at_work`` are to be taken
        again: the folds changed since by at least as many blocks as they hold now."""
        held = sum(len(p.fold.held) + len(p.fold.evicted) for p in self._sources.values())
        return self.work - taken_at_work >= max(1, held)

    @property
    def position(self) -> int | str | None:
        """The position of the newest envelope folded (the snapshots' cursor)."""
        return self._position

    def copy(self) -> PublishedFolds:
        """The folds as they are now, untouched by later additions: its `snapshots` can
        be taken outside the lock that guards this one."""
        twin = PublishedFolds()
        twin._position, twin.work = self._position, self.work
        for source, state in self._sources.items():
            mine = twin._sources[source] = _Published(state.epoch)
            mine.seq, mine.position, mine.exact = state.seq, state.position, state.exact
            mine.exact = state.exact and not state.fold.overflowed
            if mine.exact:
                mine.fold = state.fold.copy()
        return twin

    def snapshots(self) -> dict[str, bytes]:
        """Every exact source's snapshot, and the cursor (``_cursor``) they stand for."""
        now = time.time()
        found = {}
        for source, state in self._sources.items():
            if state.exact and not state.fold.overflowed:
                batch = encode(KVEventBatch(now, state.fold.events()))
                snapshot = Snapshot(source, state.epoch, state.seq, state.position, now, batch)
                found[source] = encode_snapshot(snapshot)
        sources = {s: [p.epoch, p.seq, p.position] for s, p in self._sources.items()}
        found[CURSOR_NAME] = msgspec.json.encode({"position": self._position, "sources": sources})
        return found


__all__ = [
    "CURSOR_NAME",
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_COPIES",
    "PublishedFolds",
    "Snapshot",
    "SourceFold",
    "decode_snapshot",
    "encode_snapshot",
]
