"""Fuzz the C kernels (a build of kvbus/routing/_ckernels.c, normally under AddressSanitizer and
UBSan: scripts/sanitize.sh) against their Python reference (kvbus/routing/_kernels.py), for a
fixed time. Every entry point that reads bytes or values from the network is fed
valid batches as kvbus and vLLM write them, mutated (bytes flipped, cut,
appended, spliced, length headers forged with boundary values, nested deep, ints
re-encoded wider), and random msgpack:

* ``packed_token_bytes``, ``token_bytes``, ``chain``, ``store_new``,
  ``drop_only_copies``: the same results (or exception types) and state as Python's,
  and a whole `PrefixIndex` fed the same payloads ends the same on both.

Usage: python scripts/fuzz_kernels_sanitize.py --module PATH.so [--seconds S] [--seed N].
Exits 1 at the first disagreement (printing the input), 0 when the time is up.
"""

from __future__ import annotations

import argparse
import copy
import importlib.machinery
import importlib.util
import random
import struct
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec

import kvbus
import kvbus.routing.index
from kvbus.routing import _kernels
from kvbus.routing.index import PrefixIndex
from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_packed_kv_batch,
    encode,
)

_pack = msgspec.msgpack.encode
EPOCH = 1_700_000_000_000_000_000


class Disagreement(Exception):
    pass


def load(path: str) -> ModuleType:
    """The kernels built at ``path`` (its init is ``PyInit__ckernels``), as a module of
    their own: the installed ``kvbus.routing._ckernels`` is left alone."""
    loader = importlib.machinery.ExtensionFileLoader("_ckernels", path)
    spec = importlib.util.spec_from_file_location("_ckernels", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# --- inputs ----------------------------------------------------------------------------

BOUNDARY_COUNTS = [0, 1, 15, 16, 31, 32, 127, 128, 255, 256, 0xFFFF, 0x10000, 2**31 - 1,
                   2**31, 2**32 - 1]  # fmt: skip
# msgpack headers that carry a length, with the width of the length after them
LENGTH_HEADERS = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xDC: 2, 0xDD: 4,
                  0xDE: 2, 0xDF: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}  # fmt: skip


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 4 or roll < 0.55:
        return rng.choice([
            None, True, False, rng.randint(-(2**63), 2**64 - 1), rng.randint(-40, 300),
            rng.random() * 10**rng.randint(-5, 30), "x" * rng.randint(0, 40),
            bytes(rng.randint(0, 300)), msgspec.msgpack.Ext(rng.randint(-128, 127), b"ab"),
            rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"]),
        ])  # fmt: skip
    if roll < 0.85:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 12))]
    return {str(rng.randint(0, 9)): random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def kv_events(rng: random.Random) -> list[Any]:
    events: list[Any] = []
    for _ in range(rng.randint(0, 6)):
        roll = rng.random()
        blocks = rng.randint(1, 20)
        size = rng.choice([1, 4, 16])
        first = rng.randint(0, 50)
        hashes: list[Any] = list(range(first, first + blocks))
        if rng.random() < 0.2:
            hashes = [h.to_bytes(32, "big") for h in hashes]
        medium = rng.choice(["GPU", "CPU", None])
        if roll < 0.6:
            tokens = [rng.choice([0, 127, 128, 65535, 65536, 2**32 - 1, rng.randint(0, 99)])
                      for _ in range(blocks * size)]  # fmt: skip
            parent = None if rng.random() < 0.5 else first - 1
            extra = [[rng.randint(0, 5)] for _ in range(blocks)] if rng.random() < 0.1 else None
            events.append(BlockStored(hashes, parent, tokens, size, None, medium, None,
                                      extra_keys=extra))  # fmt: skip
        elif roll < 0.7:
            events.append(BlockStored(hashes, None, [], 0, None, "CPU", None))  # tokenless
        elif roll < 0.9:
            events.append(BlockRemoved(hashes, medium))
        else:
            events.append(AllBlocksCleared())
    return events


def payload(rng: random.Random) -> bytes:
    """A KV batch as kvbus writes it, as vLLM's older dialect does, or made up."""
    roll = rng.random()
    if roll < 0.7:
        return encode(KVEventBatch(rng.random() * 2e9, kv_events(rng)))
    if roll < 0.8:  # before vLLM 0.26: tagged arrays, fewer fields
        tokens = list(range(rng.choice([0, 16, 32])))
        return _pack([1.5, [["BlockStored", [1, 2], None, tokens, 16, None],
                            ["AllBlocksCleared"]], None])  # fmt: skip
    fields: list[Any] = [rng.choice([1.5, 7, -1, None]), [random_value(rng) for _ in range(3)]]
    if rng.random() < 0.5:
        fields.append(random_value(rng))
    return _pack(fields)


def wider_ints(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one small positive fixint re-encoded in a wider int encoding."""
    spots = [i for i, b in enumerate(data) if b < 0x80]
    if not spots:
        return data
    i = rng.choice(spots)
    tag, fmt = rng.choice([(0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q"),
                           (0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")])  # fmt: skip
    return data[:i] + bytes([tag]) + struct.pack(fmt, data[i]) + data[i + 1 :]


def mutate(data: bytes, rng: random.Random, other: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(9)
        if how == 0 and out:  # flip bytes
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif how == 1:  # cut
            del out[rng.randint(0, len(out)) :]
        elif how == 2:  # append
            out += rng.randbytes(rng.randint(1, 16))
        elif how == 3:  # splice another input in
            at = rng.randint(0, len(out))
            out[at:at] = other[rng.randint(0, len(other)) :][: rng.randint(1, 64)]
        elif how == 4 and out:  # forge a length header with a boundary value
            at = rng.randrange(len(out))
            tag = rng.choice(list(LENGTH_HEADERS))
            width = LENGTH_HEADERS[tag]
            count = rng.choice([*BOUNDARY_COUNTS, len(out) - at, len(out) - at + 1])
            count &= (1 << (8 * width)) - 1
            out[at : at + 1 + width] = bytes([tag]) + count.to_bytes(width, "big")
        elif how == 5 and out:  # a fix-array/map/str header forged
            at = rng.randrange(len(out))
            out[at] = rng.choice([0x90, 0x9F, 0x80, 0x8F, 0xA0, 0xBF]) | rng.randrange(16)
        elif how == 6:  # nest deep
            at = rng.randint(0, len(out))
            out[at:at] = b"\x91" * rng.choice([31, 32, 33, 200, 3000])
        elif how == 7:
            out = bytearray(wider_ints(bytes(out), rng))
        elif out:  # delete a span
            at = rng.randrange(len(out))
            del out[at : at + rng.randint(1, 8)]
    return bytes(out)


def maybe_mutated(data: bytes, rng: random.Random, odds: float, other: bytes) -> bytes:
    return mutate(data, rng, other) if rng.random() < odds else data


# --- checks, one per entry point -------------------------------------------------------


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except ValueError:  # msgspec's DecodeError and ValidationError are ValueErrors
        return "ValueError", None
    except Exception as error:
        return type(error).__name__, None


def same(name: str, c: Any, py: Any, *shown: Any) -> None:
    if c != py:
        raise Disagreement(f"{name}: C {c!r:.300} != Python {py!r:.300} for {shown!r:.2000}")


def check_packed_token_bytes(k: ModuleType, rng: random.Random) -> None:
    choices = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, -1]
    ids = [rng.choice([*choices, rng.randint(-(2**63), 2**64 - 1)]) for _ in range(20)]
    del ids[rng.randint(0, 20) :]
    packed = _pack(ids)
    for _ in range(rng.randint(0, 3)):
        packed = wider_ints(packed, rng)
    packed = maybe_mutated(packed, rng, 0.5, _pack(random_value(rng)))
    arg: Any = msgspec.Raw(packed) if rng.random() < 0.3 else packed
    same("packed_token_bytes", outcome(lambda: k.packed_token_bytes(arg)),
         outcome(lambda: _kernels.packed_token_bytes(arg)), packed)  # fmt: skip
    # token_ids as a batch read packed carries them (network bytes, Raw)
    decoded = outcome(lambda: decode_packed_kv_batch(maybe_mutated(payload(rng), rng, 0.3, packed)))
    if decoded[0] == "ok" and decoded[1] is not None:
        for event in decoded[1].events:
            raw = getattr(event, "token_ids", None)
            if isinstance(raw, msgspec.Raw):
                same("packed_token_bytes (a batch's)", outcome(lambda: k.packed_token_bytes(raw)),  # noqa: B023
                     outcome(lambda: _kernels.packed_token_bytes(raw)), bytes(raw))  # noqa: B023  # fmt: skip


def check_token_bytes_and_chain(k: ModuleType, rng: random.Random) -> None:
    ids: list[Any] = [rng.choice([0, 300, 2**32 - 1, 2**32, -1, 2**70, True, rng.randint(0, 9)])
                      for _ in range(rng.randint(0, 40))]  # fmt: skip
    if rng.random() < 0.05:
        ids.append(rng.choice([1.5, "1", None]))
    same("token_bytes", outcome(lambda: k.token_bytes(ids)),
         outcome(lambda: _kernels.token_bytes(ids)), ids)  # fmt: skip
    data = rng.randbytes(rng.randint(0, 300))
    step = rng.choice([-3, 0, 1, 4, 7, 64, rng.randint(1, 400)])
    parent = rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randint(-(2**63), 2**63)])
    same("chain", outcome(lambda: k.chain(data, step, parent)),
         outcome(lambda: _kernels.chain(data, step, parent)), data, step, parent)  # fmt: skip


def check_store_and_drop(k: ModuleType, rng: random.Random) -> None:
    def a_hash() -> Any:
        return rng.randint(0, 12) if rng.random() < 0.7 else rng.randbytes(rng.randint(1, 2))

    known = {a_hash(): rng.randint(0, 12) for _ in range(rng.randint(0, 8))}
    held = {rng.randint(0, 12): rng.choice([1, 2, 1 << 21, (1 << 21) + 1]) for _ in range(6)}
    masks = {rng.randint(0, 12): rng.randint(1, 2**72) for _ in range(rng.randint(0, 8))}
    hashes = [a_hash() for _ in range(rng.randint(0, 6))]
    keys = [rng.randint(0, 12) for _ in range(rng.randint(0, 7))]
    bit, unit = rng.choice([1, 2, 1 << 70]), rng.choice([1, 1 << 21, 1 << 42])
    for name, args in (("store_new", (hashes, keys, bit, unit)),
                       ("drop_only_copies", (hashes, bit, unit))):  # fmt: skip
        results = []
        for kernels in (k, _kernels):
            state = copy.deepcopy((known, held, masks))
            result = outcome(lambda: getattr(kernels, name)(*state, *args))  # noqa: B023
            results.append((result, state))
        same(name, results[0], results[1], (known, held, masks), args)


def check_index_payloads(k: ModuleType, rng: random.Random) -> None:
    """A PrefixIndex fed the same (mutated) payloads on either kernel ends the same."""
    payloads = [maybe_mutated(payload(rng), rng, 0.3, b"") for _ in range(rng.randint(1, 8))]
    states = []
    block_size = rng.choice([None, 4, 16])
    for kernels in (k, _kernels):
        in_use = kvbus.routing.index.use_kernels(kernels)
        try:
            index = PrefixIndex(block_size)
            results = [outcome(lambda: index.apply_payload("w", p)) for p in payloads]  # noqa: B023
            queries = [index.match(list(range(n, n + 64))) for n in (0, 16)]
            states.append((results, dict(index._masks), queries, index.malformed,
                           index.unchained, index.unknown_removals))  # fmt: skip
        finally:
            kvbus.routing.index.use_kernels(in_use)
    same("PrefixIndex.apply_payload", states[0], states[1], payloads)


# Each check and its share of the time: most for the walks over network bytes.
CHECKS: dict[str, tuple[Callable[[ModuleType, random.Random], None], float]] = {
    "packed_token_bytes": (check_packed_token_bytes, 0.35),
    "token_bytes+chain": (check_token_bytes_and_chain, 0.15),
    "store_new+drop_only_copies": (check_store_and_drop, 0.15),
    "PrefixIndex.apply_payload": (check_index_payloads, 0.35),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--module", required=True, help="a build of kvbus/routing/_ckernels.c")
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    kernels = load(args.module)
    print(f"fuzz: kernels {args.module}, seed {seed}, {args.seconds:g} s", flush=True)
    runs = dict.fromkeys(CHECKS, 0)
    for n, (name, (check, share)) in enumerate(CHECKS.items()):
        rng = random.Random(seed + n)
        until = time.monotonic() + share * args.seconds
        while time.monotonic() < until:
            try:
                check(kernels, rng)
            except Disagreement as error:
                print(f"fuzz: DISAGREEMENT in {name} (seed {seed}): {error}", flush=True)
                return 1
            runs[name] += 1
    print("fuzz: " + ", ".join(f"{name} {count} rounds" for name, count in runs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
