"""kvbus/routing/_ckernels.c against kvbus/routing/_kernels.py, its reference: the same
results and the same state left behind, for any input, and a whole PrefixIndex run on each."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbus.routing.index
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvbus.routing import _kernels
from kvbus.routing.index import PrefixIndex

from .conftest import ckernels as _ckernels
from .conftest import needs_c


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_the_c_kernels_are_built_where_a_compiler_is() -> None:
    # optional=True lets an install go on when the build fails: this is what notices.
    assert _ckernels is not None, "kvbus/routing/_ckernels.c did not build (see the pip log)"
    assert kvbus.routing.index.kernels is _ckernels


def outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as error:  # the same exception type on both sides
        return type(error).__name__, None


tokens = st.lists(
    st.one_of(
        st.integers(0, 2**32 - 1),
        st.integers(0, 300),  # small ints: C's in-place fast path
        st.integers(-(2**70), 2**70),  # negative or past 32 bits: OverflowError
        st.booleans(),
    ),
    max_size=40,
)


@needs_c
@settings(max_examples=300, deadline=None)
@given(tokens)
def test_token_bytes_matches_array(token_ids: list[int]) -> None:
    assert outcome(lambda: _ckernels.token_bytes(token_ids)) == outcome(
        lambda: _kernels.token_bytes(token_ids)
    )


@needs_c
def test_token_bytes_rejects_what_array_rejects() -> None:
    for bad in ([1.5], ["1"], [None]):
        with pytest.raises(TypeError):
            _ckernels.token_bytes(bad)  # type: ignore[arg-type]
    for bad_int in ([-1], [2**32], [2**64], [-(2**40)]):
        with pytest.raises(OverflowError):
            _ckernels.token_bytes(bad_int)
    assert _ckernels.token_bytes(range(3)) == array("I", [0, 1, 2]).tobytes()


# msgpack's encodings of an int, by the first byte; any of those wide enough for a value
# is valid msgpack (msgspec reads them all), so an encoder may pick any.
_UNSIGNED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
_SIGNED = {0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}


@st.composite
def packed_ints(draw: st.DrawFn) -> bytes:
    """A msgpack array of ints in any of their encodings, now and then with a value
    past 32 bits or negative, an item that is no int, a forged count or cut bytes."""
    values = draw(
        st.lists(st.one_of(st.integers(-300, 70000), st.integers(-(2**63), 2**64 - 1)), max_size=12)
    )
    items = []
    for value in values:
        fits = [t for t, f in _UNSIGNED.items() if 0 <= value < 256 ** struct.calcsize(f)]
        half = {t: 128 * 256 ** (struct.calcsize(f) - 1) for t, f in _SIGNED.items()}
        fits += [t for t, limit in half.items() if -limit <= value < limit]
        if 0 <= value < 128:
            fits.append(-1)  # positive fixint
        if -32 <= value < 0:
            fits.append(-2)  # negative fixint
        tag = draw(st.sampled_from(fits))
        if tag == -1 or tag == -2:
            items.append(struct.pack(">b", value))
        else:
            items.append(bytes([tag]) + struct.pack({**_UNSIGNED, **_SIGNED}[tag], value))
    if draw(st.integers(0, 5)) == 0:  # an item that is no int
        junk = draw(st.sampled_from([1.5, "7", None, True, [1], b"\x01", {"a": 1}]))
        items.insert(draw(st.integers(0, len(items))), msgspec.msgpack.encode(junk))
    count = len(items)
    if draw(st.integers(0, 5)) == 0:
        count = draw(st.integers(0, 2**32 - 1))  # forged
    header = draw(st.sampled_from([b"\x90", b"\xdc", b"\xdd"]))
    if header == b"\x90":
        header = bytes([0x90 | (count & 0x0F)]) if count < 16 else b"\xdd" + count.to_bytes(4)
    elif header == b"\xdc":
        header += (count & 0xFFFF).to_bytes(2)
    else:
        header += count.to_bytes(4)
    packed = header + b"".join(items)
    cut = draw(st.integers(0, 6))
    if cut == 1:
        packed = packed[: draw(st.integers(0, len(packed)))]
    elif cut == 2:
        packed += b"\x01"  # trailing bytes
    return packed


def error_class(call: Any) -> tuple[str, Any]:
    """``outcome`` with msgspec's errors as the ValueError they are."""
    try:
        return "ok", call()
    except ValueError:
        return "ValueError", None
    except OverflowError:
        return "OverflowError", None


@needs_c
@settings(max_examples=500, deadline=None)
@given(packed_ints())
def test_packed_token_bytes_matches_decoding_them(packed: bytes) -> None:
    assert error_class(lambda: _ckernels.packed_token_bytes(packed)) == error_class(
        lambda: _kernels.packed_token_bytes(packed)
    )


@pytest.mark.parametrize("kernels", [_ckernels, _kernels], ids=["C", "Python"])
def test_packed_token_bytes_of_any_int_encoding_and_bad_input(kernels: Any) -> None:
    if kernels is None:
        pytest.skip("kvbus.routing._ckernels did not build")
    ids = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]
    assert kernels.packed_token_bytes(msgspec.msgpack.encode(ids)) == array("I", ids).tobytes()
    wide = b"\x92\xd3" + (5).to_bytes(8) + b"\xcf" + (7).to_bytes(8)  # int64 5, uint64 7
    assert kernels.packed_token_bytes(msgspec.Raw(wide)) == array("I", [5, 7]).tobytes()
    for past_32_bits in ([2**32], [-1], [1, -(2**40)]):
        with pytest.raises(OverflowError):
            kernels.packed_token_bytes(msgspec.msgpack.encode(past_32_bits))
    for tag, fmt in _SIGNED.items():  # a negative id in each signed width
        with pytest.raises(OverflowError):
            kernels.packed_token_bytes(b"\x91" + bytes([tag]) + struct.pack(fmt, -100))
    forged = b"\xdd\xff\xff\xff\xff\x01"  # 4 billion ids claimed, one sent
    for bad in (b"", b"\x91", forged, msgspec.msgpack.encode([-1, "x"]), b"\x80"):
        with pytest.raises(ValueError):  # not an array of ints (a ValueError wins)
            kernels.packed_token_bytes(bad)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200),
    st.integers(-3, 40),
    st.one_of(st.integers(-(2**63), 2**63), st.just(0)),
)
def test_chain_matches_python(data: bytes, step: int, parent: int) -> None:
    assert outcome(lambda: _ckernels.chain(data, step, parent)) == outcome(
        lambda: _kernels.chain(data, step, parent)
    )


@pytest.mark.parametrize("kernels", [_kernels, _ckernels], ids=["python", "C"])
def test_a_key_is_the_blake2b_of_its_parent_and_block(kernels: Any) -> None:
    """The scheme, spelled out with hashlib: what another implementation must match."""
    if kernels is None:
        pytest.skip("kvbus.routing._ckernels did not build")
    data = array("I", range(1000, 1096)).tobytes()  # 3 blocks of 32 tokens

    def blake2b(parent: int, block: bytes) -> int:
        message = parent.to_bytes(8, "little", signed=True) + block
        digest = hashlib.blake2b(message, digest_size=8, person=b"kvbus.key.v1").digest()
        return int.from_bytes(digest, "little", signed=True)

    first = blake2b(0, data[:128])
    second = blake2b(first, data[128:256])
    assert kernels.chain(data, 128, 0) == [first, second, blake2b(second, data[256:])]
    assert kernels.chain(data, 128, -(2**63))[0] == blake2b(-(2**63), data[:128])


SAMPLE_KEYS = """
from kvbus.routing.index import block_keys
tokens = list(range(7, 7 + 64))
extra = [("lora-1", "mm", [1, {"k": [2, 3]}]), None, {"salt": b"x"}, ("lora-1",)]
KEYS = [
    block_keys(tokens, 16),
    block_keys(tokens, 16, parent=12345),
    block_keys(tokens, 16, "lora-1", extra),
    block_keys(tokens, 16, None, [None, (1.5, None, True)]),
    block_keys(tokens, 16, lookahead=3),
    block_keys(tokens, 16, lookahead=[[1], [2, 3], [], [4]]),
]
"""


@pytest.mark.parametrize("pure_python", ["", "1"], ids=["C", "python"])
def test_keys_are_the_same_in_every_process(pure_python: str) -> None:
    """Router replicas share keys: no per-process seed (Python's ``hash`` has one for
    bytes and str, and ``hash(None)`` is an address) may enter them."""
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "KVBUS_PURE_PYTHON": pure_python}
        code = SAMPLE_KEYS + "import json; print(json.dumps(KEYS))"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        runs.append(json.loads(out.stdout))
    here: dict[str, Any] = {}
    exec(SAMPLE_KEYS, here)
    assert runs[0] == runs[1] == here["KEYS"]
    plain, chained, salted, extras, ahead, ahead_given = here["KEYS"]
    assert extras[0] == plain[0] and extras[1] != plain[1]  # a None extra key adds nothing
    assert len(set(plain + chained + salted + ahead + ahead_given)) == 4 * 3 + 3 + 4


def test_extra_keys_of_any_msgpack_value_key_their_blocks() -> None:
    tokens = list(range(40, 48))  # 4 blocks of 2
    extra = [("lora", [1, 2]), ("lora", "mm", [b"x", None]), ("lora", {"m": [1]}), None]
    # Lists or tuples, as sent or as decoded: msgpack arrays either way.
    as_lists = [list(e) if e else None for e in extra]
    keys = kvbus.routing.index.block_keys(tokens, 2, "lora", extra)
    assert kvbus.routing.index.block_keys(tokens, 2, "lora", as_lists) == keys
    assert len(set(keys + kvbus.routing.index.block_keys(tokens, 2, "lora"))) == 8
    for value in ({"k": {"n": [None, 1.5]}}, [[[]]], b"\x00", 2**64 - 1, -(2**63)):
        assert kvbus.routing.index.block_keys(tokens, 2, None, [(value,)])[0] not in keys
    index = PrefixIndex(2)
    stored = BlockStored([1, 2, 3, 4], None, tokens, 2, None, "GPU", "lora")
    stored.extra_keys = extra  # type: ignore[assignment]
    index.apply_events("w", [stored])
    assert index.stored(index.worker_number("w")) == 4
    assert index.match(tokens, "lora", as_lists) == {"w": 8}
    assert index.match(tokens, "lora") == {}  # other extra keys: other blocks


# Small pools of hashes and keys, so that inputs hit known, held and repeated ones.
engine_hashes = st.one_of(st.integers(0, 12), st.binary(min_size=1, max_size=2))
router_keys = st.integers(0, 12)
bits = st.sampled_from([1, 2, 1 << 70])
units = st.sampled_from([1, 1 << 21, 1 << 42])
states = st.tuples(
    st.dictionaries(engine_hashes, router_keys, max_size=8),
    st.dictionaries(router_keys, st.sampled_from([1, 2, 1 << 21, (1 << 21) + 1]), max_size=8),
    st.dictionaries(router_keys, st.integers(1, 2**72), max_size=8),
)


def both(name: str, state: tuple[dict[Any, Any], ...], *args: Any) -> None:
    """Run kernel ``name`` on a copy of ``state`` in C and in Python: same result, same
    dicts after (a False leaves held and masks as they were)."""
    results = []
    for kernels in (_ckernels, _kernels):
        mine = copy.deepcopy(state)
        result = outcome(lambda: getattr(kernels, name)(*mine, *args))  # noqa: B023
        results.append((result, mine))
        if result == ("ok", False):
            assert mine[1:] == state[1:]
    assert results[0] == results[1]


@needs_c
@settings(max_examples=400, deadline=None)
@given(states, st.lists(engine_hashes, max_size=6), st.lists(router_keys, max_size=6), bits, units)
def test_store_new_matches_python(
    state: tuple[dict[Any, Any], ...], hashes: list[Any], keys: list[int], bit: int, unit: int
) -> None:
    both("store_new", state, hashes, keys, bit, unit)


@needs_c
@settings(max_examples=400, deadline=None)
@given(states, st.lists(engine_hashes, max_size=6), bits, units)
def test_drop_only_copies_matches_python(
    state: tuple[dict[Any, Any], ...], hashes: list[Any], bit: int, unit: int
) -> None:
    both("drop_only_copies", state, hashes, bit, unit)


@needs_c
def test_kernels_reject_what_is_not_a_dict() -> None:
    with pytest.raises(TypeError):
        _ckernels.store_new([], {}, {}, [], [], 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _ckernels.store_new({}, {}, {}, [1], [1, 2], 1, 1)
    with pytest.raises(TypeError):
        _ckernels.drop_only_copies({}, {}, None, [], 1, 1)  # type: ignore[arg-type]


# --- a whole index on each -------------------------------------------------------------

B = 2
WORKERS = ["w0", "w1", "w2"]
MEDIA = [None, "GPU", "CPU"]


@st.composite
def event_streams(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """Stores of prompts from a small pool (so blocks repeat: copies, shared prefixes),
    removals of stored and unknown hashes, clears; now and then a malformed store."""
    stream: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 30))):
        worker = draw(st.sampled_from(WORKERS))
        action = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "bad"]))
        prompt = draw(st.integers(0, 3))
        blocks = draw(st.integers(1, 3))
        first = draw(st.integers(0, 2))
        hashes = [prompt * 10 + b for b in range(first, first + blocks)]
        medium = draw(st.sampled_from(MEDIA))
        if action == "store":
            parent = prompt * 10 + first - 1 if first else None
            token_ids = [prompt * 100 + t for t in range(first * B, (first + blocks) * B)]
            stream.append((worker, BlockStored(hashes, parent, token_ids, B, None, medium, None)))
        elif action == "remove":
            stream.append((worker, BlockRemoved(hashes, medium)))
        elif action == "clear":
            stream.append((worker, AllBlocksCleared()))
        else:
            malformed = BlockStored(hashes, None, [-1] * (blocks * B), B, None, None, None)
            stream.append((worker, malformed))
    return stream


def index_state(index: PrefixIndex) -> Any:
    workers = {
        name: (dict(w.keys), dict(w.held), w.resident, list(w.forgotten))
        for name, w in index._workers.items()
    }
    counters = (index.unchained, index.malformed, index.unknown_removals, index.offloaded)
    queries = [index.match([p * 100 + t for t in range(8)]) for p in range(4)]
    return index._masks, workers, counters, queries


@needs_c
@settings(max_examples=200, deadline=None)
@given(event_streams())
def test_an_index_on_c_kernels_is_the_index_on_python_kernels(
    stream: list[tuple[str, Any]],
) -> None:
    states = []
    for kernels in (_ckernels, _kernels):
        in_use = kvbus.routing.index.use_kernels(kernels)
        try:
            index = PrefixIndex(B)
            for worker, event in stream:
                index.apply_events(worker, [event])
            states.append(index_state(index))
        finally:
            kvbus.routing.index.use_kernels(in_use)
    assert states[0] == states[1]


@needs_c
@settings(max_examples=200, deadline=None)
@given(event_streams(), st.integers(1, 3))
def test_an_index_fed_payloads_is_the_index_fed_events(
    stream: list[tuple[str, Any]], per_batch: int
) -> None:
    """`PrefixIndex.apply_payload` (token ids read packed, the whole batch the usual way
    when any of its events is malformed) leaves what `apply_events` leaves."""
    batches: list[tuple[str, list[Any]]] = []
    for worker, event in stream:
        if batches and batches[-1][0] == worker and len(batches[-1][1]) < per_batch:
            batches[-1][1].append(event)
        else:
            batches.append((worker, [event]))
    by_events, by_payload = PrefixIndex(B), PrefixIndex(B)
    for worker, events in batches:
        by_events.apply_events(worker, events)
        payload = msgspec.msgpack.encode(KVEventBatch(1.0, events))
        assert by_payload.apply_payload(worker, payload) == 0
    assert index_state(by_payload) == index_state(by_events)
