"""The ``kvbus`` command: ``kvbus tail`` prints a stream as JSON lines; ``kvbus demo``
runs a publisher and a subscriber on the embedded bus and prints what arrives; ``kvbus
bridge`` forwards stock vLLM ZMQ publishers; ``kvbus router`` runs the KV-aware router
in front of vLLM servers (`kvbus.gateway`); ``kvbus top`` shows the fleet's workers live
(`kvbus.top`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvbus.config import redact_url
from kvbus.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConnectorBatch,
    KVEventBatch,
    decode_raw,
)
from kvbus.publisher import Publisher
from kvbus.subscribe import Cursor, Message, Resync, subscribe

_json = msgspec.json.Encoder()


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


async def _tail(args: argparse.Namespace) -> int:
    cursor_file = Path(args.cursor_file) if args.cursor_file else None
    cursor: Any = "latest" if args.latest else None
    if cursor_file and cursor_file.exists():
        cursor = Cursor.from_bytes(cursor_file.read_bytes())
    out = sys.stdout.buffer
    async with subscribe(
        args.stream, args.url, args.source or None, cursor, follow=not args.no_follow
    ) as sub:
        try:
            async for item in sub:
                out.write(as_json(item) + b"\n")
                out.flush()
                if cursor_file:
                    cursor_file.write_bytes(sub.cursor.to_bytes())
        finally:
            if cursor_file:
                cursor_file.write_bytes(sub.cursor.to_bytes())
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
            if isinstance(item, Resync):
                print(f"resync   {item.source} epoch={item.epoch} {item.reason.value}")
                blocks.clear()
                continue
            line = f"{item.kind.name.lower():8} {item.source} seq={item.seq:<4}"
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
        print(
            f"delivered {sub.stats.delivered} messages, {sub.stats.resyncs} resyncs, "
            f"{sub.stats.duplicates} duplicates; cursor {sub.cursor.to_bytes().decode()}"
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
    await run_bridges(endpoints, replays, sources, args.url, args.stream)
    return 0


async def _compact(args: argparse.Namespace) -> int:
    from kvbus.compact import compact

    return await compact(args.url, args.stream, args.interval, follow=not args.once)


async def _top(args: argparse.Namespace) -> int:
    from kvbus import top

    return await top.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbus")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    tail = commands.add_parser("tail", help="print a stream as JSON lines")
    tail.add_argument("--url", help="transport URL (default $KVBUS_URL, else memory://)")
    tail.add_argument("--stream", help="stream name (default $KVBUS_STREAM, else kv)")
    tail.add_argument("--source", action="append", help="only this source (repeatable)")
    tail.add_argument("--latest", action="store_true", help="start at the next message")
    tail.add_argument("--no-follow", action="store_true", help="stop at the end of history")
    tail.add_argument("--cursor-file", help="resume from and save the cursor in this file")

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
    bridge.add_argument("--to", dest="url", help="transport URL (default $KVBUS_URL)")
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
    compact.add_argument("--url", help="transport URL (default $KVBUS_URL, else memory://)")
    compact.add_argument("--stream", help="stream name (default $KVBUS_STREAM, else kv)")
    compact.add_argument(
        "--interval", type=float, default=10.0, help="seconds between snapshots (default 10)"
    )
    compact.add_argument(
        "--once", action="store_true", help="fold to the end of the stream, store, and stop"
    )

    from kvbus import top

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
            from kvbus import gateway
        except ImportError as missing:
            raise SystemExit(
                f"kvbus router needs: pip install 'kvbus[router]' ({missing})"
            ) from None
        gateway.add_arguments(router)

    args = parser.parse_args(argv)
    if args.command == "router":
        return gateway.serve(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    run = {"tail": _tail, "demo": _demo, "bridge": _bridge, "compact": _compact, "top": _top}[
        args.command
    ]
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
