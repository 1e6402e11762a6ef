"""kvbus/_ckernels.c against kvbus/_kernels.py, its reference: the same results and the
same state left behind, for any input, and a whole PrefixIndex run on each."""

from __future__ import annotations

import copy
import shutil
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbus.index
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, _kernels
from kvbus.index import PrefixIndex

try:
    from kvbus import _ckernels
except ImportError:  # no compiler at install
    _ckernels = None  # type: ignore[assignment]

needs_c = pytest.mark.skipif(_ckernels is None, reason="kvbus._ckernels did not build")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_the_c_kernels_are_built_where_a_compiler_is() -> None:
    # optional=True lets an install go on when the build fails: this is what notices.
    assert _ckernels is not None, "kvbus/_ckernels.c did not build (see the pip log)"
    assert kvbus.index.kernels is _ckernels


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
    states, in_use = [], kvbus.index.kernels
    for kernels in (_ckernels, _kernels):
        kvbus.index.kernels = kernels
        try:
            index = PrefixIndex(B)
            for worker, event in stream:
                index.apply_events(worker, [event])
            states.append(index_state(index))
        finally:
            kvbus.index.kernels = in_use
    assert states[0] == states[1]
