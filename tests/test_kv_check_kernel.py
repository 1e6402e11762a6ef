"""The subscriber's check of KV batches in C (``plain_kv_envelopes``) against msgspec's:
it vouches for what engines and kvbus write, never for what msgspec would refuse, and
a subscription delivers and counts the same whichever kernel checks."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus import _kernels
from kvbus.envelope import ENVELOPE_DECODER
from kvbus.events import check_kv_batch
from kvbus.subscribe import Message, Resync, ResyncReason

from .conftest import append_raw, collect, envelope, kv_payload, needs_c, seqs, subscribe_module
from .conftest import ckernels as _ckernels

EPOCH = time.time_ns() - 10**12
_encode = msgspec.msgpack.encode


def msgspec_accepts(data: bytes) -> bool:
    """The envelope decodes (any version: the subscriber compares it after decoding)
    and its payload checks."""
    try:
        check_kv_batch(ENVELOPE_DECODER.decode(data).payload)
    except (msgspec.DecodeError, ValueError):
        return False
    return True


def keeps_its_promise(data: bytes) -> bool:
    """What the C kernel's 1 promises, all the subscriber relies on: where msgspec
    decodes the envelope, its payload checks. (Whether it decodes is msgspec's call.)"""
    try:
        ENVELOPE_DECODER.decode(data)
    except (msgspec.DecodeError, ValueError):
        return True
    return msgspec_accepts(data)


def vllm_payloads() -> list[bytes]:
    """Batches as vLLM's own structs encode them: both dialects, with and without a
    rank, empty, and every event type."""
    from vllm.distributed import kv_events as v

    stored = v.BlockStored(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=None,
        token_ids=[0, 127, 128, 255, 256, 65535, 65536, 128_255] * 4,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    events = [stored, v.BlockRemoved(block_hashes=[7], medium="CPU"), v.AllBlocksCleared()]
    encoder = msgspec.msgpack.Encoder()
    batches = [
        v.KVEventBatch(ts=time.time(), events=events),
        v.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=3),
        v.KVEventBatch(ts=time.time(), events=[]),
    ]
    old_dialect = [  # before vLLM 0.26: tagged arrays, fewer fields
        1.5,
        [["BlockStored", [1, 2], None, list(range(32)), 16, None], ["AllBlocksCleared"]],
        None,
    ]
    return [*map(encoder.encode, batches), _encode(old_dialect), _encode([1.5, []])]


@needs_c
def test_the_kernel_vouches_for_what_engines_and_kvbus_write() -> None:
    payloads = [*vllm_payloads(), kv_payload(1, blocks=16)]
    data = [envelope("engine-0", EPOCH, seq, p) for seq, p in enumerate(payloads, 1)]
    data.append(envelope("engine-0", EPOCH, 9, kv_payload(1), lost_from=3))  # 8 fields
    assert _ckernels.plain_kv_envelopes(data) == b"\x01" * len(data)
    assert all(map(msgspec_accepts, data))


@needs_c
def test_the_kernel_leaves_what_it_is_unsure_of_to_msgspec() -> None:
    ext = _encode([1.5, [{"type": "BlockTeleported", "x": msgspec.msgpack.Ext(1, b"ab")}]])
    deep = b"\x92\xcb" + bytes(8) + b"\x91" + b"\x91" * 40 + b"\xc0"
    int_ts = _encode([1, []])
    unsure = [ext, deep, int_ts]  # msgspec accepts these: the kernel does not vouch
    refused = [b"\x92\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff", b"\x93\xc1", b""]
    data = [envelope("a", EPOCH, 1, p) for p in unsure + refused]
    data += [b"\x97", b"\xc1", b"", envelope("a", EPOCH, 9)[:-1]]
    assert _ckernels.plain_kv_envelopes([*data, "not bytes", None]) == bytes(len(data) + 2)
    assert list(map(msgspec_accepts, data)) == [True] * 3 + [False] * (len(data) - 3)


# Events as anything msgpack can hold, now and then something the kernel leaves to
# msgspec (an ext type, nesting past its 32 levels).
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
)
_value = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=40), st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=300,
)


@st.composite
def stored(draw: st.DrawFn) -> bytes:
    """An envelope that holds, or nearly holds, a KV batch: made of random events, then
    perhaps damaged (bytes flipped, cut or appended, a count forged, nested deep)."""
    ts = draw(st.one_of(st.floats(allow_nan=False), st.integers(0, 2**40)))
    fields: list[Any] = [ts, draw(st.lists(_value, max_size=4))]
    if draw(st.booleans()):
        fields.append(draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))))
    payload = _encode(fields)
    data = envelope("a", EPOCH, draw(st.integers(1, 10**6)), payload)
    how = draw(st.sampled_from(["as is", "as is", "flip", "cut", "append", "nest"]))
    if how == "flip":
        damaged = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            damaged[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        data = bytes(damaged)
    elif how == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=16))
    elif how == "nest":
        depth = draw(st.integers(1, 3000))
        data = envelope("a", EPOCH, 1, payload[:-1] + b"\x91" * depth + b"\xc0")
    return data


@needs_c
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(stored(), min_size=1, max_size=12))
def test_what_the_kernel_vouches_for_msgspec_accepts(data: list[bytes]) -> None:
    flags = _ckernels.plain_kv_envelopes(data)
    for vouched, entry in zip(flags, data, strict=True):
        if vouched:
            assert keeps_its_promise(entry)
    # Walked side by side in lanes, or each alone: the same answer.
    assert flags == b"".join(_ckernels.plain_kv_envelopes([entry]) for entry in data)


@needs_c
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.recursive(
            _leaf.filter(lambda v: not isinstance(v, msgspec.msgpack.Ext)),
            lambda inner: st.lists(inner, max_size=20),
            max_leaves=100,
        ),
        max_size=5,
    )
)
def test_the_kernel_vouches_for_any_plain_events(events: list[Any]) -> None:
    payload = _encode([1.5, events, None])
    assert _ckernels.plain_kv_envelopes([envelope("a", EPOCH, 1, payload)]) == b"\x01"


@pytest.fixture(params=["C kernel", "Python kernel"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "Python kernel":
        monkeypatch.setattr(subscribe_module, "kernels", _kernels)
    elif _ckernels is None:
        pytest.skip("kvbus._ckernels did not build")
    else:
        assert subscribe_module.kernels is _ckernels
    return str(request.param)


async def test_a_subscription_checks_alike_with_either_kernel(kernel: str, memory_url: str) -> None:
    ext = _encode([1.5, [{"type": "AllBlocksCleared", "x": msgspec.msgpack.Ext(1, b"")}]])
    payloads: list[bytes | None] = [None, ext, b"\x92\xcb" + bytes(8) + b"\x91\xc1", None]
    payloads += [b"\x92\xcb" + bytes(8) + b"\x91" * 3000 + b"\xc0", None]
    # 600 messages: the bad ones land in the first and the last slice of the page.
    data = [envelope("a", EPOCH, seq, p) for seq, p in enumerate(payloads, 1)]
    data += [envelope("a", EPOCH, seq) for seq in range(len(data) + 1, 600)]
    data.append(envelope("a", EPOCH, 600, b"\x93\xcb" + bytes(8) + b"\x90\xc4"))
    await append_raw(memory_url, data)
    items, sub = await collect(memory_url)
    assert seqs(items) == [1, 2, 4, *range(6, 600)]
    lost = [i.lost for i in items if isinstance(i, Resync)]
    assert lost == [(3, 3), (5, 5), (600, 600)]
    assert all(i.reason is ResyncReason.MALFORMED for i in items if isinstance(i, Resync))
    assert sub.stats.malformed == 3 and sub.stats.delivered == 597
    second = items[1]
    assert isinstance(second, Message) and len(second.body.events) == 1  # type: ignore[union-attr]
