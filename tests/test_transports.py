"""What is particular to one backend (everything common is in test_conformance.py)."""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import nats
import pytest
from kvbus.transports import Record, open_transport
from kvbus.transports.nats import NatsTransport
from kvbus.transports.nats_reader import _sequences
from kvbus.transports.zmq import ZmqTransport

import kvbus
from kvbus import Message, Resync, ResyncReason
from kvbus.wire.envelope import decode_envelope

from .conftest import Item, envelope, kv_payload, last_seq_is, read_until, seqs
from .servers import NatsServer, RedisServer, free_port


def test_unknown_scheme_names_the_known_ones() -> None:
    known = "memory, nats, redis, redis+sentinel, rediss, rediss+sentinel, tls, zmq"
    with pytest.raises(ValueError, match=re.escape(known)):
        open_transport("kafka://x")


def test_zmq_binds_loopback_unless_told_otherwise() -> None:
    default = ZmqTransport("zmq://").endpoints[0]
    assert default.bind(default.port) == "tcp://127.0.0.1:5590"
    everywhere = ZmqTransport("zmq://*:6000").endpoints[0]
    assert everywhere.bind(6000) == "tcp://*:6000"
    assert everywhere.connect(6000) == "tcp://127.0.0.1:6000"


async def test_zmq_several_endpoints_and_a_cursor_across_them() -> None:
    ports = [free_port(pair=True), free_port(pair=True)]
    urls = [f"zmq://127.0.0.1:{p}?timeout=1" for p in ports]
    both = f"zmq://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}?timeout=1"
    publishers = [kvbus.Publisher(u, source=f"engine-{n}") for n, u in enumerate(urls)]
    for i in range(40):
        publishers[i % 2].publish(kv_payload(i))
    for publisher in publishers:
        assert publisher.flush()
    sub = kvbus.subscribe(url=both, follow=False)
    first: list[Item] = []
    async for item in sub:
        first.append(item)
        if len(first) == 15:
            break
    cursor = sub.cursor
    await sub.aclose()
    assert isinstance(cursor.position, str) and cursor.position.count(",") == 1
    rest = [i async for i in kvbus.subscribe(url=both, follow=False, cursor=cursor)]
    for n in range(2):
        assert seqs(first, f"engine-{n}") + seqs(rest, f"engine-{n}") == list(range(1, 22))
    for publisher in publishers:
        publisher.close()


async def test_zmq_live_holes_are_filled_from_the_ring() -> None:
    """High-water marks of 1 make ZeroMQ drop most live frames for a subscriber that is
    not reading; every one is recovered from the publisher's replay ring."""
    url = f"zmq://127.0.0.1:{free_port(pair=True)}?hwm=1&timeout=1"
    publisher = kvbus.Publisher(url, source="engine", max_batch=1)
    sub = kvbus.subscribe(url=url)
    reader = asyncio.create_task(read_until(sub, last_seq_is("engine", 1)))
    publisher.flush()
    await reader
    for i in range(500):
        publisher.publish(kv_payload(i))
    assert publisher.flush()
    await asyncio.sleep(0.5)  # frames pile up (and are dropped) while nobody reads
    items = await read_until(sub, last_seq_is("engine", 501))
    assert seqs(items) == list(range(2, 502))
    assert not [i for i in items if isinstance(i, Resync)]
    await sub.aclose()
    publisher.close()


async def test_zmq_request_older_than_the_ring_gets_history_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"zmq://127.0.0.1:{free_port(pair=True)}?ring=10&timeout=1"
    publisher = kvbus.Publisher(url, source="engine", max_batch=1)
    for i in range(100):
        publisher.publish(kv_payload(i))
        publisher.flush()
    items = [i async for i in kvbus.subscribe(url=url, follow=False, gap_timeout=0.1)]
    assert "history lost" not in caplog.text  # no position asked: oldest retained it is
    assert items[0] == Resync("engine", publisher.epoch, ResyncReason.JOINED, (1, 91))
    assert seqs(items) == list(range(92, 102))
    publisher.close()


async def test_nats_drops_a_message_over_max_payload_and_announces_it(
    nats_server: NatsServer,
) -> None:
    stream = "toolarge"
    publisher = kvbus.Publisher(
        nats_server.url, stream=stream, source="engine", max_message_bytes=32 << 20
    )
    publisher.publish(kv_payload(1))
    publisher.publish(b"\x90" * (9 << 20))  # the test server's max_payload is 8 MB
    publisher.publish(kv_payload(2))
    assert publisher.flush()
    # Announced as dropped, at once: a gap would wait out gap_timeout.
    sub = kvbus.subscribe(stream, nats_server.url, follow=False, gap_timeout=3600)
    items = [i async for i in sub]
    assert seqs(items) == [1, 2, 4]
    assert [(i.reason, i.lost) for i in items if isinstance(i, Resync)] == [
        (ResyncReason.DROPPED, (3, 3))
    ]
    assert publisher.stats.dropped == 1 and sub.stats.gaps_lost == 1
    publisher.close()


async def test_nats_server_drops_a_republished_message(nats_server: NatsServer) -> None:
    """A retried append (same source:epoch:seq) is stored once: Nats-Msg-Id dedup."""
    transport = NatsTransport(nats_server.url)
    records = [Record("engine", f"engine:1:{s}", envelope("engine", 1, s)) for s in (1, 2, 3)]
    await transport.append("dedup", records)
    await transport.append("dedup", records)
    entries = [e async for e in transport.read("dedup")]
    assert len(entries) == 3
    nc = await nats.connect(nats_server.url)
    info = await nc.jetstream().stream_info("KVBUS_dedup")
    assert info.state.messages == 1  # one pack of three
    await nc.close()
    await transport.aclose()


async def test_nats_stream_limits_come_from_the_url(nats_server: NatsServer) -> None:
    url = f"{nats_server.url}?max_age=60&max_bytes=1000000&max_msgs=500&duplicate_window=30"
    transport = NatsTransport(url)
    await transport.append("limits", [Record("e", "e:1:1", envelope("e", 1, 1))])
    nc = await nats.connect(nats_server.url)
    config = (await nc.jetstream().stream_info("KVBUS_limits")).config
    assert (config.max_age, config.max_bytes, config.max_msgs) == (60, 1_000_000, 500)
    assert config.duplicate_window == 30
    assert config.storage == nats.js.api.StorageType.FILE
    assert config.subjects == ["kvbus.limits.>"]
    await nc.close()
    await transport.aclose()
    with pytest.raises(ValueError, match="unknown nats:// options"):
        NatsTransport(f"{nats_server.url}?max_agee=1")


class _PasswordNats(NatsServer):
    def command(self) -> list[str]:
        command = super().command()
        config = self.data_dir / "nats.conf"
        config.write_text(config.read_text() + 'authorization { user: "kv", password: "s3cret" }\n')
        return command


class _PasswordRedis(RedisServer):
    def command(self) -> list[str]:
        return [*super().command(), "--requirepass", "s3cret"]


@pytest.mark.parametrize("server_class", [_PasswordNats, _PasswordRedis])
async def test_credentials_in_the_url(
    server_class: type[NatsServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = server_class(tmp_path)
    server.start()
    try:
        scheme, _, rest = server.url.partition("://")
        user = "kv" if server_class is _PasswordNats else ""
        url = f"{scheme}://{user}:s3cret@{rest}"
        publisher = kvbus.Publisher(url, source="engine")
        publisher.publish(kv_payload(1))
        assert publisher.flush()
        items = [i async for i in kvbus.subscribe(url=url, follow=False)]
        assert seqs(items) == [1, 2]
        publisher.close()
        # Without the password nothing is read; the refusal is logged and retried.
        sub = kvbus.subscribe(url=server.url, follow=False)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sub.__anext__(), 2)
        assert "auth" in caplog.text.lower()
        await sub.aclose()
    finally:
        server.stop()


async def test_redis_entries_hold_packs_and_foreign_entries_are_skipped(
    redis_server: RedisServer,
) -> None:
    import redis.asyncio as redis

    client = redis.Redis.from_url(redis_server.url)
    await client.xadd("kvbus:foreign", {"d": b"not an envelope"})
    await client.xadd("kvbus:foreign", {"d": envelope("engine", 1, 1)})  # unpacked: fine
    await client.aclose()
    items: list[Message | Resync] = []
    sub = kvbus.subscribe("foreign", redis_server.url, follow=False)
    items = [i async for i in sub]
    assert seqs(items) == [1]
    assert sub.stats.malformed == 1


def _make_certificates(directory: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    (directory / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for command in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=ca",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
        "-days 2 -extfile san.cnf",
    ):
        subprocess.run(
            ["openssl", *command.split()], cwd=directory, check=True, capture_output=True
        )


class _TlsNats(NatsServer):
    def command(self) -> list[str]:
        command = super().command()
        config = self.data_dir / "nats.conf"
        config.write_text(
            config.read_text() + f'tls {{ cert_file: "{self.data_dir}/server.pem", '
            f'key_file: "{self.data_dir}/server.key" }}\n'
        )
        return command

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"


class _TlsRedis(RedisServer):
    def command(self) -> list[str]:
        d = self.data_dir
        tls = f"--port 0 --tls-port {self.port} --tls-cert-file {d}/server.pem "
        tls += f"--tls-key-file {d}/server.key --tls-ca-cert-file {d}/ca.pem "
        return [*super().command(), *tls.split(), "--tls-auth-clients", "no"]

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}?ssl_ca_certs={self.data_dir}/ca.pem"


@pytest.mark.parametrize("server_class", [_TlsNats, _TlsRedis])
async def test_tls_through_the_url(
    server_class: type[NatsServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tls:// (nats-py: the default SSL context, which trusts $SSL_CERT_FILE) and
    rediss:// (redis-py: ssl_ca_certs in the URL) carry kvbus over TLS."""
    _make_certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    server = server_class(tmp_path)
    server.start()
    try:
        publisher = kvbus.Publisher(server.url, source="engine")
        publisher.publish(kv_payload(1))
        assert publisher.flush()
        items = [i async for i in kvbus.subscribe(url=server.url, follow=False)]
        assert seqs(items) == [1, 2]
        publisher.close()
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["nats", "redis"])
async def test_a_reader_far_behind_many_small_messages_loses_none(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Thousands of one-message appends from many sources (a fleet of engines at one
    batch per step) read by a slow consumer: every seq arrives, none is announced lost.
    A NATS push consumer used to overflow nats-py's pending limit here and skip
    messages; the pull consumer holds the server back instead."""
    server: NatsServer | RedisServer = request.getfixturevalue(f"{backend}_server")
    stream, sources, per_source = f"behind{backend}", 40, 150
    transport = open_transport(server.url)
    limit = asyncio.Semaphore(100)

    async def one(source: int, seq: int) -> None:
        name = f"engine-{source}"
        record = Record(name, f"{name}:1:{seq}", envelope(name, 1, seq))
        async with limit:
            await transport.append(stream, [record])

    try:
        await asyncio.gather(*(one(s, q) for q in range(1, per_source + 1) for s in range(sources)))
    finally:
        await transport.aclose()
    sub = kvbus.subscribe(stream, server.url)
    items: list[Item] = []

    delivered = 0
    try:
        async with asyncio.timeout(120):
            async for item in sub:
                items.append(item)
                delivered += isinstance(item, Message)
                if delivered == sources * per_source:
                    break
                if delivered % 500 == 0:
                    await asyncio.sleep(0.2)  # the server keeps storing; this reader lags
    finally:
        await sub.aclose()
    assert not [i for i in items if isinstance(i, Resync)]
    for s in range(sources):
        assert seqs(items, f"engine-{s}") == list(range(1, per_source + 1))
    assert sub.stats.transport_errors == 0


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.kvbus_kv.c1.1.4711.42.1732350000000000000.9",
        "$JS.ACK.hub.ACCHASH.kvbus_kv.c1.1.4711.42.1732350000000000000.9",
        "$JS.ACK.hub.ACCHASH.kvbus_kv.c1.1.4711.42.1732350000000000000.9.rAnd0m",
    ],
)
def test_nats_sequences_from_either_reply_subject_form(reply: str) -> None:
    """The read takes a delivery's sequences from its reply subject itself (nats-py's
    metadata is the slow way): the plain form and the one with a JetStream domain and
    account hash agree with nats-py's, and anything else still raises nats-py's error."""
    msg = nats.aio.msg.Msg(None, reply=reply)  # type: ignore[arg-type]
    expected = (msg.metadata.sequence.stream, msg.metadata.sequence.consumer)
    assert _sequences(nats.aio.msg.Msg(None, reply=reply)) == expected == (4711, 42)  # type: ignore[arg-type]
    with pytest.raises(nats.errors.NotJSMessageError):
        _sequences(nats.aio.msg.Msg(None, reply="_INBOX.abc.1"))  # type: ignore[arg-type]


async def test_nats_read_recovers_a_delivery_lost_on_the_way(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A delivery the client never sees (dropped by a slow-consumer limit or a dying
    connection) is noticed from the consumer's delivery count, and the read resumes
    right after the last message it took: nothing skipped, nothing twice."""
    from nats.aio.client import Client

    stream = "lostdelivery"
    transport = NatsTransport(nats_server.url)
    try:
        for seq in range(1, 301):
            record = Record("engine", f"engine:1:{seq}", envelope("engine", 1, seq))
            await transport.append(stream, [record])
    finally:
        await transport.aclose()
    real = Client._process_msg
    # Lost: the first deliveries of seqs 40 and 41, then 200 from the consumer that
    # replaced the first one (whose delivery count no longer equals the stream seq).
    to_drop = {(40, True), (41, True), (200, False)}

    async def drop_some(self: Client, sid: int, subject: bytes, reply: bytes, *rest: bytes) -> None:
        if reply.startswith(b"$JS.ACK."):
            # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<delivery seq>...
            stream_seq, delivery_seq = map(int, reply.split(b".")[5:7])
            if (stream_seq, stream_seq == delivery_seq) in to_drop:
                to_drop.discard((stream_seq, stream_seq == delivery_seq))
                return
        await real(self, sid, subject, reply, *rest)

    monkeypatch.setattr(Client, "_process_msg", drop_some)
    reader = NatsTransport(nats_server.url)
    try:
        with caplog.at_level("INFO", "kvbus.transports.nats"):
            entries = [e async for e in reader.read(stream)]
    finally:
        await reader.aclose()
    assert [decode_envelope(e.data).seq for e in entries] == list(range(1, 301))
    assert not to_drop
    assert caplog.text.count("skipped deliveries") == 2  # after 39, then after 199
