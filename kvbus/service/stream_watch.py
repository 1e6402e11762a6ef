"""A relayed stream's two stalls, watched by one timer a stream instead of two a chunk.

A stream ends when its worker is silent for ``--worker-timeout`` (a worker that stalled,
not one still generating) or its client reads nothing for ``--client-write-timeout`` (it
would hold a worker's connection for good). An `asyncio.timeout` around each read and
each write said so at ~6 µs each, twice a token: a third of the router's CPU for every
token it relays. `StreamWatch` keeps the time of the last step instead (a float a step)
and a single timer that, when it fires, either finds progress and re-arms for the step
under way, or ends the stalled side: the worker's reader gets a `TimeoutError`, the
client's connection is aborted. No task is cancelled, so nothing else can be caught
half-way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, Literal

Side = Literal["worker", "client"]


class StreamWatch:
    """Watches one relayed stream from its creation (the first read) to `close`. Call
    `reading` before each read from the worker and `writing` before each write to the
    client; `stalled` says which side ran out of time, None while neither has."""

    def __init__(
        self,
        worker_timeout: float,
        client_write_timeout: float,
        worker_reader: Any,
        client_transport: asyncio.Transport | None,
        client_stalled: Callable[[], None] = lambda: None,
    ) -> None:
        """``worker_reader``: the worker response's content (an aiohttp ``StreamReader``,
        whose waiting read `set_exception` ends); ``client_transport``: the client's
        connection, aborted when it stops reading, just after ``client_stalled`` is
        called (the abort may cancel the task that relays: the server cancels the
        handler of a connection lost)."""
        self._limits: Final = {"worker": worker_timeout, "client": client_write_timeout}
        self._reader = worker_reader
        self._transport = client_transport
        self._client_stalled = client_stalled
        self._loop = asyncio.get_running_loop()
        self._side: Side = "worker"
        self._since = self._loop.time()
        # (At least a ms: a limit of 0 is then a stall at the first check, not a spin.)
        self._period: Final = max(min(worker_timeout, client_write_timeout), 1e-3)
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(
            self._since + self._period, self._check
        )
        self.stalled: Side | None = None

    def reading(self) -> None:
        """A read from the worker starts now."""
        self._side, self._since = "worker", self._loop.time()

    def writing(self) -> None:
        """A write to the client starts now."""
        self._side, self._since = "client", self._loop.time()

    def close(self) -> None:
        """The stream ended: no more checks."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        now = self._loop.time()
        due = self._since + self._limits[self._side]
        if now < due:
            # Never later than a period ahead: the step may change to the side with
            # the shorter limit before then, and is then still caught on time.
            self._timer = self._loop.call_at(min(due, now + self._period), self._check)
            return
        self._timer = None
        self.stalled = self._side
        if self._side == "worker":
            self._reader.set_exception(TimeoutError())  # its waiting read raises it
        else:
            self._client_stalled()
            if self._transport is not None:
                self._transport.abort()  # its write raises, now or at the next one
