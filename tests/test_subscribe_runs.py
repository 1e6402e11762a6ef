"""The subscriber's C path for runs of entries (`kvbus._ckernels.kv_run`) delivers
exactly what its per-entry path does (the reference: `kvbus._kernels` finds no runs),
whatever the stream: sources interleaved, gaps, duplicates, new epochs, gap markers,
other kinds, oversized, forged or malformed entries, and every encoding msgpack allows
for an envelope's fields, not only the ones kvbus writes."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvbus.transports import Entry

from kvbus import Message, _kernels
from kvbus.envelope import SCHEMA_VERSION, Envelope, Kind, encode_envelope

from .conftest import ckernels as _ckernels
from .conftest import kv_payload, needs_c
from .crafted_streams import delivered

EPOCH = time.time_ns() - 10**9


def _int(value: int, how: str) -> bytes:
    """``value`` as msgspec writes it, or in a wider int encoding msgpack also allows."""
    if how == "uint64":
        return b"\xcf" + value.to_bytes(8, "big")
    if how == "int64":
        return b"\xd3" + value.to_bytes(8, "big", signed=True)
    return msgspec.msgpack.encode(value)


@st.composite
def stored(draw: st.DrawFn, source: str, epoch: int, seq: int) -> bytes:
    """One stored envelope: mostly as kvbus writes it, else with one thing changed."""
    how = draw(
        st.sampled_from(
            ["plain"] * 12
            + ["array16", "version 2", "version as uint8", "metrics", "lost_from 0"]
            + ["lost_from", "uint64 seq", "int64 epoch", "float32 ts", "int ts"]
            + ["bin32 payload", "str payload", "bad payload", "big payload", "bad utf-8"]
            + ["str8 source", "trailing byte", "negative seq"]
        )
    )
    version = _int(2, "") if how == "version 2" else b"\xcc\x01" if "uint8" in how else b"\x01"
    kind = _int(Kind.METRICS if how == "metrics" else Kind.KV, "")
    name = source.encode()
    if how == "bad utf-8":
        name = b"\xff" + name
    if how == "str8 source":
        name_field = b"\xd9" + bytes([len(name)]) + name
    else:
        name_field = bytes([0xA0 | len(name)]) + name
    epoch_field = _int(epoch, "int64" if how == "int64 epoch" else "")
    seq_field = _int(-seq if how == "negative seq" else seq, "uint64" if "uint64" in how else "")
    if how == "float32 ts":
        ts = b"\xca\x3f\xc0\x00\x00"  # 1.5
    elif how == "int ts":
        ts = _int(1_700_000_000, "")
    else:
        ts = msgspec.msgpack.encode(time.time())
    payload = kv_payload(seq, blocks=40 if how == "big payload" else 1)
    if how == "bad payload":
        payload = b"\x93\xc1"
    if how == "str payload":
        payload_field = b"\xda" + len(payload).to_bytes(2, "big") + payload
    elif how == "bin32 payload":
        payload_field = b"\xc6" + len(payload).to_bytes(4, "big") + payload
    else:
        payload_field = msgspec.msgpack.encode(payload)
    fields = [version, kind, name_field, epoch_field, seq_field, ts, payload_field]
    if how == "lost_from 0":
        fields.append(b"\x00")
    elif how == "lost_from":
        fields.append(_int(draw(st.sampled_from([1, seq, seq + 5])), ""))  # seq + 5: malformed
    head = (
        bytes([0x90 | len(fields)])
        if how != "array16"
        else b"\xdc" + len(fields).to_bytes(2, "big")
    )
    return head + b"".join(fields) + (b"\xc0" if how == "trailing byte" else b"")


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[Entry], list[int]]:
    """Entries of up to three sources, each a walk of seqs (mostly +1: runs), then the
    page sizes the transport hands them over in."""
    entries: list[Entry] = []
    state = {source: [EPOCH, 0] for source in ("a", "b", "é")}
    source = "a"
    for position in range(1, draw(st.integers(1, 700)) + 1):
        if draw(st.integers(0, 3)) == 0:  # else the same source again: a pack
            source = draw(st.sampled_from(sorted(state)))
        epoch_seq = state[source]
        step = draw(st.sampled_from([1] * 20 + [0, 2, -3, "epoch"]))
        if step == "epoch":
            epoch_seq[0] += 1000
            epoch_seq[1] = 1
        else:
            epoch_seq[1] = max(1, epoch_seq[1] + int(step))
        data = draw(stored(source, epoch_seq[0], epoch_seq[1]))
        sender = draw(st.sampled_from([None] * 6 + [source, "b"]))
        entries.append(Entry(position, data, sender))
    sizes = draw(st.lists(st.integers(1, 600), min_size=1, max_size=8))
    return entries, sizes


@needs_c
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_runs_in_c_deliver_what_the_per_entry_path_does(
    stream: tuple[list[Entry], list[int]],
) -> None:
    entries, sizes = stream
    assert delivered(_ckernels, entries, sizes, 600) == delivered(_kernels, entries, sizes, 600)


@needs_c
def test_a_run_is_one_sources_plain_kv_batches_in_seq_order() -> None:
    payloads = [kv_payload(seq) for seq in range(6)]

    def plain(source: str, seq: int) -> Entry:
        return Entry(seq, encode_envelope(
            Envelope(1, Kind.KV, source, EPOCH, seq, 1.5, payloads[seq])
        ))  # fmt: skip

    entries = [plain("a", 1), plain("a", 2), plain("a", 3), plain("b", 4), plain("a", 5)]
    vouched = _ckernels.plain_kv_envelopes([e.data for e in entries])
    assert vouched == b"\x01" * 5

    def run(start: int, limit: int = 10**6) -> Any:
        return _ckernels.kv_run(
            entries, start, vouched, limit, SCHEMA_VERSION, Message, Kind.KV, None, 7, "p"
        )

    source, epoch, first, items = run(0)
    assert (source, epoch, first, len(items)) == ("a", EPOCH, 1, 3)  # b's entry ends it
    assert [(m.seq, order, previous) for m, order, previous in items] == [
        (1, 7, "p"), (2, 8, 1), (3, 9, 2),
    ]  # fmt: skip
    message = items[1][0]
    assert (message.kind, message.ts, message.payload, message.position) == (
        Kind.KV, 1.5, payloads[2], 2,
    )  # fmt: skip
    assert run(3)[3][0][0].source == "b" and len(run(3)[3]) == 1
    assert run(0, limit=len(entries[0].data) - 1) is None  # oversized: the caller decides
    assert len(run(0, limit=10**30)[3]) == 3  # a limit beyond any size
    for no_limit_it_reads in (-(10**30), 1e9):  # below any size; not an int
        assert run(0, limit=no_limit_it_reads) is None  # type: ignore[arg-type]
    assert (
        _ckernels.kv_run(
            entries, 0, b"\x01\x00", 10**6, SCHEMA_VERSION, Message, Kind.KV, None, 0, None
        )[3].__len__()
        == 1
    )  # not vouched for: the run ends before it
