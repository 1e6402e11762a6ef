"""Session affinity: requests that name one session go to one worker while it may get
traffic and is not overloaded (`kvbus.routing.router.Router`'s ``session_slack``). A
session is a 64-bit key (`session_key`, from a request header), so one costs the same
whatever a client sends; replicas share where each session went on the routes stream
(`kvbus.wire.events.RouteEvent.session`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Final

MAX_SESSIONS: Final = 100_000
"""Sessions remembered at most (each ~100 bytes), the least recently used forgotten."""


def session_key(name: str | bytes) -> int:
    """A session's key: BLAKE2b of its name, the same in every process; never 0 (0 is
    "no session" on the wire)."""
    # A header's bytes that are not UTF-8 arrive as surrogates: hashed as they came.
    data = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else name
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


class Sessions:
    """session key -> (worker, when last used): at most ``limit``, least recently used
    forgotten first, each forgotten ``ttl`` seconds after its last request; O(1) per
    operation."""

    def __init__(self, ttl: float = 600.0, limit: int = MAX_SESSIONS) -> None:
        self.ttl = ttl
        self.limit = limit
        self._homes: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def worker(self, session: int, now: float) -> str | None:
        """Where ``session`` went last, unless it has been idle past ``ttl``."""
        home = self._homes.get(session)
        if home is None:
            return None
        if now - home[1] > self.ttl:
            del self._homes[session]
            return None
        self._homes.move_to_end(session)
        return home[0]

    def assign(self, session: int, worker: str, now: float) -> None:
        """``session``'s request went to ``worker`` at ``now`` (here or at a replica)."""
        self._homes[session] = (worker, now)
        self._homes.move_to_end(session)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)
