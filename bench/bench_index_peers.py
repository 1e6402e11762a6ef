"""kvbus's PrefixIndex beside NVIDIA Dynamo's RadixTree, same events, same queries, same run.

The workload of bench/bench_index.py: W workers each cache P of N distinct 4k-token
prompts (sharing an 8-block system prompt), stored as 16-block ``BlockStored`` events
chained by engine hashes; then each worker evicts a quarter of its prompts as 16-block
``BlockRemoved`` events, leaves first; then Q queries of 4k-token prompts.

* kvbus: `PrefixIndex.apply_events` on the events as the subscriber hands them over
  (decoded structs; the index hashes the tokens into its chained keys), `match` of the
  prompt's tokens (hashing included).
* kvbus, decoded just before: the same events from their msgpack bytes, each decoded
  just before its apply, off the clock: in cache, as in a router, whose subscriber hands
  each batch over right after decoding it (above, all events are decoded first, and
  most are out of cache when applied).
* kvbus, bytes read just before: `PrefixIndex.apply_payload` of each batch's wire bytes,
  decoding timed (as a router applies what its subscription delivers: token ids read
  packed into the keys, no int object per token); the bytes read through just before,
  off the clock (in cache, as just received). Dynamo's apply parses its bytes on the
  clock too: this row and *Dynamo, bytes read just before* do the same job.
* kvbus, decoded on the clock: the same bytes decoded into structs (`decode_kv_batch`,
  as the subscriber does when a consumer reads ``Message.body``) and applied, both
  timed: a router's way in before `apply_payload`.
* kvbus, Python kernels: the first row with the index's per-block loops in Python
  (``kvbus/routing/_kernels.py``, the fallback where the C ones did not build).
* kvbus, keys hashed before: the same, with each event's keys computed before the clock
  starts (Dynamo's conditions: its publisher sends each block's token hash), so its
  store rate is what the index's dict work alone costs.
* Dynamo (ai-dynamo-runtime, `scripts/install.sh peers`): ``RadixTree.apply_event`` on the
  same events in its JSON form, encoded before the clock starts (its local block hashes,
  XXH3 of each block's tokens, computed then too); ``find_matches`` of the prompt's local
  hashes, timed with ``compute_block_hash_for_seq`` (as kvbus's match hashes) and alone
  (*lookup*; kvbus's: `match_keys` of keys hashed before). *Dynamo, bytes read just
  before*: each event's bytes read through just before its apply (in cache, as kvbus's
  decoded ones).
  It runs in a subprocess with .venv-peers' python, which pins Dynamo's own deps; when
  Dynamo is missing, the kvbus rows print and the peer row says so. That process is
  pinned to one core (``--dynamo-any-core``: not): RadixTree serves every call from a
  thread of its own, and a wake-up across cores makes each call ~10x slower here.

Memory: RSS growth while storing, per stored (worker, block), in the first run (later
ones reuse the memory it freed). Medians over --repeats (a fresh index each), range in
brackets.

``--against REV`` adds rows for kvbus/routing/index.py (and its parts) as of git
revision REV, taking turns with the current one (before/after on the same noise).

Run: python bench/bench_index_peers.py [--workers 1000] [--repeats 5] [--against REV]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
BLOCK = 32
PROMPT_BLOCKS = 128  # 4k tokens
EVENT_BLOCKS = 16
SYSTEM_BLOCKS = 8
# One stored or removed event: (worker, prompt, first block, end block). Engine hashes
# follow the content, as vLLM's do: the system prompt's blocks are 0-7 in every prompt,
# a prompt's own blocks prompt * 1000 + block; the same on every worker (engines that
# share a hash seed). A worker stores the system prompt once (later prompts hit it).
Step = tuple[int, int, int, int]


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[Step], list[Step], list[int]]:
    """Prompts, stored events, removed events and query prompts: only the standard
    library, so that the Dynamo child builds exactly the parent's workload."""
    rng = random.Random(1)
    vocab = args.vocab
    system = [rng.randrange(vocab) for _ in range(8 * BLOCK)]
    pool = [
        system + [rng.randrange(vocab) for _ in range((PROMPT_BLOCKS - 8) * BLOCK)]
        for _ in range(args.prompts)
    ]
    stores: list[Step] = []
    removals: list[Step] = []
    for worker in range(args.workers):
        prompts = rng.sample(range(args.prompts), args.per_worker)
        for n, prompt in enumerate(prompts):
            first = 0 if n == 0 else SYSTEM_BLOCKS
            stores += [
                (worker, prompt, b, min(b + EVENT_BLOCKS, PROMPT_BLOCKS))
                for b in range(first, PROMPT_BLOCKS, EVENT_BLOCKS)
            ]
        for prompt in prompts[1 : 1 + args.per_worker // 4]:  # leaves first
            removals += [
                (worker, prompt, max(b, SYSTEM_BLOCKS), b + EVENT_BLOCKS)
                for b in reversed(range(0, PROMPT_BLOCKS, EVENT_BLOCKS))
            ]
    queries = [rng.randrange(args.prompts) for _ in range(args.queries)]
    return pool, stores, removals, queries


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's size (bench_index.py runs the same one; here, as the
    Dynamo child imports it without kvbus)."""
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--per-worker", type=int, default=16, help="4k prompts cached each")
    parser.add_argument("--prompts", type=int, default=2000, help="distinct 4k prompts")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument(
        "--vocab",
        type=int,
        default=128_256,
        help="token ids drawn below this (Llama 3's vocabulary; before 2026-11-23: 256)",
    )


def engine_hash(prompt: int, block: int) -> int:
    return block if block < SYSTEM_BLOCKS else prompt * 1000 + block


def engine_hashes(prompt: int, first: int, end: int) -> list[int]:
    return [engine_hash(prompt, b) for b in range(first, end)]


def blocks(steps: list[Step]) -> int:
    return sum(end - first for _, _, first, end in steps)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(
    apply: Callable[[Any], None],
    items: list[Any],
    blocks: int,
    prepare: Callable[[Any], Any] | None = None,
) -> tuple[float, int]:
    """(blocks/s, RSS growth in bytes) of applying ``items`` one by one; with
    ``prepare``, each item goes through it just before its apply, off the clock."""
    # The harness's own events stay out of the collector's scans (as a router's
    # decoded events do: they are gone once applied).
    gc.collect()
    gc.freeze()
    before = rss_bytes()
    clock = time.perf_counter
    if prepare is None:
        start = clock()
        for item in items:
            apply(item)
        elapsed = clock() - start
    else:
        elapsed = 0.0
        for item in items:
            ready = prepare(item)
            start = clock()
            apply(ready)
            elapsed += clock() - start
    return blocks / elapsed, rss_bytes() - before


def latencies(query: Callable[[int], object], prompts: list[int]) -> list[float]:
    out = []
    for prompt in prompts:
        start = time.perf_counter_ns()
        query(prompt)
        out.append((time.perf_counter_ns() - start) / 1000)
    return sorted(out)


def one_run(
    build: Callable[[], Any],
    apply: Callable[[Any, Any], None],
    stores: list[tuple[Step, Any]],
    removals: list[tuple[Step, Any]],
    queries: dict[str, Callable[[Any, int], object]],
    prompts: list[int],
    prepare: Callable[[Any], Any] | None = None,
) -> dict[str, float]:
    index = build()
    stored = blocks([step for step, _ in stores])
    store_rate, grown = timed(
        lambda item: apply(index, item), [e for _, e in stores], stored, prepare
    )
    removed = blocks([step for step, _ in removals])
    remove_rate, _ = timed(
        lambda item: apply(index, item), [e for _, e in removals], removed, prepare
    )
    result = {"store": store_rate, "remove": remove_rate, "bytes": grown / stored}
    for name, query in queries.items():
        found = latencies(lambda p: query(index, p), prompts)  # noqa: B023
        result[f"{name} p50"] = statistics.median(found)
        result[f"{name} p99"] = found[int(len(found) * 0.99)]
    return result


def medians(runs: list[dict[str, float]]) -> dict[str, tuple[float, float, float]]:
    out = {k: (statistics.median(r[k] for r in runs), *_span(r[k] for r in runs)) for k in runs[0]}
    # Later runs reuse the memory the first one freed: its growth is the one that counts.
    out["bytes"] = (runs[0]["bytes"],) * 3
    return out


def _span(values: Iterator[float]) -> tuple[float, float]:
    listed = list(values)
    return min(listed), max(listed)


# --- Dynamo, in the peers' python --------------------------------------------------------


def dynamo_child(args: argparse.Namespace) -> None:
    # Each RadixTree runs its tree in a thread of its own, and every call is a round trip
    # to it: on this VM a wake-up across cores costs tens of µs, 10x the apply itself
    # (~0.26M blocks/s against ~3.0M). One core for both threads: its best case.
    if not args.dynamo_any_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from dynamo._core import RadixTree, compute_block_hash_for_seq  # type: ignore[import-not-found]

    pool, stores, removals, queries = workload(args)
    local = [compute_block_hash_for_seq(tokens, BLOCK) for tokens in pool]
    event_ids: dict[int, int] = {}

    def encoded(worker: int, data: object) -> tuple[int, bytes]:
        event_ids[worker] = event_ids.get(worker, 0) + 1
        return worker, json.dumps({"event_id": event_ids[worker], "data": data}).encode()

    stored = [
        (
            (worker, prompt, first, end),
            encoded(
                worker,
                {
                    "stored": {
                        "parent_hash": engine_hash(prompt, first - 1) if first else None,
                        "blocks": [
                            {"block_hash": engine_hash(prompt, b), "tokens_hash": local[prompt][b]}
                            for b in range(first, end)
                        ],
                    }
                },
            ),
        )
        for worker, prompt, first, end in stores
    ]
    removed = [
        (
            (worker, prompt, first, end),
            encoded(worker, {"removed": {"block_hashes": engine_hashes(prompt, first, end)}}),
        )
        for worker, prompt, first, end in removals
    ]

    def read(item: tuple[int, bytes]) -> tuple[int, bytes]:
        item[1].count(b"{")  # every byte read: in cache, as if just received
        return item

    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for _ in range(args.repeats):
        for mode, prepare in (("cold", None), ("warm", read)):
            runs[mode].append(
                one_run(
                    RadixTree,
                    lambda tree, item: tree.apply_event(*item),
                    stored,
                    removed,
                    {
                        "match": lambda tree, p: (
                            tree.find_matches(compute_block_hash_for_seq(pool[p], BLOCK)).scores
                        ),
                        "lookup": lambda tree, p: tree.find_matches(local[p]).scores,
                    },
                    queries,
                    prepare,
                )
            )
    print(json.dumps(runs))


def run_dynamo(args: argparse.Namespace) -> dict[str, list[dict[str, float]]] | str:
    """Dynamo's runs, or why there are none."""
    if not PEERS_PYTHON.exists():
        return f"missing: no {PEERS_PYTHON} (bash scripts/install.sh peers)"
    probe = subprocess.run(
        [str(PEERS_PYTHON), "-c", "import dynamo._core"], capture_output=True, check=False
    )
    if probe.returncode:
        return "missing: ai-dynamo-runtime is not in .venv-peers (bash scripts/install.sh peers)"
    argv = [a for a in sys.argv[1:] if a != "--child"]
    child = subprocess.run(
        [str(PEERS_PYTHON), __file__, "--child", *argv], capture_output=True, text=True
    )
    if child.returncode:
        return f"failed: {child.stderr.strip().splitlines()[-1:]}"
    runs: dict[str, list[dict[str, float]]] = json.loads(child.stdout)
    return runs


# --- kvbus ---------------------------------------------------------------------------


def run_kvbus(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    sys.path.insert(0, str(REPO))
    import msgspec

    import kvbus.routing.index as index_module
    from kvbus import BlockRemoved, BlockStored, KVEventBatch
    from kvbus.routing import _kernels
    from kvbus.routing.index import PrefixIndex, block_keys
    from kvbus.wire.events import decode_kv_batch

    pool, stores, removals, queries = workload(args)

    def stored_event(prompt: int, first: int, end: int) -> BlockStored:
        hashes: list[int | bytes] = list(engine_hashes(prompt, first, end))
        tokens = pool[prompt][first * BLOCK : end * BLOCK]
        parent = engine_hash(prompt, first - 1) if first else None
        return BlockStored(hashes, parent, tokens, BLOCK, None, "GPU", None)

    # As the subscriber hands them over: one worker's events of one step at a time.
    stored = [(s, (f"worker-{s[0]}/dp0", [stored_event(*s[1:])])) for s in stores]
    removed = [
        (s, (f"worker-{s[0]}/dp0", [BlockRemoved(list(engine_hashes(*s[1:])), "GPU")]))
        for s in removals
    ]
    keys = {p: block_keys(pool[p], BLOCK) for p in set(queries)}
    # The same events as their wire bytes (one KVEventBatch each).
    encode = msgspec.msgpack.Encoder().encode
    wire = {
        "stored": [(s, (w, encode(KVEventBatch(0.0, e)))) for s, (w, e) in stored],
        "removed": [(s, (w, encode(KVEventBatch(0.0, e)))) for s, (w, e) in removed],
    }

    def decoded(item: tuple[str, bytes]) -> tuple[str, list[Any]]:
        return item[0], decode_kv_batch(item[1])[0].events

    def read(item: tuple[str, bytes]) -> tuple[str, bytes]:
        item[1].count(b"\x00")  # every byte read: in cache, as if just received
        return item

    def decode_and_apply(index: PrefixIndex, item: tuple[str, bytes]) -> None:
        index.apply_events(item[0], decode_kv_batch(item[1])[0].events)

    def apply_events(index: PrefixIndex, item: tuple[str, list[Any]]) -> None:
        index.apply_events(*item)

    def apply_payload(index: PrefixIndex, item: tuple[str, bytes]) -> None:
        index.apply_payload(*item)

    # name: (build, what is applied, how, prepared how off the clock, Python kernels)
    structs = {"stored": stored, "removed": removed}
    plain = (structs, apply_events, None, False)
    builds: dict[str, tuple[Any, Any, Any, Any, bool]] = {
        "kvbus PrefixIndex": (PrefixIndex, *plain),
        "kvbus, decoded just before": (PrefixIndex, wire, apply_events, decoded, False),
        "kvbus, bytes read just before": (PrefixIndex, wire, apply_payload, read, False),
        "kvbus, decoded on the clock": (PrefixIndex, wire, decode_and_apply, read, False),
        "kvbus, keys hashed before": (keys_hashed_before(PrefixIndex, stored), *plain),
    }
    if index_module.kernels is not _kernels:
        builds["kvbus, Python kernels"] = (PrefixIndex, structs, apply_events, None, True)
    for revision in args.against:
        builds[f"kvbus PrefixIndex @{revision}"] = (index_at(revision), *plain)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    compiled = index_module.kernels
    for _ in range(args.repeats):  # the revisions take turns: the same noise for each
        for name, (build, events, apply, prepare, python_kernels) in builds.items():
            index_module.use_kernels(_kernels if python_kernels else compiled)
            runs[name].append(
                one_run(
                    lambda: build(BLOCK),  # noqa: B023
                    apply,
                    events["stored"],
                    events["removed"],
                    {
                        "match": lambda index, p: index.match(pool[p]),
                        "lookup": lambda index, p: index.match_keys(keys[p]),
                    },
                    queries,
                    prepare,
                )
            )
    index_module.use_kernels(compiled)
    return runs


def keys_hashed_before(index_class: Any, stored: list[tuple[Step, Any]]) -> Any:
    """A build of ``index_class`` with each event's keys hashed before the clock starts,
    as Dynamo's are (its publisher sends each block's token hash): what the index's dict
    work alone costs. The keys are the very ones the index computes (recorded in a pass
    at the first build, in this process: the same hash key; after the plain index's
    first run, whose memory growth is the one reported), shared between workers as it
    shares them, and handed out in the order the events apply (the same every run)."""
    recorded: list[list[int]] = []

    class Recording(index_class):  # type: ignore[misc,valid-type]
        def _plain_keys(self, data: bytes, parent: int, block_size: int) -> list[int]:
            keys: list[int] = super()._plain_keys(data, parent, block_size)
            recorded.append(keys)
            return keys

    class KeysGiven(index_class):  # type: ignore[misc,valid-type]
        def __init__(self, block_size: int) -> None:
            super().__init__(block_size)
            self._given = iter(recorded)

        def _stored(self, worker: str, event: Any, data: bytes | None = None) -> None:
            super()._stored(worker, event, b"")  # no token bytes: the keys are given

        def _plain_keys(self, data: bytes, parent: int, block_size: int) -> list[int]:
            return next(self._given)

    def build(block_size: int) -> Any:
        if not recorded:
            recording = Recording(block_size)
            for _, (worker, events) in stored:
                recording.apply_events(worker, events)
        return KeysGiven(block_size)

    return build


INDEX_PARTS = ("index_keys", "index_holders", "index_feed", "index_match")
"""The modules kvbus/routing/index.py imports its parts from (since the issue-30 split),
in the order they import each other."""


def index_at(revision: str) -> Any:
    """``PrefixIndex`` as kvbus/routing/index.py and its parts (`INDEX_PARTS`, where the revision
    has them) were at git ``revision``, the rest of kvbus as now. Each part is put in
    place of the current one while the next ones load, so they import each other as of
    ``revision``."""
    from bench_core import module_at  # this script's directory

    import kvbus.routing

    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", revision, "kvbus/routing/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    parts = [name for name in INDEX_PARTS if f"kvbus/routing/{name}.py" in listed]
    saved = {name: sys.modules[f"kvbus.routing.{name}"] for name in parts}
    try:
        for name in parts:
            part = module_at(revision, f"kvbus/routing/{name}.py")
            sys.modules[f"kvbus.routing.{name}"] = part  # as the next part imports it
            setattr(kvbus.routing, name, part)
        # Before the subpackages (kvbus 0.2) the index was one module, kvbus/index.py:
        # module_at finds it under its old path.
        return module_at(revision, "kvbus/routing/index.py").PrefixIndex
    finally:
        for name, module in saved.items():
            sys.modules[f"kvbus.routing.{name}"] = module
            setattr(kvbus.routing, name, module)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--against",
        nargs="*",
        default=[],
        metavar="REV",
        help="also kvbus/routing/index.py (and its parts) as of these git revisions (before/after)",
    )
    parser.add_argument(
        "--dynamo-any-core",
        action="store_true",
        help="let Dynamo's tree thread run on another core than its caller (not pinned)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dynamo_child(args)
        return
    _, stores, removals, _ = workload(args)
    stored = blocks(stores)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; {args.workers} workers, {stored:,} blocks stored "
        f"then {blocks(removals):,} removed in {EVENT_BLOCKS}-block events, "
        f"{args.prompts} distinct 4k prompts, {args.queries} queries; "
        f"medians of {args.repeats} (range)"
    )
    rows = [(name, medians(runs)) for name, runs in run_kvbus(args).items()]
    kvbus = rows[0][1]
    dynamo = run_dynamo(args)
    if isinstance(dynamo, str):
        print(f"Dynamo RadixTree: {dynamo}")
    else:
        rows.append(("Dynamo, bytes read just before", medians(dynamo["warm"])))
        rows.append(("Dynamo RadixTree", medians(dynamo["cold"])))
    columns = ["store", "remove", "match p50", "match p99", "lookup p50", "bytes"]
    print(f"\n{'index (blocks/s; µs)':32}" + "".join(f"{c:>32}" for c in columns))
    for name, figures in rows:
        cells = []
        for column in columns:
            if column not in figures:
                cells.append(f"{'-':>32}")
                continue
            mid, low, high = figures[column]
            fmt = "{:,.0f}" if column in ("store", "remove") else "{:,.1f}"
            cell = fmt.format(mid)
            if low != high:
                cell += f" ({fmt.format(low)}-{fmt.format(high)})"
            cells.append(f" {cell:>31}")
        print(f"{name:32}" + "".join(cells))
    named = dict(rows)
    new, old = named["kvbus, bytes read just before"], named["kvbus, decoded on the clock"]
    print(
        "\nkvbus from bytes: apply_payload / decode_kv_batch + apply_events: "
        + ", ".join(f"{c} {new[c][0] / old[c][0]:.2f}x" for c in ("store", "remove"))
    )
    if not isinstance(dynamo, str):
        theirs = rows[-1][1]
        print(
            "\nkvbus / Dynamo: "
            + ", ".join(
                f"{c} {kvbus[c][0] / theirs[c][0]:.2f}x"
                for c in ("store", "remove", "match p50", "match p99", "bytes")
            )
            + " (rates: higher is better; latencies, bytes: lower is better)"
        )
        for ours, peer in (
            ("kvbus, bytes read just before", "Dynamo, bytes read just before"),
            ("kvbus, decoded just before", "Dynamo, bytes read just before"),
            ("kvbus, keys hashed before", "Dynamo RadixTree"),
        ):
            print(
                f"{ours} / {peer}: "
                + ", ".join(
                    f"{c} {named[ours][c][0] / named[peer][c][0]:.2f}x" for c in ("store", "remove")
                )
            )


if __name__ == "__main__":
    main()
