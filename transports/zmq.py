"""``zmq://[HOST:PORT][,HOST:PORT...][?ring=N&ring_bytes=B&hwm=N&timeout=S&snapshots=1]``.

ZeroMQ, no server.

The publishing process binds HOST:PORT (default ``127.0.0.1:5590``; ``*`` binds every
interface) with a PUB socket for the live stream, and PORT+1 with a ROUTER that replays
the newest ``ring`` envelopes (default 100,000, and at most ``ring_bytes``, default 64
MiB) per stream from memory. Subscribers
connect to one or several publishers (``zmq://h1:5590,h2:5590``) and get, per endpoint:
the replay of what they asked for, then the live stream, with no hole between the two.

What this fixes in vLLM's own ZMQ pattern:

* replay goes through a DEALER (vLLM's REQ socket wedges when a reply is lost), every
  reply names its stream and request, and ends with an explicit end marker;
* a request older than the ring is answered with a "history lost" marker before the
  oldest retained entry, never by silently starting later (the subscriber then reports
  the missing seqs as a gap);
* every live frame carries its ring offset, so a hole in the live stream (high-water
  mark reached, reconnect, publisher restart) is seen and filled from the ring;
* high-water marks are set, the default bind is loopback, and the replay socket refuses
  to drop replies (``ROUTER_MANDATORY``): a slow replayer is paused, not truncated.

What the publishing process holds is bounded in bytes whatever its peers do: packs
waiting for the sending thread are at most 16 MiB (older ones skip the live stream and
are read from the ring), packs are
at most 64 KiB (bar a single larger envelope), so a subscriber that never reads costs at
most ``hwm`` packs (default 256: 16 MiB) before the live stream drops for it (it then
refills from the ring); a replay request is checked before it is parsed and is at most
1 KiB; each peer has at most one replay running (a new request replaces it: a
subscriber waits for one answer at a time), and at most 64 run at once, the oldest
giving way.

With ``snapshots=1`` the publishing process also folds the kv batches it publishes (see
`kvbus.wire.snapshot.PublishedFolds`) and serves each source's snapshot to
``subscribe(snapshot=True)``: zmq has no server to keep them, and no compactor can see
what was published before it started. It costs the publisher's sender thread about 30
µs per 16-block batch (BENCHMARKS.md), so it is off by default. A snapshot request is
unauthenticated, so it costs the publishing process nothing in the size of its folds:
the endpoint serves the snapshots it took last, outside its lock, and takes them again
only when the folds changed by as many blocks as they hold, or when the ring no longer
holds what follows their cursor (`kvbus.wire.snapshot.PublishedFolds.due`), so taking them
is paid for by the publishing, not by the requests. A peer may ask for snapshots 4
times at once, then once a second (more is refused unanswered, counted in
``refused_requests``); what it is sent is queued on its connection, at most ``hwm``
frames.

Several publishers in one process (the KV and metrics streams of one engine) share one
bound endpoint. Delivery: an append is stored in the publishing process's ring and
lives as long as that process; positions are ``offset << 16 | index`` per endpoint
(joined with commas when several endpoints are read).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Final
from urllib.parse import parse_qs, urlsplit

import msgspec
from kvbus.transports import Entry, Position, Record, Transport
from kvbus.transports.zmq_protocol import DEFAULT_HOST as DEFAULT_HOST
from kvbus.transports.zmq_protocol import DEFAULT_PORT, Endpoint
from kvbus.transports.zmq_reader import Reader, merge_readers
from kvbus.transports.zmq_server import Server, acquire_server, release_server

from kvbus.config import redact_url
from kvbus.wire.snapshot import CURSOR_NAME

DEFAULT_RING: Final = 100_000
DEFAULT_RING_BYTES: Final = 64 * 1024 * 1024
DEFAULT_HWM: Final = 256
DEFAULT_TIMEOUT: Final = 2.0


class ZmqTransport(Transport):
    def __init__(self, url: str = "zmq://") -> None:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        self.endpoints = [_parse_endpoint(e) for e in (parts.netloc or "").split(",")]
        self.ring = int(query.get("ring", [DEFAULT_RING])[0])
        self.ring_bytes = int(query.get("ring_bytes", [DEFAULT_RING_BYTES])[0])
        self.hwm = int(query.get("hwm", [DEFAULT_HWM])[0])
        self.timeout = float(query.get("timeout", [DEFAULT_TIMEOUT])[0])
        self.snapshots = query.get("snapshots", ["0"])[0] in ("1", "true", "yes")
        if self.ring < 1 or self.ring_bytes < 1 or self.hwm < 0 or self.timeout <= 0:
            shown = redact_url(url)
            raise ValueError(f"ring, ring_bytes, hwm and timeout must be positive in {shown}")
        self._server: Server | None = None

    async def append(self, stream: str, records: Sequence[Record]) -> None:
        if self._server is None:
            if len(self.endpoints) != 1:
                raise ValueError("a zmq:// publisher binds exactly one HOST:PORT")
            self._server = acquire_server(
                self.endpoints[0], self.ring, self.ring_bytes, self.hwm, self.snapshots
            )
        self._server.append(stream, records)

    async def read(
        self, stream: str, after: Position | None = None, *, follow: bool = False
    ) -> AsyncIterator[Entry]:
        readers = [Reader(e, stream, self.hwm, self.timeout) for e in self.endpoints]
        if len(readers) == 1:
            async for position, data in readers[0].entries(after, follow):
                yield Entry(position, data)
            return
        async for entry in merge_readers(readers, after, follow):
            yield entry

    async def get_snapshots(self, stream: str) -> dict[str, bytes]:
        """From the publishing process, which folds what it publishes when its URL says
        ``snapshots=1``; with several endpoints, their cursors joined."""
        readers = [Reader(e, stream, self.hwm, self.timeout) for e in self.endpoints]
        answers = await asyncio.gather(*(r.snapshots() for r in readers))
        if len(answers) == 1:
            return answers[0]
        merged: dict[str, bytes] = {}
        positions: list[str] = []
        sources: dict[str, object] = {}
        for answer in answers:
            cursor = msgspec.json.decode(answer.pop(CURSOR_NAME, b"{}"))
            position = cursor.get("position") if isinstance(cursor, dict) else None
            positions.append("" if position is None else str(position))
            if isinstance(cursor, dict) and isinstance(cursor.get("sources"), dict):
                sources.update(cursor["sources"])
            merged.update(answer)
        merged[CURSOR_NAME] = msgspec.json.encode(
            {"position": ",".join(positions), "sources": sources}
        )
        return merged

    async def aclose(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(release_server, server)


def _parse_endpoint(text: str) -> Endpoint:
    host, _, port = text.rpartition(":")
    if not _:
        host, port = text, ""
    return Endpoint(host or DEFAULT_HOST, int(port) if port else DEFAULT_PORT)
