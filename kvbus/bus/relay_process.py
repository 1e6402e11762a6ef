"""The relay process a `kvbus.bus.relay.RelayPublisher` starts: reads the engine's
frames from an inherited socket and publishes each message through a
`kvbus.bus.publisher.Publisher` (the transport's client, loop and retries live here)
under the engine's epoch and seq, writing the newest seq sent into the shared bytes the
engine reads. Ends after the epoch's last message, or when the engine's end of the
socket closes (its process ended): then it ends the epoch itself with ``SourceStopped``.

Run only by `RelayPublisher` (``python -m kvbus.bus.relay_process``); the URL comes in
``KVBUS_URL``.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import signal
import socket
import sys

from kvbus.bus.publisher import Publisher, Relayed
from kvbus.bus.relay import END, HEADER, MORE, PART_BYTES, PROGRESS
from kvbus.wire.envelope import Kind

log = logging.getLogger("kvbus.bus.relay")


class Reassembly:
    """The parts of one message: a message whose parts stop coming (the engine dropped
    the rest) is let go when the next one starts; at most ``limit`` bytes are held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seq = 0
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, seq: int, part: bytes, more: bool) -> bytes | None:
        """The whole payload once its last part came; None until then, or for a
        message dropped (cut short, or over ``limit``)."""
        if seq != self.seq:
            self.seq, self.parts, self.size = seq, [], 0
        self.size += len(part)
        if self.size > self.limit:
            self.parts = []
            return None
        self.parts.append(part)
        if more:
            return None
        whole = b"".join(self.parts)
        self.seq, self.parts, self.size = 0, [], 0
        return whole


def relay(channel: socket.socket, publisher: Publisher, max_message_bytes: int) -> bool:
    """Forward frames until the epoch ends (True) or the engine's end closes (False)."""
    parts = Reassembly(max_message_bytes)
    while True:
        frame = channel.recv(HEADER.size + PART_BYTES)
        if not frame:
            return False
        if len(frame) < HEADER.size:
            continue  # not a frame: nothing to forward
        seq, kind, flags, ts = HEADER.unpack_from(frame)
        whole = parts.add(seq, frame[HEADER.size :], bool(flags & MORE))
        if whole is None:
            continue
        try:
            publisher.forward(seq, Kind(kind), whole, ts)
        except ValueError:  # an unknown kind
            continue
        if flags & END:
            return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvbus relay (started by RelayPublisher)")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--progress-fd", type=int, required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--epoch", type=int, required=True)
    parser.add_argument("--after", type=int, default=0)
    parser.add_argument("--max-message-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    # A Ctrl-C or a service manager's SIGTERM reaches the engine's whole process group:
    # the relay ends with the engine's end of the socket, after sending what it holds
    # (the engine's SourceStopped last), not before. A SIGKILL still ends it at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = socket.socket(fileno=args.socket_fd)
    progress = mmap.mmap(args.progress_fd, PROGRESS.size)

    count = [0]

    def sent(seq: int, messages: int) -> None:
        count[0] += messages
        PROGRESS.pack_into(progress, 0, seq, count[0])

    relayed = Relayed(epoch=args.epoch, after=args.after, on_sent=sent)
    publisher = Publisher(stream=args.stream, source=args.source, relayed=relayed,
                          max_message_bytes=args.max_message_bytes)  # fmt: skip
    ended = relay(channel, publisher, args.max_message_bytes)
    publisher.close(stopped=ended)
    return 0


if __name__ == "__main__":
    sys.exit(main())
