"""The publisher's sender, run by its thread's event loop: takes batches from the
`SendQueue`, wraps each message in an `Envelope` with its gap marker, and appends them
to the transport, retrying while the backend is down; a message that cannot be sent is
dropped, counted and announced to consumers."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvbus.bus.instruments import LatencyHistogram
from kvbus.bus.retry import log_failure, retry_forever
from kvbus.config import redact_url
from kvbus.shutdown import CLOSE_WITHIN, cancel_sticks
from kvbus.transports import Record, RecordTooLarge, Transport
from kvbus.wire.envelope import SCHEMA_VERSION, Envelope, Kind, decode_envelope, encode_envelope
from kvbus.wire.events import LossNotice, encode

if TYPE_CHECKING:
    from kvbus.bus.publisher_queue import Queued, SendQueue
    from kvbus.bus.publisher_stats import PublisherStats

log = logging.getLogger("kvbus.bus.publisher")


class Sender:
    """Sends what ``queue`` holds, as ``source``'s epoch ``epoch``, to ``stream``.

    ``settled`` counts the messages publish() accepted that were sent or dropped since:
    ``Publisher.flush`` waits for it to reach ``stats.published``.
    """

    def __init__(
        self,
        queue: SendQueue,
        transport: Transport,
        stats: PublisherStats,
        latency: LatencyHistogram,
        *,
        url: str,
        stream: str,
        source: str,
        epoch: int,
        max_message_bytes: int,
        start_after: int = 0,
        on_sent: Callable[[int, int], object] | None = None,
    ) -> None:
        self._queue = queue
        self._transport = transport
        self.stats = stats
        self._latency = latency
        self._url = url
        self._stream = stream
        self._source = source
        self._epoch = epoch
        self._max_message_bytes = max_message_bytes
        self.last_sent = start_after
        """The newest seq sent; at first, the epoch's seqs up to here were sent by
        another (a relay taking over)."""
        self._inline_append = transport.inline_append
        self._inline_lock = threading.Lock()
        self._on_sent = on_sent
        """Told the newest seq the transport took and how many messages it took, after
        each append."""
        self.settled = 0
        self._sending: asyncio.Task[None] | None = None

    async def run(self) -> None:
        # A task whose cancel sticks: the backend's client may swallow the cancel close()
        # sends when it gives up (kvbus.shutdown), and the sender must end all the same.
        self._sending = cancel_sticks(self._send_forever(), name=f"kvbus-sender-{self._stream}")
        await self._sending

    async def stop(self) -> None:
        """Cancel the sender and give it `CLOSE_WITHIN` seconds to end."""
        sending = self._sending
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.wait([sending], timeout=CLOSE_WITHIN)

    def send_inline(self) -> None:
        """Send everything queued, on the caller's thread, through the transport's
        `Transport.inline_append` (``publish()`` calls it right after it queued a
        message, so no sender thread is woken). The lock keeps concurrent callers'
        batches, and the thread's (it sends what `close` queues), in queue order."""
        append = self._inline_append
        assert append is not None
        with self._inline_lock:
            while batch := self._next_batch():
                if records := self._records(batch):
                    started = time.perf_counter()
                    append(self._stream, records)
                    self._sent(records, started)

    async def _send_forever(self) -> None:
        queue = self._queue
        while True:
            if self._inline_append is not None:
                self.send_inline()
            elif batch := self._next_batch():
                if records := self._records(batch):
                    await self._append(records)
                continue
            if not await queue.wait(self.last_sent):
                return

    def _next_batch(self) -> list[Queued]:
        """What to send next: queued messages, or, with none queued behind the newest
        drops, a notice that announces them (under the last dropped seq, which nothing
        else can use, so no race with publish())."""
        queue = self._queue
        batch = queue.take_batch()
        if not batch and queue.last_dropped > self.last_sent:
            notice = LossNotice(dropped=self.stats.dropped)
            batch = [(queue.last_dropped, Kind.CONTROL, notice, time.time())]
            self.settled -= 1  # sending it settles nothing publish() accepted
        return batch

    def _records(self, batch: list[Queued]) -> list[Record]:
        """``batch`` in envelopes, each with its gap marker; a message that cannot be
        encoded, or is too large, is dropped (the next one's marker announces it)."""
        records = []
        for seq, kind, payload, ts in batch:
            try:
                envelope = Envelope(
                    SCHEMA_VERSION,
                    kind,
                    self._source,
                    self._epoch,
                    seq,
                    ts,
                    payload if isinstance(payload, bytes) else encode(payload),
                    lost_from=0 if seq == self.last_sent + 1 else self.last_sent + 1,
                )
                data = encode_envelope(envelope)
            except (TypeError, ValueError) as error:  # a payload msgspec cannot encode
                self._drop_taken(seq, f"unencodable message {seq}: {error}")
                continue
            if len(data) > self._max_message_bytes:
                self._drop_taken(
                    seq,
                    f"message {envelope.msg_id} of {len(data)} bytes "
                    f"(max_message_bytes={self._max_message_bytes})",
                )
                continue
            records.append(Record(self._source, envelope.msg_id, data))
            self.last_sent = seq
        return records

    def _drop_taken(self, seq: int, what: str) -> None:
        """Drop a message the sender took from the queue; the next one sent carries
        the gap marker that announces it."""
        self._queue.count_drop(seq)
        self.settled += 1
        log.error("kvbus: dropped %s", what)

    async def _append(self, records: list[Record]) -> None:
        started = time.perf_counter()
        try:  # the usual case, without tenacity's per-call set-up (tens of µs a step)
            await self._append_all(records)
        except Exception as error:
            await self._append_retrying(records, error)
        self._sent(records, started)

    def _sent(self, records: list[Record], started: float) -> None:
        self._latency.observe(time.perf_counter() - started)
        self.stats.sent += len(records)
        self.settled += len(records)
        if self._on_sent is not None:
            self._on_sent(self.last_sent, len(records))

    async def _append_retrying(self, records: list[Record], error: Exception) -> None:
        """After the first attempt failed with ``error``: retry until the transport
        takes ``records`` (what of them it can), the first retry at once."""

        def count() -> None:
            self.stats.send_errors += 1

        what = f"append to {redact_url(self._url)}"
        count()
        log_failure(log, what, error, self._url)
        async for attempt in retry_forever(what, count, log, self._url):
            with attempt:
                await self._append_all(records)
        self.stats.reconnects += 1

    async def _append_all(self, records: list[Record]) -> None:
        """Append ``records``, dropping any the transport refuses as too large. Each is
        replaced in ``records`` itself by a `LossNotice` under its seq, with its gap
        marker: consumers learn of the loss at once (not after ``gap_timeout``, as a
        gap), and a retry after a later failure neither sends nor drops it again."""
        while records:
            try:
                await self._transport.append(self._stream, records)
                break
            except RecordTooLarge as error:  # nothing of this call was stored
                index = next(i for i, r in enumerate(records) if r.msg_id == error.msg_id)
                refused = decode_envelope(records[index].data)
                self._drop_taken(refused.seq, str(error))
                if refused.kind == Kind.CONTROL:  # a limit too small even for a notice
                    del records[index]
                    continue
                notice = encode(LossNotice(dropped=self.stats.dropped))
                envelope = msgspec.structs.replace(refused, kind=Kind.CONTROL, payload=notice)
                records[index] = Record(self._source, refused.msg_id, encode_envelope(envelope))
                self.settled -= 1  # sending it settles nothing publish() accepted
