"""Fuzzing (hypothesis) the decoders and subscribe() with what an attacker can store on
the bus: random bytes, valid messages with bytes flipped, cut or appended, and deep
nesting. Nothing may raise but the documented errors, and a real source's messages
around the garbage still arrive, in order."""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbus import Message
from kvbus.wire.envelope import decode_envelope
from kvbus.wire.events import decode_control, decode_kv_batch, decode_metrics
from kvbus.wire.snapshot import decode_snapshot

from .conftest import append_raw, collect, envelope, kv_payload

_buses = itertools.count()
EPOCH = time.time_ns() - 10**12


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    """Bytes that are, or nearly are, a message of the bus."""
    seed = draw(
        st.sampled_from(
            [
                envelope("a", EPOCH, 5),
                kv_payload(1, blocks=3),
                envelope("a", EPOCH, 5, b"\x92\xcb" + bytes(8) + b"\x91" * 3000 + b"\xc0"),
            ]
        )
    )
    how = draw(st.sampled_from(["random", "flip", "cut", "append", "nest"]))
    if how == "random":
        return draw(st.binary(max_size=300))
    if how == "flip":
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "cut":
        return seed[: draw(st.integers(0, len(seed) - 1))]
    if how == "append":
        return seed + draw(st.binary(max_size=64))
    return b"\x91" * draw(st.integers(1, 5000)) + seed


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile())
def test_decoders_raise_only_decode_errors(data: bytes) -> None:
    for decode in (decode_envelope, decode_kv_batch, decode_metrics, decode_control):
        try:
            decode(data)
        except (msgspec.DecodeError, ValueError):
            pass
    try:
        decode_snapshot(data)
    except (msgspec.DecodeError, ValueError):
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile(), min_size=1, max_size=12))
def test_subscribe_skips_garbage_and_delivers_the_rest(garbage: list[bytes]) -> None:
    url = f"memory://fuzz{next(_buses)}"
    real = [envelope("real", EPOCH, seq) for seq in (1, 2, 3)]
    stored = [real[0], *garbage[: len(garbage) // 2], real[1], *garbage[len(garbage) // 2 :]]
    asyncio.run(append_raw(url, [*stored, real[2]]))
    items, _ = asyncio.run(collect(url, gap_timeout=0.01))
    assert [i.seq for i in items if isinstance(i, Message) and i.source == "real"] == [1, 2, 3]
