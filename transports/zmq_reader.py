"""The subscribing side of zmq://: replay-then-live reading of one stream from one
endpoint (`Reader`), and several endpoints' entries merged into one stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from kvbus.transports import LATEST, Entry, Position
from kvbus.transports.packing import entries_after, split_position
from kvbus.transports.zmq_protocol import END, LOST, SNAPSHOTS, Endpoint, read_offset, topic_of

log = logging.getLogger("kvbus.transports.zmq")


class Reader:
    """Replay-then-live reading of one stream from one endpoint."""

    _requests = itertools.count(1)

    def __init__(self, endpoint: Endpoint, stream: str, hwm: int, timeout: float) -> None:
        self.endpoint = endpoint
        self.stream = stream
        self.topic = topic_of(stream)
        self.hwm = hwm
        self.timeout = timeout
        self.last: int | None = None
        """Newest ring offset delivered (None: accept whatever comes first)."""

    @staticmethod
    def _context() -> zmq.asyncio.Context:
        return zmq.asyncio.Context.shadow(zmq.Context.instance())

    def _dealer(self) -> zmq.asyncio.Socket:
        """A socket to the endpoint's replay ROUTER."""
        dealer = self._context().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint.connect(self.endpoint.port + 1))
        return dealer

    async def snapshots(self) -> dict[str, bytes]:
        """The snapshots the publishing process serves ({} if it is not up)."""
        dealer = self._dealer()
        request = str(next(self._requests)).encode()
        found: dict[str, bytes] = {}
        try:
            await dealer.send_multipart([request, self.stream.encode(), SNAPSHOTS])
            while True:
                async with asyncio.timeout(self.timeout):
                    reply = await dealer.recv_multipart()
                if len(reply) != 5 or reply[0] != request:
                    continue
                if reply[1] == END:
                    return found
                found[reply[3].decode(errors="replace")] = reply[4]
        except TimeoutError:
            return {}
        finally:
            dealer.close(0)

    async def entries(
        self, after: Position | None, follow: bool
    ) -> AsyncIterator[tuple[int, bytes]]:
        sub = None
        if follow:  # subscribe before asking for history, so nothing falls in between
            sub = self._context().socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self.hwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(self.endpoint.connect(self.endpoint.port))
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        dealer = self._dealer()
        try:
            if after == LATEST:
                request, skip = LATEST.encode(), -1
            elif after is None or after == "":
                request, skip = b"", -1
            else:
                offset, skip = split_position(int(after))
                request = str(offset - 1).encode()
            async for item in self._replay(dealer, request, skip, follow):
                yield item
            if sub is None:
                return
            while True:
                if not await sub.poll(self.timeout * 1000):
                    # Idle: ask whether the tail was missed (packs published before our
                    # subscription reached the publisher, after the replay's snapshot).
                    behind = b"" if self.last is None else str(self.last).encode()
                    async for item in self._replay(dealer, behind, -1, False):
                        yield item
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kvbus: zmq skipped a malformed frame (%d parts)", len(frames))
                    continue
                _, offset_frame, data = frames
                offset = int.from_bytes(offset_frame, "big")
                if self.last is not None and offset != self.last + 1:
                    if offset <= self.last:
                        continue  # already replayed
                    # A hole (high-water mark, reconnect, new publisher): fill it.
                    async for item in self._replay(dealer, str(self.last).encode(), -1, False):
                        yield item
                    if self.last is not None and offset <= self.last:
                        continue
                self.last = offset
                for item in entries_after(offset, data):
                    yield item
        finally:
            dealer.close(0)
            if sub is not None:
                sub.close(0)

    async def _replay(
        self, dealer: zmq.asyncio.Socket, after: bytes, skip: int, patient: bool
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Packs after ring offset ``after`` (skipping envelopes up to index ``skip`` of
        the first pack asked for); ``patient`` asks again forever when the publisher
        does not answer (it may not be up yet), otherwise gives up."""
        stream = self.stream.encode()
        partial = int(after) + 1 if after.isdigit() else None
        while True:
            request = str(next(self._requests)).encode()
            await dealer.send_multipart([request, stream, after])
            while True:
                try:
                    async with asyncio.timeout(self.timeout):
                        reply = await dealer.recv_multipart()
                except TimeoutError:
                    break
                if len(reply) != 5:
                    log.warning("kvbus: zmq skipped a malformed replay reply")
                    continue
                reply_to, kind, _, offset_frame, data = reply
                if reply_to != request:
                    continue  # a late answer to an abandoned request
                offset = read_offset(offset_frame)
                if kind == END:
                    if offset is not None:
                        self.last = offset
                    return
                if kind == LOST:
                    log.warning(
                        "kvbus: zmq %s:%s history lost before ring offset %s (asked after %s)",
                        self.endpoint.host,
                        self.endpoint.port,
                        offset,
                        after.decode() or "start",
                    )
                    continue
                assert offset is not None
                for item in entries_after(offset, data, skip if offset == partial else -1):
                    yield item
                self.last = offset
                after = str(offset).encode()
            if not patient:
                log.warning(
                    "kvbus: zmq %s:%s did not answer a replay request within %ss",
                    self.endpoint.host,
                    self.endpoint.port,
                    self.timeout,
                )
                return


async def merge_readers(
    readers: list[Reader], after: Position | None, follow: bool
) -> AsyncIterator[Entry]:
    """Entries of several endpoints as they arrive; a position is the comma-joined
    positions of every endpoint, so a cursor resumes each one where it was."""
    if after is None or after == LATEST:
        afters: list[Position | None] = [after] * len(readers)
    else:
        afters = [int(p) if p else None for p in str(after).split(",")]
        if len(afters) != len(readers):
            raise ValueError(f"position {after!r} is not one of {len(readers)} zmq endpoints")
    vector = ["" if a is None or a == LATEST else str(a) for a in afters]
    queue: asyncio.Queue[tuple[int, int, bytes] | BaseException | None] = asyncio.Queue(1024)

    async def pump(i: int) -> None:
        try:
            async for position, data in readers[i].entries(afters[i], follow):
                await queue.put((i, position, data))
            await queue.put(None)
        except Exception as error:
            await queue.put(error)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(readers))]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            i, position, data = item
            vector[i] = str(position)
            yield Entry(",".join(vector), data)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
