"""The zmq:// wire protocol both sides speak: endpoints, topics, and the frames of
the replay requests and replies."""

from __future__ import annotations

from typing import Final, NamedTuple

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 5590


# Replay protocol (DEALER -> ROUTER): [request_id, stream, after], after being b"" (all),
# b"$" (nothing, just the end marker) or an ASCII ring offset. Replies: [request_id,
# kind, stream, offset(8), data?] with kind DATA, LOST (history before offset is gone)
# or END (offset = newest offset served, empty if the ring is empty).
DATA, LOST, END, SNAPSHOT = b"D", b"L", b"E", b"S"
SNAPSHOTS: Final = b"snapshots"  # a request for the snapshots instead of a position


class Endpoint(NamedTuple):
    host: str
    port: int

    def bind(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"

    def connect(self, port: int) -> str:
        host = DEFAULT_HOST if self.host in ("*", "0.0.0.0") else self.host
        return f"tcp://{host}:{port}"


def offset_bytes(offset: int | None) -> bytes:
    return b"" if offset is None else offset.to_bytes(8, "big")


def read_offset(frame: bytes) -> int | None:
    return int.from_bytes(frame, "big") if frame else None


def topic_of(stream: str | bytes) -> bytes:
    # The NUL ends the topic: ZeroMQ subscriptions match prefixes, and "kv" must not
    # receive "kv_metrics".
    return (stream.encode() if isinstance(stream, str) else stream) + b"\0"
