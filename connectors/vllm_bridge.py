"""``kvbus bridge``: carries a stock vLLM engine's KV events onto kvbus, no plugin needed.

It subscribes to vLLM's own ``ZmqEventPublisher`` (``--kv-events-config
'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint":
"tcp://*:5558"}'``) and republishes each batch's payload bytes untouched through a
`kvbus.Publisher`, adding what the stock stream lacks:

* a seq gap (ZMQ high-water mark, reconnect) is filled from vLLM's replay socket
  (both reply layouts: ``[b"", topic, seq, payload]`` and the pre-0.26
  ``[b"", seq, payload]``); what the engine's buffer no longer holds is announced to
  consumers as lost;
* vLLM's seq restarting (the engine restarted) starts a new kvbus epoch, so consumers
  drop the old engine's blocks;
* on start (and after a restart) the bridge replays the engine's buffer from seq 0, so
  a restarted bridge recovers what it missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import zmq
import zmq.asyncio

import kvbus

log = logging.getLogger("kvbus.bridge")

_END_SEQ = 0xFFFFFFFFFFFFFFFF  # vLLM's replay end marker
_REMEMBERED = 100_000  # batches whose hashes tell a late copy from a restarted engine


class EngineBridge:
    """Forwards one engine's (one data-parallel rank's) event stream."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        source: str,
        url: str | None = None,
        stream: str | None = None,
        timeout: float = 2.0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.source = source
        self.url = url
        self.stream = stream
        self.timeout = timeout
        self.last: int | None = None
        """The engine's newest seq forwarded in the current epoch."""
        self._recent: dict[int, int] = {}  # seq -> hash of the payload forwarded
        self.forwarded = 0
        self.publisher: kvbus.Publisher | None = None

    async def _new_epoch(self) -> None:
        if self.publisher is not None:
            await self.publisher.aclose()
        self.publisher = kvbus.Publisher(self.url, stream=self.stream, source=self.source)
        self.last = None
        self._recent.clear()

    async def run(self) -> None:
        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        dealer = None
        if self.replay_endpoint:
            dealer = context.socket(zmq.DEALER)
            dealer.connect(self.replay_endpoint)
        await self._new_epoch()
        try:
            await self._replay(dealer, 0)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kvbus bridge: skipped a malformed frame from %s", self.endpoint)
                    continue
                await self._on_batch(dealer, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(0)
            if dealer is not None:
                dealer.close(0)
            if self.publisher is not None:
                await self.publisher.aclose()

    async def _on_batch(self, dealer: zmq.asyncio.Socket | None, seq: int, payload: bytes) -> None:
        # A seq at or below the newest forwarded one is either a live copy of a batch
        # the replay already forwarded (same bytes) or a restarted engine counting from
        # 0 again (different bytes: every batch carries its timestamp).
        restarted = (
            self.last is not None and seq <= self.last and self._recent.get(seq) != hash(payload)
        )
        if restarted:
            log.warning(
                "kvbus bridge: %s seq went back to %d: the engine restarted, new epoch",
                self.endpoint,
                seq,
            )
            await self._new_epoch()
            await self._replay(dealer, 0)
            if self.last is None and seq > 0:
                self._lost(0, seq - 1)  # the new engine's first batches, not replayable
        elif self.last is not None and seq > self.last + 1:
            await self._replay(dealer, self.last + 1)
        if self.last is not None and seq <= self.last:
            return  # already forwarded from the replay buffer
        if self.last is not None and seq > self.last + 1:
            self._lost(self.last + 1, seq - 1)
        self._forward(seq, payload)

    def _forward(self, seq: int, payload: bytes) -> None:
        assert self.publisher is not None
        self.publisher.publish(payload)
        self._recent[seq] = hash(payload)
        self._recent.pop(seq - _REMEMBERED, None)
        self.last = seq
        self.forwarded += 1

    def _lost(self, first: int, last: int) -> None:
        assert self.publisher is not None
        log.warning(
            "kvbus bridge: %s batches %d..%d are gone from the engine's buffer",
            self.endpoint,
            first,
            last,
        )
        self.publisher.announce_loss(last - first + 1)

    async def _replay(self, dealer: zmq.asyncio.Socket | None, start: int) -> None:
        """Forward the engine's buffered batches from ``start`` on."""
        if dealer is None:
            return
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while await dealer.poll(self.timeout * 1000):
            frames = await dealer.recv_multipart()
            if len(frames) not in (3, 4) or frames[0] != b"":
                log.warning("kvbus bridge: skipped a malformed replay reply")
                continue
            seq = int.from_bytes(frames[-2], "big")
            if seq == _END_SEQ:
                return
            if self.last is not None and seq <= self.last:
                continue
            first_expected = start if self.last is None else self.last + 1
            if seq > first_expected:
                if self.last is None and start == 0:
                    log.warning(
                        "kvbus bridge: %s buffer starts at seq %d; earlier batches are gone",
                        self.endpoint,
                        seq,
                    )
                else:
                    self._lost(first_expected, seq - 1)
            self._forward(seq, frames[-1])
        log.warning("kvbus bridge: no replay answer from %s", self.replay_endpoint)


async def run_bridges(
    endpoints: Sequence[str],
    replays: Sequence[str | None],
    sources: Sequence[str],
    url: str | None,
    stream: str | None,
) -> None:
    bridges = [
        EngineBridge(e, r, source=s, url=url, stream=stream)
        for e, r, s in zip(endpoints, replays, sources, strict=True)
    ]
    await asyncio.gather(*(b.run() for b in bridges))
