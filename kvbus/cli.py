"""The ``kvbus`` command: ``kvbus tail`` prints a stream as JSON lines; ``kvbus demo``
runs a publisher and a subscriber on the embedded bus and prints what arrives; ``kvbus
bridge`` forwards stock vLLM ZMQ publishers; ``kvbus router`` runs the KV-aware router
in front of vLLM servers (`kvbus.service.gateway`); ``kvbus top`` shows the fleet's workers live
(`kvbus.ops.top`).

The commands that talk to other processes (all but ``demo``) read ``--url``, else
``$KVBUS_URL``, else the local NATS server (`kvbus.config.DEFAULT_COMMAND_URL`), and say
on stderr which bus they use and when it does not answer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Final

import msgspec

from kvbus.bus.publisher import Publisher
from kvbus.bus.subscription import Cursor, Message, Resync, subscribe
from kvbus.config import (
    describe_bus,
    redact_url,
    resolve_command_url,
    resolve_stream,
)
from kvbus.logs import LimitedLog, displayable, terminal_safe_json
from kvbus.ops.console import URL_HELP, say, say_if_unreachable
from kvbus.transports import BackendUnusable
from kvbus.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConnectorBatch,
    KVEventBatch,
    decode_raw,
)
from kvbus.wire.snapshot import DEFAULT_MAX_BLOCKS, DEFAULT_MAX_COPIES

_json = msgspec.json.Encoder()
_limited = LimitedLog(logging.getLogger("kvbus.cli"))

DEFAULT_CURSOR_INTERVAL: Final = 1.0
"""Seconds between saves of ``kvbus tail --cursor-file`` (``--cursor-interval``)."""
SHUTDOWN_GRACE: Final = 1.0
"""Seconds a command has to stop cleanly after SIGTERM before the process exits anyway."""
TERMINATED: Final = 128 + signal.SIGTERM
"""The exit status after SIGTERM (143, as a shell reports a process SIGTERM ended)."""


def as_json(item: Message | Resync) -> bytes:
    """One JSON object per message (block hashes given as bytes come out base64)."""
    if isinstance(item, Resync):
        return _json.encode({"type": "resync", **msgspec.structs.asdict(item)})
    return _json.encode(
        {
            "type": "message",
            "source": item.source,
            "epoch": item.epoch,
            "seq": item.seq,
            "kind": item.kind.name.lower(),
            "ts": item.ts,
            "position": item.position,
            # Batches are arrays on the wire; named fields read better in JSON.
            "body": {"type": type(item.body).__name__, **_fields(item.body)},
        }
    )


def _fields(body: msgspec.Struct) -> dict[str, Any]:
    fields = msgspec.structs.asdict(body)
    if isinstance(body, ConnectorBatch):
        fields["transfers"] = [
            {**msgspec.structs.asdict(t), "params": _raw_json(t.params)} for t in body.transfers
        ]
        if body.stats is not None:
            stats = msgspec.structs.asdict(body.stats)
            stats["workers"] = _raw_json(body.stats.workers)
            stats["scheduler"] = _raw_json(body.stats.scheduler)
            fields["stats"] = stats
    return dict(msgspec.to_builtins(fields))


def _raw_json(raw: bytes) -> Any:
    """A raw connector payload for JSON: maps keyed by arrays (vLLM's offloading stats
    key series by label tuples) get the key written as a JSON array string."""
    try:
        return _string_keys(decode_raw(raw))
    except (msgspec.DecodeError, RecursionError) as error:
        return {"malformed": str(error)[:200]}


def _string_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else _json.encode(k).decode(): _string_keys(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_string_keys(v) for v in value]
    return value


class CursorFile:
    """Where ``kvbus tail --cursor-file`` keeps its place.

    The cursor is saved at most every ``interval`` seconds while items arrive, and once
    more when the tail stops; never per item (a cursor names every source: 0.6 ms to
    write at 3,000 of them). Each save writes a temporary file in the same directory and
    renames it over the old one, so the file always holds one whole cursor. A clean stop
    (the end of the history, Ctrl-C, SIGTERM) saves the cursor after the last item
    printed; after a crash (kill -9, power loss) the tail resumes from the last save and
    prints again what came in up to ``interval`` seconds before the crash."""

    def __init__(self, path: Path, interval: float = DEFAULT_CURSOR_INTERVAL) -> None:
        self.path = path
        self.interval = max(0.0, interval)
        self.writes = 0
        """Saves that wrote the file (a cursor equal to the one saved is not written)."""
        self._saved: bytes | None = None

    def load(self) -> Cursor | None:
        """The saved cursor, or None when there is no file yet."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            cursor = Cursor.from_bytes(data)
        except (msgspec.DecodeError, ValueError) as error:
            raise SystemExit(f"kvbus tail: {self.path} holds no cursor: {error}") from None
        self._saved = data
        return cursor

    def save(self, cursor: Cursor) -> None:
        data = cursor.to_bytes()
        if data == self._saved:
            return
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, self.path)  # a reader sees the old cursor or the new one
        self._saved = data
        self.writes += 1

    async def keep_saving(self, cursor: Callable[[], Cursor]) -> None:
        """Save ``cursor()`` every ``interval`` seconds, until cancelled. It runs only
        while the tail waits for its next item, so every item it covers is printed. A
        save that fails is logged and tried again (the one at exit raises)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.save(cursor())
            except OSError as error:
                _limited.warning("cursor_file", "kvbus tail: cursor not saved: %s", error)


async def _tail(args: argparse.Namespace) -> int:
    cursor_file = None
    cursor: Any = "latest" if args.latest else None
    if args.cursor_file:
        cursor_file = CursorFile(Path(args.cursor_file), args.cursor_interval)
        cursor = cursor_file.load() or cursor
    url, origin = resolve_command_url(args.url)
    try:
        stream = resolve_stream(args.stream)
    except ValueError as error:
        raise SystemExit(f"kvbus tail: {error}") from None
    say(f"kvbus tail: reading stream {stream} from {describe_bus(url, origin)}")
    out = sys.stdout.buffer
    async with subscribe(
        stream, url, args.source or None, cursor, follow=not args.no_follow
    ) as sub:
        saving = None
        if cursor_file is not None:
            saving = asyncio.create_task(cursor_file.keep_saving(lambda: sub.cursor))
        watching = asyncio.create_task(say_if_unreachable("tail", url, lambda: [sub.stats]))
        try:
            async for item in sub:
                # JSON escapes C0 controls only: a name from the network must not reach
                # a terminal with C1 controls or bidi overrides in it.
                out.write(terminal_safe_json(as_json(item)) + b"\n")
                out.flush()
        finally:
            watching.cancel()
            if cursor_file is not None and saving is not None:
                saving.cancel()
                cursor_file.save(sub.cursor)  # before the close, which may take a while
    return 0


def synthetic_steps(steps: int, block_size: int = 16, seed: int = 0) -> list[KVEventBatch]:
    """Engine-like batches: requests sharing a few prefixes, with evictions."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(block_size * 4)] for _ in range(4)]
    cached: list[int | bytes] = []
    batches = []
    next_hash = 1
    for _ in range(steps):
        tokens = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(block_size * 2)]
        hashes: list[int | bytes] = list(range(next_hash, next_hash + len(tokens) // block_size))
        next_hash += len(hashes)
        events: list[Any] = [
            BlockStored(
                hashes, cached[-1] if cached else None, tokens, block_size, None, "GPU", None
            )
        ]
        cached += hashes
        if len(cached) > 64:
            evicted, cached = cached[:8], cached[8:]
            events.append(BlockRemoved(evicted, "GPU"))
        batches.append(KVEventBatch(time.time(), events, 0))
    batches.append(KVEventBatch(time.time(), [AllBlocksCleared()], 0))
    return batches


async def _demo(args: argparse.Namespace) -> int:
    url = args.url or "memory://demo"
    print(
        f"kvbus demo: publisher and subscriber on {redact_url(url)}, stream {args.stream or 'kv'}"
    )
    with Publisher(url, stream=args.stream, source="demo-engine") as publisher:
        for batch in synthetic_steps(args.steps):
            publisher.publish(batch)
    blocks: set[int | bytes] = set()
    async with subscribe(args.stream, url, cursor=None, follow=False) as sub:
        async for item in sub:
            source = displayable(item.source)  # the URL may name any bus
            if isinstance(item, Resync):
                print(f"resync   {source} epoch={item.epoch} {item.reason.value}")
                blocks.clear()
                continue
            line = f"{item.kind.name.lower():8} {source} seq={item.seq:<4}"
            if isinstance(item.body, KVEventBatch):
                for event in item.body.events:
                    if isinstance(event, BlockStored):
                        blocks.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        blocks.difference_update(event.block_hashes)
                    else:
                        blocks.clear()
                names = ",".join(type(e).__name__ for e in item.body.events)
                line += f" events={names} cached_blocks={len(blocks)}"
            else:
                line += f" {type(item.body).__name__}"
            print(line)
        cursor = terminal_safe_json(sub.cursor.to_bytes()).decode()
        print(
            f"delivered {sub.stats.delivered} messages, {sub.stats.resyncs} resyncs, "
            f"{sub.stats.duplicates} duplicates; cursor {cursor}"
        )
    return 0


async def _bridge(args: argparse.Namespace) -> int:
    from kvbus.connectors.vllm_bridge import run_bridges

    endpoints: list[str] = args.endpoints
    replays: list[str | None] = list(args.replay) + [None] * (len(endpoints) - len(args.replay))
    sources = list(args.source) + [e.rpartition("/")[2] for e in endpoints[len(args.source) :]]
    if len(replays) != len(endpoints) or len(sources) != len(endpoints):
        raise SystemExit("kvbus bridge: give at most one --replay and --source per --from")
    if args.metrics_port is not None:
        from kvbus.metrics import serve_http

        port = serve_http(args.metrics_port, args.metrics_host)
        print(f"kvbus bridge: metrics on http://{args.metrics_host}:{port}/metrics", flush=True)
    url, origin = resolve_command_url(args.url)
    say(f"kvbus bridge: forwarding {len(endpoints)} vLLM publishers to {describe_bus(url, origin)}")
    await run_bridges(endpoints, replays, sources, url, args.stream)
    return 0


def _positive(convert: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse ``type``: ``convert``, refusing zero and negative values."""

    def positive(text: str) -> float:
        value = convert(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    positive.__name__ = convert.__name__  # argparse names it in "invalid int value"
    return positive


async def _compact(args: argparse.Namespace) -> int:
    from kvbus.ops.compact import compact

    url, origin = resolve_command_url(args.url)
    try:
        stream = resolve_stream(args.stream)
    except ValueError as error:
        raise SystemExit(f"kvbus compact: {error}") from None
    what = "once" if args.once else f"every {args.interval:g} s"
    say(
        f"kvbus compact: folding stream {stream} of {describe_bus(url, origin)}, "
        f"snapshots stored {what}"
    )
    return await compact(
        url,
        stream,
        args.interval,
        follow=not args.once,
        max_copies=args.max_copies,
        max_blocks=args.max_blocks,
    )


async def _sim(args: argparse.Namespace) -> int:
    from kvbus.sim import fleet

    return await fleet.run(args)


async def _top(args: argparse.Namespace) -> int:
    from kvbus.ops import top

    return await top.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbus")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    tail = commands.add_parser("tail", help="print a stream as JSON lines")
    tail.add_argument("--url", help=URL_HELP)
    tail.add_argument("--stream", help="stream name (default $KVBUS_STREAM, else kv)")
    tail.add_argument("--source", action="append", help="only this source (repeatable)")
    tail.add_argument("--latest", action="store_true", help="start at the next message")
    tail.add_argument("--no-follow", action="store_true", help="stop at the end of history")
    tail.add_argument("--cursor-file", help="resume from and save the cursor in this file")
    tail.add_argument(
        "--cursor-interval", type=float, default=DEFAULT_CURSOR_INTERVAL,
        help="seconds between saves of --cursor-file, also saved at exit; after a crash "
        "the items of the last interval are printed again (default 1)",
    )  # fmt: skip

    demo = commands.add_parser("demo", help="publish and subscribe on the embedded bus")
    demo.add_argument("--url", help="transport URL (default memory://demo)")
    demo.add_argument("--stream")
    demo.add_argument("--steps", type=int, default=12, help="engine steps to publish")

    bridge = commands.add_parser(
        "bridge", help="forward stock vLLM ZMQ KV events to kvbus (no plugin needed)"
    )
    bridge.add_argument(
        "--from", dest="endpoints", action="append", required=True,
        help="vLLM's PUB endpoint, e.g. tcp://HOST:5557 (repeat for several engines/ranks)",
    )  # fmt: skip
    bridge.add_argument(
        "--replay", action="append", default=[],
        help="vLLM's replay endpoint, e.g. tcp://HOST:5558 (one per --from, in order)",
    )  # fmt: skip
    bridge.add_argument(
        "--source", action="append", default=[],
        help="kvbus source name per --from (default: HOST:PORT of the endpoint)",
    )  # fmt: skip
    bridge.add_argument("--to", dest="url", help=URL_HELP)
    bridge.add_argument("--stream", help="stream name (default $KVBUS_STREAM, else kv)")
    bridge.add_argument(
        "--metrics-port", type=int, help="serve the bus's Prometheus series on this port"
    )
    bridge.add_argument(
        "--metrics-host", default="127.0.0.1", help="address for --metrics-port (default loopback)"
    )

    compact = commands.add_parser(
        "compact", help="fold the kv stream and store snapshots for late consumers"
    )
    compact.add_argument("--url", help=URL_HELP)
    compact.add_argument("--stream", help="stream name (default $KVBUS_STREAM, else kv)")
    compact.add_argument(
        "--interval", type=_positive(float), default=10.0,
        help="seconds between snapshot writes, made on time whether items arrive or not, "
        "of the sources that changed (default 10)",
    )  # fmt: skip
    compact.add_argument(
        "--once", action="store_true", help="fold to the end of the stream, store, and stop"
    )
    compact.add_argument(
        "--max-copies", type=_positive(int), default=DEFAULT_MAX_COPIES,
        help="copies of one block a source's fold counts; stores past it are not counted "
        f"(reported as capped copies) (default {DEFAULT_MAX_COPIES})",
    )  # fmt: skip
    compact.add_argument(
        "--max-blocks", type=_positive(int), default=DEFAULT_MAX_BLOCKS,
        help="cached block copies a source may claim in all; one that claims more gets no "
        "snapshot until it clears its cache or restarts (reported as overflowed sources) "
        f"(default {DEFAULT_MAX_BLOCKS})",
    )  # fmt: skip

    from kvbus.ops import top

    top.add_arguments(
        commands.add_parser("top", help="a live view of the workers: blocks, hit rate, load, lag")
    )

    router = commands.add_parser(
        "router", help="the KV- and load-aware OpenAI-compatible router for vLLM servers"
    )
    words = sys.argv[1:] if argv is None else argv
    if "router" in words:
        # aiohttp, numpy, transformers (the router extra): imported only for the router.
        try:
            from kvbus.service import gateway
        except ImportError as missing:
            raise SystemExit(
                f"kvbus router needs: pip install 'kvbus[router]' ({missing})"
            ) from None
        gateway.add_arguments(router)

    sim = commands.add_parser(
        "sim", help="a fleet of simulated vLLM engines (vLLM's scheduler, modelled step times)"
    )
    if "sim" in words:
        # vLLM, aiohttp and transformers: imported only for the simulator.
        from kvbus.sim import fleet

        fleet.add_arguments(sim)

    args = parser.parse_args(argv)
    if args.command == "router":
        return gateway.serve(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    run = {
        "tail": _tail,
        "demo": _demo,
        "bridge": _bridge,
        "compact": _compact,
        "top": _top,
        "sim": _sim,
    }[args.command]
    if args.command == "sim":
        # Each engine ends two epochs (kv, metrics) at SIGTERM, a few ms of CPU each:
        # a thousand engines need seconds, not the 1 s the other commands get.
        return run_command(run, args, SHUTDOWN_GRACE + args.engines / 100)
    return run_command(run, args)


Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def run_command(command: Command, args: argparse.Namespace, grace: float = SHUTDOWN_GRACE) -> int:
    """``command(args)`` in a new event loop; its exit status.

    Ctrl-C cancels it (130). So does SIGTERM (143), which ends the process within
    ``grace`` seconds whatever the command does with the cancellation (a client
    library can swallow one mid-command, and ``asyncio.run`` then waits for ever); a
    second SIGTERM ends it at once."""
    termination = _Termination(grace)
    with termination.handled():
        try:
            status = asyncio.run(termination.cancels(command(args)))
        except KeyboardInterrupt:
            return 130
        except BackendUnusable as error:  # a set-up mistake: what to do, no traceback
            print(f"kvbus {args.command}: {error}", file=sys.stderr)
            return 1
    return TERMINATED if termination.requested else status


class _Termination:
    """SIGTERM as a cancellation of the command, with a deadline."""

    def __init__(self, grace: float = SHUTDOWN_GRACE) -> None:
        self.grace = grace
        self.requested = False
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may set signal handlers: leave them alone
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    async def cancels(self, command: Coroutine[Any, Any, int]) -> int:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        if self.requested:  # SIGTERM before the loop ran
            command.close()
            return TERMINATED
        try:
            return await command
        except asyncio.CancelledError:
            if self.requested:
                return TERMINATED
            raise

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # A Python signal handler runs between two bytecodes of the main thread, even
        # one blocked writing to a full pipe: the deadline is armed here, not on the
        # event loop, which that thread may not get back to.
        if self.requested:
            _exit_now("kvbus: second SIGTERM, exiting now")
        self.requested = True
        deadline = threading.Timer(
            self.grace,
            _exit_now,
            (f"kvbus: not stopped {self.grace:g} s after SIGTERM, exiting now",),
        )
        deadline.daemon = True
        deadline.start()
        task, loop = self._task, self._loop
        if task is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)


def _exit_now(why: str) -> None:
    # Unbuffered: the main thread may hold sys.stderr's lock, stuck in a write.
    os.write(2, f"{why}\n".encode())
    os._exit(TERMINATED)


if __name__ == "__main__":
    sys.exit(main())
