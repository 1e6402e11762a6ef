"""A real request trace as a routing workload, and an offline model of vLLM's prefix cache.

The trace is Mooncake's conversation trace (``../shared/data/mooncake``, or the slice
kept in ``tests/data``): each request lists its prompt as 512-token block ids, equal ids
meaning identical blocks. `select` takes a slice of it (whole multi-turn conversations
and one-off requests, in trace order), `Workload` maps each id to one engine block of
fixed words (the same id always to the same words, the last block cut to the request's
own length), so prefix structure is preserved exactly on small CPU engines.

`SimEngine` replays what one vLLM engine's prefix cache does with a request (longest
cached prefix, at least one token computed, LRU eviction of free blocks in vLLM's order,
a copy per recomputed block, output blocks cached too) and emits the same
``BlockStored``/``BlockRemoved`` events. It gives the offline bound of a fleet
(`pooled_hit_rate`: one cache as large as all engines together, i.e. a placement that
never stores a block twice) and lets `simulate` drive a `kvbus.routing.router.Router` through a
whole trace without engines.
"""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbus import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Kind,
    KVEventBatch,
    LoadMetrics,
    Message,
)
from kvbus.routing.router import Router

TRACE_BLOCK = 512  # tokens per hash id in the trace
REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared/data/mooncake/conversation_trace.jsonl"
SLICE = REPO / "tests/data/mooncake_slice.jsonl"
VOCAB = range(4, 1024)  # the demo model's words w4..w1023 (w3 starts chat replies)


@dataclass(frozen=True)
class TraceRequest:
    index: int
    """Line of the trace."""
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int

    @property
    def conversation(self) -> tuple[int, ...]:
        """Requests sharing their first two block ids are turns of one conversation."""
        return self.hash_ids[:2]


def load_trace(path: Path | str = DEFAULT_TRACE) -> list[TraceRequest]:
    requests = []
    with open(path) as lines:
        for i, line in enumerate(lines):
            row = json.loads(line)
            requests.append(
                TraceRequest(
                    int(row.get("index", i)),
                    tuple(row["hash_ids"]),
                    int(row["input_length"]),
                    int(row["output_length"]),
                )
            )
    return requests


def select(
    trace: Sequence[TraceRequest],
    requests: int = 200,
    start: int = 0,
    min_turns: int = 4,
    one_off_share: float = 0.2,
) -> list[TraceRequest]:
    """Whole conversations of at least ``min_turns`` turns, taken in order of their first
    turn from line ``start`` on, until they make ``(1 - one_off_share)`` of ``requests``;
    then one-off requests spread evenly over the lines those conversations span. In
    trace order."""
    turns: dict[tuple[int, ...], list[TraceRequest]] = defaultdict(list)
    for request in trace:
        turns[request.conversation].append(request)
    chosen: list[TraceRequest] = []
    for conversation in sorted(turns.values(), key=lambda c: c[0].index):
        if conversation[0].index < start or len(conversation) < min_turns:
            continue
        if len(chosen) >= requests * (1 - one_off_share):
            break
        chosen += conversation
    if not chosen:
        return []
    first, last = min(r.index for r in chosen), max(r.index for r in chosen)
    one_offs = [r for r in trace if first < r.index < last and len(turns[r.conversation]) == 1]
    wanted = requests - len(chosen)
    if wanted > 0 and one_offs:
        step = len(one_offs) / wanted
        chosen += [one_offs[int(i * step)] for i in range(min(wanted, len(one_offs)))]
    return sorted(chosen, key=lambda r: r.index)


@dataclass(frozen=True)
class Prompts:
    """Requests as an engine sees them, in order: each one's prompt and output token ids."""

    block_size: int
    jobs: list[tuple[list[int], list[int]]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt, _ in self.jobs)


class Workload:
    """Token ids (and the same prompt as words) for trace requests on an engine of
    ``block_size`` tokens per block: ``id_tokens`` tokens (default one engine block)
    per trace block id."""

    def __init__(
        self,
        block_size: int = 32,
        max_blocks: int = 48,
        output_tokens: int = 8,
        seed: int = 0,
        id_tokens: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.id_tokens = id_tokens or block_size
        self.max_blocks = max_blocks
        self.output_tokens = output_tokens
        self.seed = seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = random.Random(f"{self.seed}:{hash_id}")
            tokens = self._blocks[hash_id] = [rng.choice(VOCAB) for _ in range(self.id_tokens)]
        return tokens

    def tokens(self, request: TraceRequest) -> list[int]:
        ids = request.hash_ids[: self.max_blocks]
        tokens = [t for h in ids[:-1] for t in self.block(h)]
        # The trace's last block is usually partial: keep the same fraction of ours.
        tail = request.input_length - TRACE_BLOCK * (len(request.hash_ids) - 1)
        if len(ids) < len(request.hash_ids):
            tail = TRACE_BLOCK
        keep = max(1, min(self.id_tokens, round(self.id_tokens * tail / TRACE_BLOCK)))
        return tokens + self.block(ids[-1])[:keep]

    def prompts(self, requests: Iterable[TraceRequest]) -> Prompts:
        return Prompts(
            self.block_size,
            [(self.tokens(r), output_tokens(r, self.output_tokens)) for r in requests],
        )

    def text(self, request: TraceRequest) -> str:
        return " ".join(f"w{t}" for t in self.tokens(request))

    def working_set(self, requests: Iterable[TraceRequest]) -> int:
        """Distinct full prompt blocks (prefixes) of the requests."""
        prefixes: set[int] = set()
        for request in requests:
            prefixes.update(_chain(self.tokens(request), self.block_size))
        return len(prefixes)


Event = BlockStored | BlockRemoved | AllBlocksCleared


class SimEngine:
    """One vLLM engine's prefix cache, request by request (no concurrency).

    Mirrors vLLM v1's block pool: a request reuses the longest cached prefix of full
    blocks, but always computes its last token (a fully cached prompt recomputes its
    last block, into a second copy of it); it takes new blocks from the head of the free
    queue, evicting what they cached; its full blocks (prompt, then output) are cached;
    when it ends its blocks return to the queue's tail, last block first, so a prompt's
    tail is evicted before its head.
    """

    def __init__(self, blocks: int, block_size: int = 32) -> None:
        self.capacity = blocks
        self.block_size = block_size
        self._never_used = 0  # blocks below this were taken once; the rest head the queue
        self._free: OrderedDict[int, None] = OrderedDict()  # freed blocks, LRU first
        self._hash_of: dict[int, int] = {}  # block -> hash it caches
        self._blocks_of: dict[int, list[int]] = defaultdict(list)  # hash -> cached blocks
        self.events: list[Event] = []

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Prompt tokens this engine would find cached (what vLLM reports)."""
        return len(self._hit(tokens)) * self.block_size

    def _hit(self, tokens: Sequence[int]) -> list[int]:
        hashes = _chain(tokens, self.block_size)
        hit = []
        for h in hashes[: (len(tokens) - 1) // self.block_size]:
            blocks = self._blocks_of.get(h)
            if not blocks:
                break
            hit.append(blocks[0])
        return hit

    def serve(self, tokens: Sequence[int], output: Sequence[int]) -> int:
        """Run one request to its end; returns its cached prompt tokens."""
        bs = self.block_size
        hit = self._hit(tokens)
        for block in hit:
            self._free.pop(block, None)  # in use: not evictable
        everything = [*tokens, *output]
        needed = -(-len(everything) // bs) - len(hit)
        new = [self._take() for _ in range(needed)]
        blocks = hit + new
        hashes = _chain(everything, bs)
        parent = hashes[len(hit) - 1] if hit else None
        stored: list[int] = []
        for i in range(len(hit), len(hashes)):
            block, h = blocks[i], hashes[i]
            self._hash_of[block] = h
            self._blocks_of[h].append(block)
            stored.append(h)
        if stored:
            start = len(hit) * bs
            self.events.append(
                BlockStored(
                    stored,
                    parent,
                    list(everything[start : start + len(stored) * bs]),
                    bs,
                    None,
                    "GPU",
                    None,
                )
            )
        for block in reversed(blocks):
            self._free[block] = None
        return len(hit) * bs

    def _take(self) -> int:
        if self._never_used < self.capacity:
            self._never_used += 1
            return self._never_used - 1
        block, _ = self._free.popitem(last=False)
        h = self._hash_of.pop(block, None)
        if h is not None:
            self._blocks_of[h].remove(block)
            if not self._blocks_of[h]:
                del self._blocks_of[h]
            self.events.append(BlockRemoved([h], "GPU"))
        return block

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def clear(self) -> None:
        """Empty the cache, as a restart or ``/reset_prefix_cache`` does."""
        self._never_used = 0
        self._free.clear()
        self._hash_of.clear()
        self._blocks_of.clear()
        self.events.append(AllBlocksCleared())


def _chain(tokens: Sequence[int], block_size: int) -> list[int]:
    hashes, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def output_tokens(request: TraceRequest, count: int) -> list[int]:
    rng = random.Random(f"out:{request.index}")
    return [rng.choice(VOCAB) for _ in range(count)]


def cached_tokens(
    prompts: Prompts,
    engines: Sequence[SimEngine],
    choose: Callable[[int, list[int]], int],
    after: Callable[[int, list[Event]], None] | None = None,
    clears: dict[int, list[int]] | None = None,
) -> list[int]:
    """Each request's cached prompt tokens, ``prompts`` served one at a time, each on
    the engine ``choose(i, tokens)`` picks; ``after(engine, events)`` sees each
    request's events, and those of each engine ``clears[i]`` empties before request
    ``i`` (a restart or a reset)."""
    cached = []
    for i, (tokens, output) in enumerate(prompts.jobs):
        for cleared in (clears or {}).get(i, []):
            engines[cleared].clear()
            if after is not None:
                after(cleared, engines[cleared].take_events())
        engine = choose(i, tokens)
        cached.append(engines[engine].serve(tokens, output))
        if after is not None:
            after(engine, engines[engine].take_events())
    return cached


def hit_rate(
    prompts: Prompts,
    engines: Sequence[SimEngine],
    choose: Callable[[int, list[int]], int],
    after: Callable[[int, list[Event]], None] | None = None,
) -> float:
    """Cached / prompt tokens over ``prompts`` served as `cached_tokens` says."""
    return sum(cached_tokens(prompts, engines, choose, after)) / max(1, prompts.prompt_tokens)


def pooled_hit_rate(prompts: Prompts, blocks: int) -> float:
    """The offline bound: one cache holding ``blocks`` (all engines' together)."""
    return sum(pooled_cached(prompts, blocks)) / max(1, prompts.prompt_tokens)


def pooled_cached(prompts: Prompts, blocks: int) -> list[int]:
    """Each request's cached tokens in `pooled_hit_rate`'s one cache."""
    return cached_tokens(prompts, [SimEngine(blocks, prompts.block_size)], lambda i, t: 0)


def simulate(router: Router, prompts: Prompts, engines: int, blocks: int) -> float:
    """``router`` routing ``prompts`` over ``engines`` simulated engines of ``blocks``
    each (see `simulated_cached`): cached / prompt tokens."""
    cached = simulated_cached(router, prompts, engines, blocks)
    return sum(cached) / max(1, prompts.prompt_tokens)


def simulated_cached(
    router: Router,
    prompts: Prompts,
    engines: int,
    blocks: int,
    clears: dict[int, list[int]] | None = None,
) -> list[int]:
    """Each request's cached tokens with ``router`` routing ``prompts`` over ``engines``
    simulated engines of ``blocks`` each: it is fed their events and an idle load record
    (with their capacity) before every request, as from the bus; ``clears`` as in
    `cached_tokens`."""
    fleet = [SimEngine(blocks, prompts.block_size) for _ in range(engines)]
    names = [f"sim{i}/dp0" for i in range(engines)]
    seqs = [0] * engines
    decisions = []

    def message(engine: int, kind: Kind, body: KVEventBatch | LoadMetrics) -> Message:
        seqs[engine] += 1
        return Message(names[engine], 1, seqs[engine], kind, time.time(), body, b"", 0)

    def choose(i: int, tokens: list[int]) -> int:
        for engine in range(engines):
            idle = LoadMetrics(
                ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0, kv_cache_blocks=blocks
            )
            router.apply_metrics(message(engine, Kind.METRICS, idle))
        decision = router.route(tokens)
        assert decision is not None
        decisions.append(decision)
        return names.index(decision.worker)

    def after(engine: int, events: list[Event]) -> None:
        router.apply_kv(message(engine, Kind.KV, KVEventBatch(time.time(), list(events))))
        if len(decisions) > finished[0]:
            router.finished(decisions[-1])
            finished[0] = len(decisions)

    finished = [0]
    return cached_tokens(prompts, fleet, choose, after, clears)
