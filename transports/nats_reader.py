"""Reading a nats:// stream: its messages in order through an ephemeral pull consumer,
one pull request in flight, each delivery checked and a lost one read again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, Final
from urllib.parse import unquote

from kvbus.transports import Entry
from kvbus.transports.nats_admin import probe
from kvbus.transports.packing import entries_after
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

log = logging.getLogger("kvbus.transports.nats")

_IDLE_CHECK: Final = 1.0  # seconds between a finite read's looks at the stream's end
_HEARTBEAT: Final = 0.5  # seconds between the server's heartbeats to an idle pull request
_PULL_BATCH: Final = 1024  # messages one pull request asks for
_PULL_BYTES: Final = 8 << 20  # bytes one pull request asks for (at least 2 max_payloads)
_PULL_EXPIRES: Final = 30.0  # seconds the server holds a pull request that found nothing
_CONSUMER_IDLE: Final = 120.0  # seconds without a pull request before a consumer is removed


async def read_pages(
    nc: Client,
    js: JetStreamContext,
    name: str,
    stream: str,
    start: int | None,
    skip: int,
    end: int,
    follow: bool,
    reconnects: Callable[[], int],
) -> AsyncIterator[list[Entry]]:
    """The stream's messages from ``start`` in order, through an ephemeral pull
    consumer: one pull request at a time, so at most one request's messages wait in
    this client (a push consumer keeps sending to a reader that fell behind until
    nats-py's pending limit drops messages). Each message's delivery count is
    checked; a skipped one (lost in a reconnect) recreates the consumer after the
    last message read, so nothing is skipped silently. ``reconnects()``: how many times
    the connection came back so far (a pull request in flight may have died with it)."""
    wake = asyncio.Event()
    request_bytes = max(_PULL_BYTES, 2 * nc.max_payload)
    request = _pull_request(request_bytes)

    async def open_inbox() -> tuple[Subscription, collections.deque[Msg]]:
        """A new inbox for each consumer: what a replaced consumer still sends
        (messages, its "Consumer Deleted" status) goes to its own, unread."""
        arrived: collections.deque[Msg] = collections.deque()

        async def receive(msg: Msg) -> None:
            arrived.append(msg)
            wake.set()

        sub = await nc.subscribe(
            nc.new_inbox(),
            cb=receive,
            pending_msgs_limit=4 * _PULL_BATCH,
            pending_bytes_limit=8 * request_bytes,
        )
        return sub, arrived

    sub, arrived = await open_inbox()
    consumer: str | None = None
    delivered = 0  # the consumer's delivery count of the last message taken
    pulling = False  # a pull request is in flight
    taken = 0  # messages it brought so far
    reconnected = reconnects()
    seen = (start or 1) - 1
    prefix = f"kvbus.{stream}."
    loop = asyncio.get_running_loop()
    heard = loop.time()  # when the consumer last sent anything, heartbeats included
    checked = heard  # when a read without follow last looked at the stream's end
    patience = 2 * _HEARTBEAT  # how long to wait for the consumer before looking
    try:
        while True:
            if consumer is None:
                if delivered or pulling:  # replacing one
                    await quietly(sub.unsubscribe())
                    sub, arrived = await open_inbox()
                consumer = await _pull_consumer(
                    js, name, stream, seen + 1 if seen or start is not None else None
                )
                delivered, pulling, heard = 0, False, loop.time()
            if not pulling or reconnected != reconnects():
                # The request in flight ended, or may have died with a connection.
                reconnected = reconnects()
                await nc.publish(
                    f"$JS.API.CONSUMER.MSG.NEXT.{name}.{consumer}",
                    request,
                    reply=sub.subject,
                )
                pulling, taken = True, 0
            if not arrived:
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(patience):
                        await wake.wait()
                now = loop.time()
                if not arrived and now - heard > 2 * _HEARTBEAT:
                    # Two heartbeats missed: the consumer died with its server (or
                    # the stream's leader), or the request with a connection. Read
                    # on with a new consumer as soon as the stream answers again
                    # (a cluster electing a leader: asked every ~0.1-0.5 s).
                    if await probe(js, name) is None:
                        patience = 0.1
                    else:
                        log.info("kvbus: nats consumer of %s silent; a new one", name)
                        consumer, patience = None, 2 * _HEARTBEAT
                elif not follow and now - checked > _IDLE_CHECK:
                    # Messages up to the end may have been deleted meanwhile.
                    checked = now
                    state = await probe(js, name)
                    if state is not None and (seen >= end or state.first_seq > end):
                        return
                continue
            heard = loop.time()
            page: list[Entry] = []
            while arrived:
                msg = arrived.popleft()
                if msg.headers and (status := msg.headers.get("Status")):
                    if status == "100":
                        continue  # a heartbeat: the consumer and the request live
                    if status == "503" or "Deleted" in msg.headers.get("Description", ""):
                        # Nobody serves the consumer: it died with its server, or
                        # was removed after a long pause of this reader.
                        log.info("kvbus: nats consumer of %s gone (%s)", name, status)
                        consumer = None
                        break
                    if status == "409" and taken == 0:
                        if "MaxBytes" in msg.headers.get("Description", ""):
                            # The next message is larger than a request may bring.
                            request_bytes *= 2
                            request = _pull_request(request_bytes)
                    pulling = False  # 404, 408, 409: the request ended
                    continue
                sequence, consumer_sequence = _sequences(msg)
                if consumer_sequence != delivered + 1:
                    log.info(
                        "kvbus: nats read of %s skipped deliveries; resuming after %d",
                        name,
                        seen,
                    )
                    await quietly(js.delete_consumer(name, consumer))
                    consumer = None
                    break
                delivered += 1
                taken += 1
                pulling = taken < _PULL_BATCH
                if start is not None and sequence > seen + 1 and seen == start - 1:
                    log.warning(
                        "kvbus: nats %s history lost: asked from %d, oldest retained %d",
                        name,
                        start,
                        sequence,
                    )
                # The subject's token is the source its publisher was allowed to
                # send as.
                sender = unquote(msg.subject[len(prefix) :])
                for position, data in entries_after(
                    sequence, msg.data, skip if sequence == start else -1
                ):
                    page.append(Entry(position, data, sender))
                seen = sequence
                if not follow and seen >= end:
                    break
            if page:
                yield page
            if not follow and seen >= end:
                return
    finally:
        await quietly(sub.unsubscribe())
        if consumer is not None:
            await quietly(js.delete_consumer(name, consumer))


async def _pull_consumer(js: JetStreamContext, name: str, stream: str, start: int | None) -> str:
    """A new ephemeral pull consumer of the whole stream from ``start`` (None: the
    oldest message), held in the server's memory: the reader keeps its position."""
    consumer = f"kvbus-{os.urandom(8).hex()}"
    await js.add_consumer(
        name,
        config=api.ConsumerConfig(
            name=consumer,
            deliver_policy=api.DeliverPolicy.ALL
            if start is None
            else api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.NONE,
            filter_subject=f"kvbus.{stream}.>",
            inactive_threshold=_CONSUMER_IDLE,
            num_replicas=1,
            mem_storage=True,
        ),
    )
    return consumer


def _pull_request(max_bytes: int) -> bytes:
    """A pull request's body: up to a batch of messages or ``max_bytes``, held by the
    server while nothing is stored, with heartbeats meanwhile."""
    return json.dumps(
        {
            "batch": _PULL_BATCH,
            "max_bytes": max_bytes,
            "expires": int(_PULL_EXPIRES * 1e9),
            "idle_heartbeat": int(_HEARTBEAT * 1e9),
        }
    ).encode()


def _sequences(msg: Msg) -> tuple[int, int]:
    """A JetStream delivery's (stream sequence, consumer sequence), read from its reply
    subject: ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>...``
    (9 tokens), or with a domain and an account hash after ``ACK`` (11 or more). nats-py's
    ``msg.metadata`` builds a datetime and three dataclasses: 2.7 µs against 0.4, a
    fifth of a message's read. Any other subject takes nats-py's way (and its error)."""
    tokens = (msg.reply or "").split(".")
    if tokens[:2] == ["$JS", "ACK"]:
        if len(tokens) == 9:
            return int(tokens[5]), int(tokens[6])
        if len(tokens) >= 11:
            return int(tokens[7]), int(tokens[8])
    metadata = msg.metadata
    return metadata.sequence.stream, metadata.sequence.consumer


async def quietly(call: Any) -> None:
    try:
        async with asyncio.timeout(2):
            await call
    except Exception as error:
        log.debug("kvbus: nats cleanup: %r", error)
