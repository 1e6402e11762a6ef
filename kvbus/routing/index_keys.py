"""Router keys: how a prompt's tokens and an engine's blocks become stable keys.

A block's key is a BLAKE2b chained over its parent's key and its token ids (and its
LoRA, extra keys and lookahead tokens), so keys never depend on the engine's hash seed
or algorithm and are the same in every process. Which (block size, lookahead) pairs the
workers key their blocks with is `Profiles`: a prompt is keyed once per pair in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from kvbus.routing import _kernels
from kvbus.routing.kernels import kernels as kernels  # switched by kvbus.routing.index.use_kernels

ROOT: Final = 0
"""The parent key of a prompt's first block."""
MAX_PROFILES: Final = 8
"""Distinct (block size, lookahead) pairs among the workers; a worker whose events would
add another is skipped (`PrefixIndex.profile_refused`), as a query keys the prompt once
per pair."""


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    parent: int = ROOT,
    lookahead: int | Sequence[Sequence[int]] = 0,
) -> list[int]:
    """Router keys of the full blocks of ``token_ids``, chained from ``parent``.

    Each key is a 64-bit BLAKE2b of the parent key and the block's token bytes, and
    for a block with any, of `block_salt`'s canonical bytes of its LoRA, extra keys and
    lookahead tokens (`kvbus.routing._kernels.block_key`): independent of the engine's seed and
    algorithm, and the same in every process, so router replicas can share them (token
    ids hash as `kernels.token_bytes` writes them: native uint32, little-endian on every
    platform vLLM runs on).
    ``extra_keys`` hold any msgpack value (a list or map inside included).
    ``lookahead`` is either how many tokens after each block went into its hash (a
    prompt: a block without that many tokens after it gets no key, as the engine does
    not cache it) or those tokens per block (a ``BlockStored``).
    """
    data = kernels.token_bytes(token_ids)
    return keys_of(data, block_size, lora_name, extra_keys, parent, lookahead)


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


def keys_of(
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


def prompt_keyings(
    token_ids: Sequence[int],
    profiles: Sequence[tuple[int, int]],
    lora_name: str | None,
    extra_keys: Sequence[Any] | None,
) -> list[tuple[tuple[int, int], list[int]]]:
    """The prompt's keys under each of ``profiles`` ((block size, lookahead) pairs),
    its tokens converted once."""
    data = kernels.token_bytes(token_ids)
    return [(p, keys_of(data, p[0], lora_name, extra_keys, ROOT, p[1])) for p in profiles]


class Profiles:
    """Workers per (block size, lookahead) they key their blocks with, in order of first
    sight, and the fleet's pair: the one most workers share keys `PrefixIndex.keys` (one
    worker's odd events blind only itself)."""

    __slots__ = ("configured_block_size", "counts", "fleet", "in_query_order")

    def __init__(self, configured_block_size: int | None) -> None:
        self.configured_block_size = configured_block_size
        self.counts: dict[tuple[int, int], int] = {}
        self.fleet: tuple[int | None, int] = (configured_block_size, 0)
        """(block size, lookahead) of the fleet's keys: the configured block size, else
        the one most workers use (ties: the one seen first); the lookahead most workers
        of that size use. ``None``: no store yet."""
        self.in_query_order: list[tuple[int, int]] = self._query_order()
        """The pairs a prompt is keyed with, the fleet's first (at most `MAX_PROFILES`):
        a worker's blocks are keyed with its own pair only, so the keys of one pair find
        no other's workers."""

    def hint(self, block_size: int) -> None:
        """Key prompts with ``block_size`` until a store says how the fleet keys (an
        engine's load record names its block size before its first event)."""
        if self.configured_block_size is None and not self.counts and self.fleet[0] is None:
            self.fleet = (block_size, 0)
            self.in_query_order = self._query_order()

    def admits(self, profile: tuple[int, int]) -> bool:
        return profile in self.counts or len(self.counts) < MAX_PROFILES

    def join(self, profile: tuple[int, int], delta: int) -> None:
        """One worker more (``delta`` 1) or less (-1) keys with ``profile``."""
        count = self.counts.get(profile, 0) + delta
        if count > 0:
            self.counts[profile] = count
        else:
            self.counts.pop(profile, None)
        if self.counts:  # else the last worker left: keep keying as before
            sizes: dict[int, int] = {}
            for (size, _), workers in self.counts.items():
                sizes[size] = sizes.get(size, 0) + workers
            block_size = self.configured_block_size or max(sizes, key=sizes.__getitem__)
            of_size = [(ahead, n) for (size, ahead), n in self.counts.items() if size == block_size]
            lookahead = max(of_size, key=lambda an: an[1])[0] if of_size else 0
            self.fleet = (block_size, lookahead)
        self.in_query_order = self._query_order()

    def _query_order(self) -> list[tuple[int, int]]:
        fleet_size, fleet_lookahead = self.fleet
        order = [p for p in self.counts if p != self.fleet]
        if fleet_size is not None:
            order.insert(0, (fleet_size, fleet_lookahead))
        return order
