"""`kvbus sim`: a fleet of simulated vLLM engines in one process.

Engine ``i`` serves vLLM's OpenAI API on ``PORT+i`` and publishes its KV events and
load on the bus as a real engine started with ``KVBUS_SOURCE=PREFIX{i}`` does (sources
``PREFIX{i}/dp0``), and vLLM's own ZMQ KV events on ``ZMQ_PORT+i`` (replay on
``ZMQ_REPLAY_PORT+i``) when asked, so routers and consumers run in front of it exactly
as in front of real engines (`tests/test_sim_routers.py`, ``examples/router_demo.py
--sim``)::

    kvbus sim --engines 16 --port 8100 --kv-blocks 2048 --block-size 16 \\
        --model DIR --url nats://127.0.0.1:4222
    kvbus router --url nats://127.0.0.1:4222 --worker sim-0=http://127.0.0.1:8100 ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Final

from kvbus.sim.timing import DEFAULT_PROFILE, PROFILES, TimingModel, load_profile

if TYPE_CHECKING:  # vLLM, aiohttp, transformers: loaded by `Fleet.start`, not for --help
    from aiohttp import web

    from kvbus.sim.engine import SimEngine

log = logging.getLogger("kvbus.sim")
CONNECT_WAVE: Final = 32
"""Engines whose publishers connect at once at start."""
CONNECT_WITHIN: Final = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=1, help="simulated engines (default 1)")
    parser.add_argument("--port", type=int, required=True, help="engine i serves HTTP on PORT+i")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument(
        "--kv-blocks", type=int, required=True, help="KV cache blocks of each engine"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument(
        "--model", required=True,
        help="model directory: its config.json shapes the engine, its tokenizer reads prompts",
    )  # fmt: skip
    parser.add_argument("--served-model-name", help="the model's name in the API (default --model)")
    parser.add_argument(
        "--url", help="publish KV events and load on this bus (default $KVBUS_URL; none: off)"
    )
    parser.add_argument(
        "--source-prefix", default="sim-",
        help="engine i publishes as source PREFIX{i}/dp0 (default sim-)",
    )  # fmt: skip
    parser.add_argument(
        "--zmq-port", type=int,
        help="engine i also publishes vLLM's own ZMQ KV events on tcp://HOST:ZMQ_PORT+i",
    )  # fmt: skip
    parser.add_argument(
        "--zmq-replay-port", type=int,
        help="with --zmq-port: engine i answers replay requests for missed ZMQ events on "
        "tcp://HOST:ZMQ_REPLAY_PORT+i (vLLM's replay_endpoint; default none)",
    )  # fmt: skip
    parser.add_argument(
        "--enable-scale-out", action="store_true",
        help="serve /v1/completions/render and /v1/chat/completions/render, as vLLM's "
        "--enable-scale-out does (vllm-router reads prompts' token ids there)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", default=DEFAULT_PROFILE,
        help=f"step timing: one of {', '.join(PROFILES)}, or a JSON file of the five numbers "
        f"(see kvbus/sim/timing.py) (default {DEFAULT_PROFILE})",
    )  # fmt: skip
    parser.add_argument(
        "--speedup", type=float, default=1.0,
        help="run this many times faster than the profile's hardware (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--slow", action="append", type=_slow, default=[], metavar="ENGINE=FACTOR",
        help="engine number ENGINE (0..N-1) takes FACTOR times the profile's time for each "
        "step (FACTOR > 0; 2: twice as slow, 0.5: twice as fast); repeatable, one per engine",
    )  # fmt: skip
    parser.add_argument("--max-model-len", type=int, help="vLLM's --max-model-len")
    parser.add_argument(
        "--max-num-seqs", type=int,
        help="vLLM's --max-num-seqs (default: vLLM's for the profile's GPU, else this platform's)",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="vLLM's --max-num-batched-tokens"
    )


def _slow(text: str) -> tuple[int, float]:
    """``--slow ENGINE=FACTOR`` read (the engine's range is checked against --engines
    by `_check`)."""
    engine, sep, factor = text.partition("=")
    try:
        index, times = int(engine), float(factor)
    except ValueError:
        index, times = -1, float("nan")
    if not sep or index < 0 or not 0 < times < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: want ENGINE=FACTOR, an engine number >= 0 and a factor > 0 "
            "(e.g. 3=2: engine 3 twice as slow)"
        )
    return index, times


def slowdowns(args: argparse.Namespace) -> dict[int, float]:
    """Engine number -> its ``--slow`` factor (engines not named: 1)."""
    return dict(getattr(args, "slow", None) or [])


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.engines <= 10_000:
        raise SystemExit("kvbus sim: --engines must be in [1, 10000]")
    last = args.port + args.engines - 1
    if not 1 <= args.port or last > 65535:
        raise SystemExit(f"kvbus sim: ports {args.port}..{last} are not all valid")
    if args.zmq_port is not None and not (
        1 <= args.zmq_port and args.zmq_port + args.engines <= 65536
    ):
        raise SystemExit("kvbus sim: --zmq-port range is not valid")
    if args.zmq_replay_port is not None and (
        args.zmq_port is None
        or not (1 <= args.zmq_replay_port and args.zmq_replay_port + args.engines <= 65536)
    ):
        raise SystemExit("kvbus sim: --zmq-replay-port needs --zmq-port and a valid range")
    if args.block_size < 1 or args.kv_blocks < 2:
        raise SystemExit("kvbus sim: --block-size >= 1 and --kv-blocks >= 2")
    named: set[int] = set()
    for engine, factor in args.slow or []:
        if engine >= args.engines:
            raise SystemExit(
                f"kvbus sim: --slow {engine}={factor:g}: no engine {engine} "
                f"(engines are numbered 0..{args.engines - 1})"
            )
        if engine in named:
            raise SystemExit(f"kvbus sim: --slow names engine {engine} twice")
        named.add(engine)


def _raise_file_limit(engines: int) -> None:
    """Each engine holds a listening socket, its publishers' connections and event loops."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 64 + 16 * engines
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class Fleet:
    """The engines and their HTTP servers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engines: list[SimEngine] = []
        self.runners: list[web.AppRunner] = []

    async def start(self) -> None:
        from aiohttp import web

        from kvbus.service.served_model import Tokenizer
        from kvbus.sim.api import EngineAPI
        from kvbus.sim.engine import BusOptions, SimEngine
        from kvbus.sim.engine_core import EngineShape, engine_config

        args = self.args
        profile = load_profile(args.profile)
        shape = EngineShape(
            model=args.model,
            kv_blocks=args.kv_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs or profile.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or profile.max_num_batched_tokens,
            served_model_name=args.served_model_name,
        )
        config = await asyncio.to_thread(engine_config, shape)
        tokenizer = await asyncio.to_thread(Tokenizer, args.model)
        slow = slowdowns(args)
        url = args.url or os.environ.get("KVBUS_URL") or None
        name = args.served_model_name or args.model
        for i in range(args.engines):
            zmq_port = None if args.zmq_port is None else args.zmq_port + i
            replay = None if args.zmq_replay_port is None else args.zmq_replay_port + i
            host = f"[{args.host}]" if ":" in args.host else args.host
            bus = BusOptions(url, zmq_port, args.host, replay, f"http://{host}:{args.port + i}")
            timing = TimingModel(profile, args.speedup, slow.get(i, 1.0))
            engine = SimEngine(f"{args.source_prefix}{i}", config, timing, bus, name)
            self.engines.append(engine)
            api = EngineAPI(engine, tokenizer, args.model, scale_out=args.enable_scale_out)
            # A client that leaves aborts its request, as vLLM's server does
            # (``with_cancellation`` on its generate routes): an abandoned request must
            # not take the engine's steps.
            runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True)
            await runner.setup()
            self.runners.append(runner)
            await web.TCPSite(runner, args.host, args.port + i).start()
            engine.start()
            if len(self.engines) % CONNECT_WAVE == 0:
                await self._connected(self.engines[-CONNECT_WAVE:])
        await self._connected(self.engines[-(len(self.engines) % CONNECT_WAVE or 1) :])

    async def _connected(self, engines: list[SimEngine]) -> None:
        """Wait (up to `CONNECT_WITHIN` s) until ``engines``' publishers have sent their
        ``SourceStarted``: the next wave connects only then. Two thousand connections
        opened at once on a busy machine time out and retry for minutes (seen once in
        five 1,000-engine starts, bench/bench_sim.py); a few dozen at a time do not."""
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(len(engines) or 1) as waiting:
            await asyncio.gather(
                *(loop.run_in_executor(waiting, e.flush, CONNECT_WITHIN) for e in engines)
            )

    async def close(self) -> None:
        """Every engine ends its epoch at once: a SIGTERM leaves `kvbus.cli`'s grace
        (1 s), and one publisher's close takes milliseconds, so hundreds of engines
        closed a few at a time would leave most of them unannounced."""
        await asyncio.gather(*(r.cleanup() for r in self.runners), return_exceptions=True)
        with ThreadPoolExecutor(min(512, max(1, 2 * len(self.engines)))) as closing:
            await asyncio.gather(*(e.close(closing) for e in self.engines), return_exceptions=True)


async def run(args: argparse.Namespace) -> int:
    _check(args)
    try:
        load_profile(args.profile)
    except ValueError as error:
        raise SystemExit(f"kvbus sim: {error}") from None
    _raise_file_limit(args.engines)
    fleet = Fleet(args)
    try:
        try:
            await fleet.start()
        except ValueError as error:  # a shape vLLM would refuse too
            raise SystemExit(f"kvbus sim: {error}") from None
        first, last = args.port, args.port + args.engines - 1
        where = args.url or os.environ.get("KVBUS_URL") or "no bus"
        slow = "".join(f", engine {i} steps x{f:g}" for i, f in sorted(slowdowns(args).items()))
        print(
            f"kvbus sim: {args.engines} engines on http://{args.host}:{first}..{last} "
            f"(sources {args.source_prefix}0/dp0..), publishing to "
            f"{_redacted(where)}; profile {args.profile}, speedup {args.speedup:g}{slow}",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.Event().wait()
    finally:
        await fleet.close()
    return 0


def _redacted(url: str) -> str:
    from kvbus.config import redact_url

    return redact_url(url) if "://" in url else url
