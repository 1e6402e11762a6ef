"""The per-item loops of `PrefixIndex`, in Python: the reference for
``kvbus/routing/_ckernels.c`` (built at install where a C compiler is found) and
the fallback where it is not, or where ``KVBUS_PURE_PYTHON=1`` (`kvbus.routing.kernels` picks).
The index's take and change its own dicts, with the same results
(tests/test_index_kernels.py checks the two against each other)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Final, cast

import msgspec

_token_ids: msgspec.msgpack.Decoder[list[int]] = msgspec.msgpack.Decoder(list[int])


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as native uint32 (OverflowError for one below 0 or past 32 bits)."""
    return array("I", token_ids).tobytes()


def packed_token_bytes(packed: bytes | msgspec.Raw) -> bytes:
    """The token ids in ``packed``, a msgpack array of ints (an event's ``token_ids`` as
    sent: ``msgspec.Raw``), as native uint32: ValueError (msgspec's) when it is not
    exactly that, else OverflowError for an id below 0 or past 32 bits."""
    return token_bytes(_token_ids.decode(packed))


KEY_PERSON: Final = b"kvbus.key.v1"
"""BLAKE2b's personalization for router keys: a new scheme gets a new one, so keys of
two schemes never meet."""
_KEY_HASH: Final = hashlib.blake2b(digest_size=8, person=KEY_PERSON)


def block_key(parent: int, block: bytes) -> int:
    """A router key: the 64-bit BLAKE2b (`KEY_PERSON`, no key) of ``parent`` (a key, as
    8 little-endian bytes; 0 for the first block) then ``block``, read as a signed
    little-endian int. The same in every process and on every machine, as a key shared
    between router replicas must be (Python's own ``hash`` is seeded per process)."""
    digest = _KEY_HASH.copy()
    digest.update(int.to_bytes(parent, 8, "little", signed=True) + block)
    return int.from_bytes(digest.digest(), "little", signed=True)


def chain(data: bytes, step: int, parent: int) -> list[int]:
    """The key of each full ``step``-byte block of ``data``, chained from ``parent``:
    `block_key` of (the key before it, the block's bytes), with nothing else (no LoRA,
    no extra keys) hashed in. OverflowError for a parent outside 64 signed bits."""
    if step <= 0:
        raise ValueError("chain: step must be positive")
    int.to_bytes(parent, 8, "little", signed=True)  # checked even when no block is full
    return [
        parent := block_key(parent, data[start : start + step])
        for start in range(0, len(data) - step + 1, step)
    ]


def store_new(
    known: dict[int | bytes, int],
    held: dict[int, int],
    masks: dict[int, int],
    hashes: Sequence[int | bytes],
    keys: Sequence[int],
    bit: int,
    unit: int,
) -> bool:
    """``known[hash] = key`` for each pair (``keys`` no longer than ``hashes``); then,
    when every key is distinct and new to ``held`` (an event's blocks nearly always
    are): one copy (``unit``) of each in ``held``, ``bit`` in each one's mask, and
    True. Otherwise False with ``held`` and ``masks`` untouched (the caller counts the
    copies block by block)."""
    if len(keys) > len(hashes):
        raise ValueError("store_new: more keys than hashes")
    known.update(zip(hashes, keys, strict=False))
    fresh = dict.fromkeys(keys, unit)
    if len(fresh) != len(keys) or not held.keys().isdisjoint(fresh):
        return False
    held.update(fresh)
    for key in keys:  # faster than a comprehension and an update
        masks[key] = masks.get(key, 0) | bit
    return True


def drop_only_copies(
    known: dict[int | bytes, int],
    held: dict[int, int],
    masks: dict[int, int],
    hashes: Sequence[int | bytes],
    bit: int,
    unit: int,
) -> bool:
    """When every hash is known, distinct, and its block's count in ``held`` is exactly
    ``unit`` (the worker's only copy, in that medium: the usual eviction): the blocks
    leave ``held``, ``bit`` leaves their masks, and True. Otherwise False, nothing
    changed."""
    # An unknown hash's key is None, whose count (None) is not ``unit``.
    keys = cast(list[int], list(map(known.get, hashes)))
    if not (list(map(held.get, keys)).count(unit) == len(keys) == len(set(keys))):
        return False
    for key in keys:
        del held[key]
    clear_holder(masks, keys, bit)
    return True


def clear_holder(masks: dict[int, int], keys: Iterable[int], bit: int) -> None:
    """``bit`` out of the mask of each of ``keys``; a mask left empty goes. (Not a
    kernel of its own: a worker's clear and its rarer removals call it.)"""
    clear = ~bit
    for key in keys:
        mask = masks.get(key, 0) & clear
        if mask:
            masks[key] = mask
        else:
            masks.pop(key, None)
