"""nats://, hardened (issue 28): a forged pack too large for its positions, retention
options that readers used to impose on everybody, passwords in error messages. Against
a real nats-server that asks for a password, so every log and error is checked for it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import nats
import nats.js.errors
import pytest
from kvbus.transports import Record, open_transport
from kvbus.transports.nats import NatsTransport
from kvbus.transports.packing import MAX_RECORDS, entries_after, position, unpack

import kvbus
from kvbus.config import redact_text

from .conftest import envelope, kv_payload, seqs
from .servers import NatsServer

PASSWORD = "hunter2"


class _PasswordNats(NatsServer):
    def command(self) -> list[str]:
        command = super().command()
        config = self.data_dir / "nats.conf"
        config.write_text(
            config.read_text() + f'authorization {{ user: "admin", password: "{PASSWORD}" }}\n'
        )
        return command

    @property
    def url(self) -> str:
        return f"nats://admin:{PASSWORD}@127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_PasswordNats]:
    server = _PasswordNats(tmp_path_factory.mktemp("nats-password"))
    server.start()
    yield server
    server.stop()


# --- a pack of more than MAX_RECORDS envelopes ------------------------------------------


def test_an_entry_claiming_more_than_max_records_is_one_entry_unread() -> None:
    """Told from the array header alone: a forged count costs nothing to reject, and
    the largest pack a publisher makes still unpacks, its positions inside its entry."""
    forged = b"\xdd" + (MAX_RECORDS + 1).to_bytes(4, "big") + b"\xc4\x00" * 4
    assert unpack(forged) == [forged]
    largest = msgspec.msgpack.encode([b"e"] * MAX_RECORDS)
    entries = list(entries_after(7, largest))
    assert len(entries) == MAX_RECORDS
    assert entries[-1][0] < position(8, 0)
    too_many = msgspec.msgpack.encode([b"e"] * (MAX_RECORDS + 1))
    assert [p for p, _ in entries_after(7, too_many)] == [position(7, 0)]


async def test_a_forged_huge_pack_skips_nobody_after_it(server: _PasswordNats) -> None:
    """A pack of 65,537 envelopes at stream sequence ``o`` gave its last one the
    position ``o << 16 | 65536``, which for an even ``o`` is the next stream message's
    first: a reader resuming from a cursor after the pack skipped another source's next
    message, with no Resync. Now the pack is one malformed entry."""
    stream = "hugepack"
    publisher = kvbus.Publisher(server.url, stream=stream, source="engine-a", max_batch=1)
    for i in (1, 2):
        publisher.publish(kv_payload(i))
        assert publisher.flush()
    client = await nats.connect(server.url)
    pack = [envelope("evil", 1, seq, b"x") for seq in range(1, MAX_RECORDS + 2)]
    ack = await client.jetstream().publish(f"kvbus.{stream}.evil", msgspec.msgpack.encode(pack))
    await client.close()
    assert ack.seq % 2 == 0  # an odd one absorbs the overflowing bit: see the docstring

    first = kvbus.subscribe(stream, server.url, follow=False)
    assert seqs([item async for item in first], "engine-a") == [1, 2, 3]
    assert first.stats.malformed == 1
    cursor = first.cursor
    await first.aclose()

    publisher.publish(kv_payload(4))
    assert publisher.flush()
    resumed = kvbus.subscribe(stream, server.url, follow=False, cursor=cursor)
    items = [item async for item in resumed]
    assert seqs(items, "engine-a") == [4]
    await resumed.aclose()
    publisher.close()


# --- retention is set when a stream is created -------------------------------------------


async def _stored(server: _PasswordNats, stream: str) -> tuple[int, int]:
    """The stream's (stored messages, max_msgs)."""
    client = await nats.connect(server.url)
    info = await client.jetstream().stream_info(f"KVBUS_{stream}")
    await client.close()
    return info.state.messages, info.config.max_msgs or -1


async def test_a_reader_with_retention_options_deletes_nothing(
    server: _PasswordNats, caplog: pytest.LogCaptureFixture
) -> None:
    """One reader opened with ``?max_msgs=2`` used to cut the shared stream to its last
    two messages. Now an existing stream keeps its limits; the difference is logged
    once per process, without the password, and only ``update_stream=1`` applies it."""
    stream = "retention"
    publisher = kvbus.Publisher(server.url, stream=stream, source="engine-a", max_batch=1)
    for i in range(10):
        publisher.publish(kv_payload(i))
        assert publisher.flush()  # one stored message per flush
    stored, _ = await _stored(server, stream)
    assert stored >= 10

    caplog.set_level(logging.WARNING, logger="kvbus.transports.nats")
    for _ in range(2):
        reader = kvbus.subscribe(stream, f"{server.url}?max_msgs=2", follow=False)
        assert seqs([item async for item in reader]) == list(range(1, 12))
        await reader.aclose()
    assert await _stored(server, stream) == (stored, -1)
    kept = [r for r in caplog.records if "keeps its limits" in r.getMessage()]
    assert len(kept) == 1
    assert "max_msgs=-1" in kept[0].getMessage() and "max_msgs=2" in kept[0].getMessage()
    assert PASSWORD not in caplog.text

    operator = kvbus.subscribe(stream, f"{server.url}?max_msgs=2&update_stream=1", follow=False)
    assert seqs([item async for item in operator]) == [10, 11]
    await operator.aclose()
    assert await _stored(server, stream) == (2, 2)
    assert PASSWORD not in caplog.text
    publisher.close()


async def test_a_new_stream_takes_a_readers_limits(server: _PasswordNats) -> None:
    """Options still configure the stream their client creates, whoever that is."""
    reader = kvbus.subscribe("created", f"{server.url}?max_msgs=5&max_age=60", follow=False)
    assert [item async for item in reader] == []
    await reader.aclose()
    assert await _stored(server, "created") == (0, 5)


async def test_a_stream_that_cannot_be_created_is_an_error(server: _PasswordNats) -> None:
    """A refused creation (another stream holds the subjects) was taken for a stream
    created meanwhile: appends were then acknowledged by the foreign stream."""
    client = await nats.connect(server.url)
    await client.jetstream().add_stream(name="FOREIGN", subjects=["kvbus.taken.>"])
    transport = NatsTransport(server.url)
    with pytest.raises(nats.js.errors.BadRequestError, match="overlap"):
        await transport.append("taken", [Record("e", "e:1:1", envelope("e", 1, 1))])
    assert (await client.jetstream().stream_info("FOREIGN")).state.messages == 0
    await transport.aclose()
    await client.close()


# --- credentials never in an error ---------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"nats://admin:{PASSWORD}@127.0.0.1:4222?max_mgs=2",  # a mistyped option
        f"nats://admin:{PASSWORD}@h1:4222,h2:4222?max_msgs=lots",  # a bad value
        f"nats://admin:{PASSWORD}@127.0.0.1:4222?update_stream=maybe",
        f"nats://{PASSWORD}@127.0.0.1:4222?storage=disk",  # a token, and a bad storage
        f"natss://admin:{PASSWORD}@127.0.0.1:4222",  # a mistyped scheme
    ],
)
def test_a_bad_url_is_refused_without_its_password(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        open_transport(url)
    message = str(refused.value)
    assert PASSWORD not in message
    assert "***@" in message  # still says which URL


def test_a_bad_option_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown nats:// options \['max_mgs'\]"):
        open_transport(f"nats://admin:{PASSWORD}@127.0.0.1:4222?max_mgs=2")
    with pytest.raises(ValueError, match="bad nats:// option max_msgs='lots'"):
        open_transport(f"nats://admin:{PASSWORD}@127.0.0.1:4222?max_msgs=lots")


def test_error_text_loses_the_password_in_every_spelling() -> None:
    url = "nats://admin:p%40ss@127.0.0.1:4222"
    text = "connect to admin:p%40ss@127.0.0.1 as admin with p@ss failed; p%40ss"
    redacted = redact_text(text, [url])
    assert "p@ss" not in redacted and "p%40ss" not in redacted
    assert redacted.startswith("connect to ***@127.0.0.1 as admin with *** failed")
