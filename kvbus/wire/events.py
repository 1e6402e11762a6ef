"""Typed payloads carried on the bus.

`KVEventBatch` and its events mirror vLLM's own classes (`vllm.distributed.kv_events`)
field for field, so encoding one of ours with `msgspec.msgpack` gives the bytes vLLM
sends and decoding vLLM's bytes gives ours. Two wire dialects exist and both decode:

* vLLM >= 0.26: each event is a msgpack MAP tagged by ``"type"``;
* older vLLM: each event is a tagged ARRAY ``["BlockStored", block_hashes, ...]``.

msgspec cannot put map- and array-encoded structs in one union, so the older dialect
has its own decoder, tried only when the current one fails. A batch holding an event
type this version does not know is decoded event by event and the unknown ones are
skipped (and counted by the caller) instead of losing the whole batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeAlias, Union

import msgspec

from kvbus.wire.envelope import nesting_is_malformed

BlockHash: TypeAlias = int | bytes
"""An engine block hash: a 64-bit int by default (may exceed 2**63), or 32 bytes."""

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"

# --- values read from the network without a schema ------------------------------------
#
# msgspec decodes an untyped msgpack map keyed by arrays into a dict keyed by tuples,
# and tuples of ints (or floats, or nested tuples) can be made to share one hash: such a
# map of n keys takes O(n^2) to build (280 KiB: 3.5 s on the event loop). Strings and
# bytes hash with the process's secret seed, ints collide at most a dozen times each
# (their hash is the value modulo 2**61 - 1), so the types below admit maps keyed by
# str, int or tuples of str only (vLLM's offloading stats key series by label-value
# tuples of str) and no map at all in extra keys (vLLM never sends one there): any
# other key is refused at the first one, in O(1), as a decode error.

_Atom: TypeAlias = Union[bool, int, float, str, None]  # noqa: UP007 (a runtime value)
_MapKey: TypeAlias = Union[str, int, tuple[str, ...]]  # noqa: UP007
RAW_DEPTH: Final = 8
"""Nesting levels of maps and arrays `decode_raw` reads (vLLM's deepest stats payload
has 4); deeper payloads are malformed. (Each level doubles the decoder's type, so this
stays small.)"""


def _nested(depth: int) -> Any:
    """The schema-free payload type, nested at most ``depth`` levels (msgspec takes no
    recursive type alias): atoms, and arrays and maps of ones a level less deep."""
    value: Any = _Atom
    for _ in range(depth):
        value = Union[_Atom, list[value], dict[_MapKey, value]]  # noqa: UP007
    return value


_raw_decoder: Final = msgspec.msgpack.Decoder(_nested(RAW_DEPTH))

# One block's extra keys: vLLM's are LoRA names and cache salts (str), prompt-embeds
# digests (bytes) and (multimodal identifier, offset) pairs. msgspec's unions hold one
# str-like type, so the decoders take str atoms and an entry holding bytes is read by
# `_careful_extra_keys` instead; type checkers see the union vLLM sends.
if TYPE_CHECKING:
    _ExtraAtom: TypeAlias = bool | int | float | str | bytes | None
    ExtraKey: TypeAlias = _ExtraAtom | tuple[_ExtraAtom, ...]
else:
    ExtraKey = Union[_Atom, tuple[_Atom, ...]]  # noqa: UP007


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    # No defaults on the next three: vLLM always writes them, and so must we to
    # produce its exact bytes.
    lora_id: int | None
    """Deprecated by vLLM in favour of ``lora_name``."""
    medium: str | None
    """"GPU", "CPU" or "STORAGE"; None (older engines) means GPU."""
    lora_name: str | None
    extra_keys: list[tuple[ExtraKey, ...] | None] | None = None
    """One entry per block: what besides tokens went into that block's hash (atoms, or
    arrays of atoms: never a map, see `ExtraKey`)."""
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    """vLLM >= 0.33: per block, the tokens after it that its hash covers (lookahead
    hashing); None when disabled."""


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's KV-cache events: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class LoadMetrics(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One engine's load, published on the metrics stream.

    Prefix-cache counters are deltas since the previous record from the same source,
    so a consumer can sum them without knowing about engine restarts.
    """

    ts: float
    engine_index: int = 0
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    connector_prefix_cache_queries: int = 0
    """Tokens looked up in the KV connector's external cache (deltas, like the above)."""
    connector_prefix_cache_hits: int = 0
    kv_cache_blocks: int = 0
    """Blocks in the engine's KV cache (its capacity); 0: not reported."""
    block_size: int = 0
    """Tokens per KV cache block (vLLM's ``--block-size``), so that a router keys prompts
    before the engine's first ``BlockStored``; 0: not reported."""
    url: str = ""
    """Where the engine serves its API (``http://HOST:PORT``): ``$KVBUS_ADVERTISE_URL``,
    else vLLM's own ``--host``/``--port``; "" when not said. Untrusted input to whoever
    reads it: ``kvbus router`` routes to it only within its ``--discover-hosts``."""
    model: str = ""
    """The engine's served model name (its first); "" when not said."""
    role: str = ""
    """The engine's part in prefill/decode disaggregation: ``prefill``, ``decode``, or
    "" (both; an aggregated engine), from ``$KVBUS_ROLE``. Untrusted input, like
    ``url``."""


# --- connector payloads, published by kvbus.connectors.vllm_connector -----------------


class TransferEvent(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One phase of one request's KV transfer between the engine and its KV connector.

    Phases: ``planned`` (a load was allocated blocks), ``pending`` (an asynchronous save
    holds the request's blocks), ``finished`` and ``failed``. A transfer is finished only
    once every worker of the engine reported it (vLLM's ``KVOutputAggregator``), and
    failed when any worker failed it. Every number is additive: sum them over requests,
    steps or engines, and divide sums (``sum(seconds) / sum(tokens)``) for averages.
    """

    request_id: str
    direction: str
    """``load`` (connector to engine) or ``save`` (engine to connector)."""
    phase: str
    tokens: int = 0
    blocks: int = 0
    is_async: bool = False
    """Whether it runs between engine steps (else within the step that scheduled it)."""
    seconds: float = 0.0
    """``finished``/``failed``: time since the transfer was planned (step-granular)."""
    steps: int = 0
    """``finished``/``failed``: engine step outputs since the transfer was planned,
    the one that ended it included (1: within the step that carried it)."""
    reason: str = ""
    """``failed``: why (``invalid_blocks``, ``failed_recving``, ``inner_error``, ...)."""
    invalid_blocks: int = 0
    params: bytes = b""
    """``pending``/``finished`` saves: the connector's ``kv_transfer_params`` (msgpack)."""


class BlockDigest(msgspec.Struct, array_like=True, gc=False):
    """A hash of one KV block's bytes on one worker, over every layer
    (`kvbus.connectors.kv_blocks.block_digest`): equal digests of a saved and a loaded
    block prove that the connector moved the KV exactly."""

    request_id: str
    direction: str
    index: int
    """The block's place in the request (0: its first block)."""
    rank: int
    digest: bytes


class ConnectorStats(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The connector's own stats for one engine step, as fresh deltas: the objects its
    workers and its scheduler side handed over this step (never one sent before), each
    as its ``to_dict()`` payload in msgpack, kept raw so any connector's stats survive."""

    connector: str
    """The inner connector's class, ``module:Class``."""
    workers: bytes = b""
    """The workers' stats, aggregated over ranks by vLLM (empty: none this step)."""
    scheduler: bytes = b""
    """The scheduler side's stats (empty: none this step)."""
    lost: str = ""
    """Why a payload that existed is missing (unencodable, oversized, inner_error)."""


class ConnectorBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step of a KV connector (envelope kind ``CONNECTOR``)."""

    ts: float
    step: int
    """The scheduler step it reports, counted from 1 by the connector."""
    transfers: list[TransferEvent] = []
    stats: ConnectorStats | None = None
    digests: list[BlockDigest] = []


# --- control payloads, published by kvbus itself -------------------------------------


class SourceStarted(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """First message of every epoch: consumers drop what they knew of this source."""

    host: str
    pid: int
    kvbus_version: str
    data_parallel_rank: int | None = None


class SourceStopped(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Last message of a cleanly closed epoch."""

    dropped: int = 0


class LossNotice(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Sent by a publisher whose newest messages were dropped with nothing queued after
    them: it takes the last dropped seq, and its gap marker announces the others, so
    consumers learn of the loss now rather than at the next message. A subscriber does
    not deliver it: it announces its seq lost with the others, in one
    ``Resync(reason="dropped")``."""

    dropped: int = 0
    """Messages dropped by this epoch so far."""


ControlEvent: TypeAlias = SourceStarted | SourceStopped | LossNotice


# --- decoding -------------------------------------------------------------------------


# Fields every release of the array dialect wrote; later fields were appended one
# release at a time, so an older engine's arrays simply stop early.
_FIRST_RELEASE_FIELDS: Final = {"block_hashes", "parent_block_hash", "token_ids", "block_size"}


def _array_dialect(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """The same struct, encoded as a tagged array (the pre-0.26 vLLM dialect)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for field in msgspec.structs.fields(cls):
        if field.name in _FIRST_RELEASE_FIELDS:
            fields.append((field.name, field.type))
        else:
            default = None if field.default is msgspec.NODEFAULT else field.default
            fields.append((field.name, field.type, default))
    return msgspec.defstruct(cls.__name__, fields, array_like=True, tag=cls.__name__, gc=False)


_ARRAY_CLASSES: Final = {
    c: _array_dialect(c) for c in (BlockStored, BlockRemoved, AllBlocksCleared)
}
_FROM_ARRAY: Final = {v: k for k, v in _ARRAY_CLASSES.items()}
_array_union: Any = _ARRAY_CLASSES[BlockStored] | _ARRAY_CLASSES[BlockRemoved]
_array_union = _array_union | _ARRAY_CLASSES[AllBlocksCleared]


def _batch_of(event_type: Any, name: str) -> Any:
    return msgspec.defstruct(
        name,
        [("ts", float), ("events", list[event_type]), ("data_parallel_rank", int | None, None)],
        array_like=True,
        gc=False,
    )


_ArrayKVEventBatch: Final = _batch_of(_array_union, "_ArrayKVEventBatch")


def _retyped(
    cls: type[msgspec.Struct], name: str, kind: Any, **options: Any
) -> type[msgspec.Struct]:
    """``cls`` (same tag, same wire shape) with its field ``name`` decoded as ``kind``."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for field in msgspec.structs.fields(cls):
        field_type = kind if field.name == name else field.type
        if field.required:
            fields.append((field.name, field_type))
        else:
            fields.append((field.name, field_type, field.default))
    return msgspec.defstruct(
        options.pop("struct_name", cls.__name__),
        fields,
        tag=options.pop("tag", cls.__name__),
        gc=False,
        **options,
    )


PackedBlockStored: Any = _retyped(
    BlockStored, "token_ids", msgspec.Raw, struct_name="PackedBlockStored", omit_defaults=True
)
"""A ``BlockStored`` whose ``token_ids`` are still the msgpack array sent (msgspec.Raw):
decoding a 512-token event this way takes about half the time, as no int object is made
per token (`kvbus.routing.index.PrefixIndex.apply_payload` reads them straight into bytes)."""
_packed_batch_decoder: Final[msgspec.msgpack.Decoder[Any]] = msgspec.msgpack.Decoder(
    _batch_of(PackedBlockStored | BlockRemoved | AllBlocksCleared, "_PackedKVEventBatch")
)


def decode_packed_kv_batch(payload: bytes) -> Any:
    """The current dialect's ``KVEventBatch`` with `PackedBlockStored` events (``.ts``,
    ``.events``, ``.data_parallel_rank``), or None for anything else (vLLM's older
    dialect, an event this kvbus does not know, a malformed one: `decode_kv_batch`)."""
    try:
        return _packed_batch_decoder.decode(payload)
    except (ValueError, RecursionError):  # msgspec's errors, bad UTF-8
        return None


_RawKVEventBatch: Final = _batch_of(msgspec.Raw, "_RawKVEventBatch")

_batch_decoder: Final = msgspec.msgpack.Decoder(KVEventBatch)
_array_batch_decoder: Final = msgspec.msgpack.Decoder(_ArrayKVEventBatch)
_raw_batch_decoder: Final = msgspec.msgpack.Decoder(_RawKVEventBatch)
KV_BATCH_SHAPE: Final = _raw_batch_decoder
"""The bare decoder under `check_kv_batch` (raises RecursionError too), for hot loops."""
_event_decoder: Final = msgspec.msgpack.Decoder(KVEvent)
_array_event_decoder: Final = msgspec.msgpack.Decoder(_array_union)
_metrics_decoder: Final = msgspec.msgpack.Decoder(LoadMetrics)
_connector_decoder: Final = msgspec.msgpack.Decoder(ConnectorBatch)
_control_decoder: Final[msgspec.msgpack.Decoder[ControlEvent]] = msgspec.msgpack.Decoder(
    ControlEvent
)


def _from_array(event: msgspec.Struct) -> KVEvent:
    cls = _FROM_ARRAY[type(event)]
    return cls(**msgspec.structs.asdict(event))


@nesting_is_malformed
def decode_kv_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode a vLLM ``KVEventBatch`` payload in either dialect.

    Returns the batch and how many events in it were skipped because their type is
    unknown or their fields are malformed. Raises ``msgspec.DecodeError`` (or
    ``ValidationError``) when the payload is not a batch at all.
    """
    try:
        return _batch_decoder.decode(payload), 0
    except (ValueError, RecursionError):  # msgspec's errors, bad UTF-8: see below
        pass
    try:
        old = _array_batch_decoder.decode(payload)
        events = [_from_array(e) for e in old.events]
        return KVEventBatch(old.ts, events, old.data_parallel_rank), 0
    except (ValueError, RecursionError):  # msgspec's errors, bad UTF-8: see below
        pass
    # Slow path: keep every event we understand, skip the rest. Past this decode,
    # nothing raises (see `check_kv_batch`): an event nested too deeply or holding a
    # string that is not UTF-8 is skipped too.
    raw = _raw_batch_decoder.decode(payload)
    kept: list[KVEvent] = []
    for item in raw.events:
        try:
            kept.append(_event_decoder.decode(item))
            continue
        except (ValueError, RecursionError):
            pass
        try:
            kept.append(_from_array(_array_event_decoder.decode(item)))
            continue
        except (ValueError, RecursionError):
            pass
        try:
            kept.append(_careful_block_stored(item))
        except (ValueError, RecursionError):
            continue
    return KVEventBatch(raw.ts, kept, raw.data_parallel_rank), len(raw.events) - len(kept)


# A store whose extra keys hold bytes (prompt-embeds digests), which the typed decoders
# refuse: its extra keys are read entry by entry, atom by atom, still never a map.
_RAW_EXTRA_KEYS: Final = list[msgspec.Raw] | None
_careful_stored_decoders: Final = (
    msgspec.msgpack.Decoder(_retyped(BlockStored, "extra_keys", _RAW_EXTRA_KEYS)),
    msgspec.msgpack.Decoder(
        _retyped(_ARRAY_CLASSES[BlockStored], "extra_keys", _RAW_EXTRA_KEYS, array_like=True)
    ),
)
_extra_entry_decoder: Final = msgspec.msgpack.Decoder(tuple[msgspec.Raw, ...] | None)
_extra_item_decoder: Final = msgspec.msgpack.Decoder(_Atom | tuple[msgspec.Raw, ...])
_extra_atom_decoder: Final = msgspec.msgpack.Decoder(_Atom)
_bytes_decoder: Final = msgspec.msgpack.Decoder(bytes)


def _careful_block_stored(item: bytes | msgspec.Raw) -> BlockStored:
    """A ``BlockStored`` (either dialect) whose extra keys may hold bytes; raises
    msgspec's ``ValidationError`` for anything else, a map among its extra keys
    included. O(size of the event)."""
    try:
        event = _careful_stored_decoders[0].decode(item)
    except msgspec.ValidationError:
        event = _careful_stored_decoders[1].decode(item)
    fields = msgspec.structs.asdict(event)
    raws = fields["extra_keys"]
    if raws is not None:
        fields["extra_keys"] = [_extra_entry(r) for r in raws]
    return BlockStored(**fields)


def _extra_entry(raw: msgspec.Raw) -> tuple[Any, ...] | None:
    items = _extra_entry_decoder.decode(raw)
    if items is None:
        return None
    return tuple(_extra_item(r, nested=True) for r in items)


def _extra_item(raw: msgspec.Raw, nested: bool) -> Any:
    """An atom, bytes or (``nested``) an array of those."""
    try:
        value = _extra_item_decoder.decode(raw) if nested else _extra_atom_decoder.decode(raw)
    except msgspec.ValidationError:
        return _bytes_decoder.decode(raw)  # else raises: a map, or arrays too deep
    if isinstance(value, tuple):
        return tuple(_extra_item(r, nested=False) for r in value)
    return value


class RouteEvent(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One router replica's request in flight (the ``routes`` stream), so that replicas
    behind one address count each other's requests as their own: ``routed`` (sent to
    ``worker``, its prompt's block ``keys`` about to be cached there), ``started``
    (streaming: prefill done), ``finished``."""

    ts: float
    request: int
    """The replica's own number for the request."""
    phase: str
    worker: str = ""
    keys: list[int] = []
    """The prompt's chained block keys (`kvbus.routing.index.PrefixIndex.keys`)."""
    prefill_blocks: float = 0.0
    new_blocks: int = 0
    session: int = 0
    """The request's session key (`kvbus.routing.sessions.session_key`; 0: none): the
    other replicas send the session's next requests where this one went."""
    window_ends: list[int] = []
    """For a hybrid model's worker: where its sparse groups keep state once the request
    ran, in blocks (`kvbus.routing.cost.Decision.window_ends`; the first two count)."""


_routes_decoder: Final = msgspec.msgpack.Decoder(RouteEvent)


@nesting_is_malformed
def decode_routes(payload: bytes) -> RouteEvent:
    return _routes_decoder.decode(payload)


def check_kv_batch(payload: bytes) -> None:
    """Raise ``msgspec.DecodeError`` exactly when `decode_kv_batch` would: the payload
    is not a batch (``[ts, [event, ...], rank]`` of well-formed msgpack). About a quarter
    of the cost of decoding it, so that a subscriber can vouch for a batch and leave
    decoding it to whoever reads it."""
    try:
        _raw_batch_decoder.decode(payload)
    except RecursionError:
        raise msgspec.DecodeError("MessagePack data is nested too deeply") from None


@nesting_is_malformed
def decode_metrics(payload: bytes) -> LoadMetrics:
    return _metrics_decoder.decode(payload)


@nesting_is_malformed
def decode_connector(payload: bytes) -> ConnectorBatch:
    return _connector_decoder.decode(payload)


@nesting_is_malformed
def decode_raw(raw: bytes) -> Any:
    """A connector payload (stats, transfer params) as Python values: atoms (None, bool,
    int, float, str), lists and maps keyed by str, int or arrays of str (as tuples),
    nested at most `RAW_DEPTH` levels; ``None`` for an empty payload. Raises
    ``msgspec.DecodeError`` (``ValidationError``) for anything else (bytes, other map
    keys), at the first offending value: a map keyed by arrays of ints, whose tuple keys
    can be made to share one hash, would take quadratic time to build."""
    return _raw_decoder.decode(raw) if raw else None


@nesting_is_malformed
def decode_control(payload: bytes) -> ControlEvent:
    return _control_decoder.decode(payload)


def encode(value: msgspec.Struct) -> bytes:
    """Encode a payload exactly as vLLM's publisher does (default msgpack encoder)."""
    return _encoder.encode(value)


_encoder: Final = msgspec.msgpack.Encoder()
