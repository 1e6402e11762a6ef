"""Reading one stream into a consumer's state: its retained history to the end (caught
up), then its live tail. The one loop behind the router's bus followers, ``kvbus top``
and the compactor (`Follower`); what a subscription itself guarantees (each source's
messages once and in order, every loss announced) is `kvbus.subscribe`'s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final, Literal

from kvbus.bus.subscription import Cursor, Item, Subscription, subscribe
from kvbus.transports import BackendUnusable

BACKEND_RECHECK: Final = 2.0
"""Seconds between a read the backend cannot serve as set up (`BackendUnusable`) and
the next try, with ``retry_log``."""
RETRY_AFTER: Final = 1.0
"""Seconds between any other failed read and the next try, with ``retry_log``."""

Start = Cursor | Literal["latest"] | None


class Follower:
    """Applies the items of ``stream`` on ``url`` to ``apply``, from ``start`` (a
    `Cursor`, ``"latest"`` or None: the oldest retained, or the stored snapshots with
    ``snapshot``); ``options`` go to `kvbus.subscribe` (``gap_timeout``, ``sources``,
    ``transport``...). Use it as ``async with``: `replay`, then `follow`.

    - Caught up: `replay` reads until the subscription reaches the end of the history
      (gaps still open there settled: repaired, or announced by a ``Resync``) and
      returns the cursor after it. Every item up to that point was applied (or left out
      by ``accept``, or given to ``on_bad_item``) and none after it.
    - `follow` goes on from exactly where the previous read stopped (`start` is then
      that cursor), for good: nothing applied twice, nothing skipped that no ``Resync``
      announces. Stored snapshots (``snapshot``) are read only until caught up: after a
      `replay`, gaps in the live tail are announced, not filled from snapshots.
    - A ``Resync`` is applied like a message, in its place: this class neither drops
      nor interprets one; what it means for the state is ``apply``'s.
    - ``accept(source)`` False: the item is not applied (per item, Resyncs included).
    - ``apply`` raising: with ``on_bad_item``, that is called (inside the ``except``:
      it may log the traceback) and the next item is applied; without, the read fails.
    - A failing backend: a transport's errors are retried inside the subscription
      (`kvbus.bus.retry`). What ends a read anyway (`BackendUnusable`, a set-up mistake such
      as NATS without JetStream; any other error) is raised to the caller; or, with
      ``retry_log``, the subscription is closed and reopened from its cursor after
      `BACKEND_RECHECK` s (quietly: the transport said once what to change) or
      `RETRY_AFTER` s (logged there): the read goes on where it stopped.
    - ``pause``: while someone else holds this lock (a writer storing the state with
      `cursor`), the next item is not applied, so `cursor` and the state agree.
    - Shutdown: cancel the task awaiting `replay` or `follow`; the cancel is never
      swallowed. The subscription stays open until the next read or `aclose` (the end
      of the ``async with``): the caller can store `cursor` first, through a transport
      it shares with the subscription.
    """

    def __init__(
        self,
        stream: str,
        url: str,
        apply: Callable[[Item], object],
        *,
        start: Start = None,
        snapshot: bool = False,
        accept: Callable[[str], bool] | None = None,
        on_bad_item: Callable[[Item, Exception], None] | None = None,
        retry_log: logging.Logger | None = None,
        pause: asyncio.Lock | None = None,
        on_open: Callable[[Subscription], None] | None = None,
        **options: Any,
    ) -> None:
        self.stream = stream
        self.url = url
        self.apply = apply
        """What each item is given to; may be changed between reads (not during one)."""
        self.start = start
        """Where the next read begins: after a read, the cursor where it stopped."""
        self.snapshot = snapshot
        self.accept = accept
        self.on_bad_item = on_bad_item
        self.retry_log = retry_log
        self.pause = pause
        self.on_open = on_open
        """Called with each subscription opened, before it reads: to keep its ``stats``,
        or to set `apply` for it."""
        self.options = options
        self._sub: Subscription | None = None

    async def replay(self) -> Cursor:
        """The history from `start` to its end; returns the cursor after it (caught up)."""
        self.start = cursor = await self._read(follow=False)
        self.snapshot = False
        return cursor

    async def follow(self) -> Cursor:
        """From `start` for good (the history too, unless `replay` read it); returns
        only if the transport ends the stream, with the cursor after it."""
        self.start = cursor = await self._read(follow=True)
        return cursor

    @property
    def cursor(self) -> Cursor:
        """Everything applied so far (while the read is paused: see ``pause``)."""
        if self._sub is not None:
            return self._sub.cursor
        if isinstance(self.start, Cursor):
            return self.start
        raise RuntimeError(f"no read of {self.stream} has started")

    async def aclose(self) -> None:
        """Close the subscription of the latest read (if it is still open)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.aclose()

    async def __aenter__(self) -> Follower:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _read(self, *, follow: bool) -> Cursor:
        start = self.start
        while True:
            await self.aclose()  # the previous read's, left open for its caller
            sub = self._sub = subscribe(
                self.stream, self.url, cursor=start, follow=follow, snapshot=self.snapshot,
                **self.options,
            )  # fmt: skip
            if self.on_open is not None:
                self.on_open(sub)
            try:
                await self._apply_all(sub)
                return sub.cursor
            except asyncio.CancelledError:
                raise
            except BackendUnusable:
                if self.retry_log is None:
                    raise
                start = sub.cursor
                await self.aclose()
                await asyncio.sleep(BACKEND_RECHECK)
            except Exception:
                if self.retry_log is None:
                    raise
                start = sub.cursor
                await self.aclose()
                self.retry_log.exception(
                    "following %s failed; again in %g s", self.stream, RETRY_AFTER
                )
                await asyncio.sleep(RETRY_AFTER)

    async def _apply_all(self, sub: Subscription) -> None:
        # The hot loop (the router's index is fed here): names bound once, no call
        # per item beyond ``apply`` and ``accept``.
        apply, accept, on_bad_item, pause = self.apply, self.accept, self.on_bad_item, self.pause
        async for item in sub:
            if pause is not None and pause.locked():
                async with pause:  # a write took the cursor before this item was yielded
                    pass
            if accept is not None and not accept(item.source):
                continue
            try:
                apply(item)
            except Exception as error:
                if on_bad_item is None:
                    raise
                on_bad_item(item, error)


__all__ = ["BACKEND_RECHECK", "RETRY_AFTER", "Follower", "Start"]
