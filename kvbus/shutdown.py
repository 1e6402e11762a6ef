"""Tasks that end when cancelled, whatever the backend's client does with the cancel.

A client library can swallow a cancellation: Python 3.11's ``asyncio.wait_for`` returns
(or raises) its inner call's outcome when that call ended just as the cancel landed, and
redis-py and nats-py wrap every socket write and request in one. The cancel is then
gone: a command that failed on a dead server is retried for ever, a read that succeeded
goes on to wait for the next entry, and ``asyncio.run``, which cancels each leftover task
once and waits for it, hangs at exit. Two mechanisms, for kvbus's own background tasks:

- `raise_if_cancelling`: after a client call ended, by result or by error, a cancel that
  was asked for and swallowed is raised here (`kvbus.bus.retry` checks before every attempt
  and every backoff);
- `cancel_sticks`: a task whose cancel stays in force. Cancelled, it is cancelled again
  every `CANCEL_AGAIN_AFTER` seconds until it ends, unless the request was withdrawn
  (``Task.uncancel()``, as ``asyncio.timeout`` does for its own cancels), so a cancel
  swallowed where nothing checks (inside the client's own wait) lands again in the
  next one.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Coroutine
from typing import Any, Final, TypeVar

log = logging.getLogger("kvbus.shutdown")

CANCEL_AGAIN_AFTER: Final = 0.1
"""Seconds a cancelled `cancel_sticks` task gets to end before it is cancelled again."""
CLOSE_WITHIN: Final = 1.0
"""Seconds `close_within` gives a client's close (a server stopped, a network cut: a
close that waits for the peer never ends) before leaving it."""

T = TypeVar("T")


def raise_if_cancelling() -> None:
    """Raise ``CancelledError`` if the current task was asked to cancel and is still
    running: the cancel was swallowed on the way (see the module docstring)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


_SELF_WITHDRAWING: Final = frozenset({"asyncio.timeouts", "asyncio.taskgroups", "async_timeout"})
"""Modules whose cancel of a task is their own means to an end (a timeout, a failed
sibling), withdrawn (``uncancel()``) as soon as it has unwound: never a request to stop."""


class _StickyCancelTask(asyncio.Task[T]):
    """An ``asyncio.Task`` whose ``cancel()`` repeats until the task ends (or the request
    is withdrawn): see `cancel_sticks`."""

    def cancel(self, msg: Any = None) -> bool:
        requested = super().cancel(msg)
        # A timeout inside the task (asyncio.timeout, as nats-py and redis-py use) cancels
        # it too, then withdraws that cancel as a TimeoutError once it has unwound. Repeating
        # it would be wrong: a loop stalled past CANCEL_AGAIN_AFTER while it unwinds (GC, CPU
        # throttling) would see cancelling() still 1 and cancel again, and the timeout would
        # let a CancelledError out instead of its TimeoutError: a reader that only meant to
        # probe a dead server would end for good. Only a request to stop sticks.
        caller = sys._getframe(1).f_globals.get("__name__")
        if requested and caller not in _SELF_WITHDRAWING:
            self.get_loop().call_later(CANCEL_AGAIN_AFTER, self._cancel_again, msg)
        return requested

    def _cancel_again(self, msg: Any) -> None:
        # cancelling() is 0 again when whoever cancelled withdrew it: leave the task be.
        if not self.done() and self.cancelling():
            self.cancel(msg)


def cancel_sticks(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """``asyncio.create_task(coro)``, but a cancel of the task sticks: it is repeated
    until the task ends. For kvbus's background tasks (a subscription's reader, a
    publisher's sender), which must end when cancelled: by ``aclose()``, or by
    ``asyncio.run`` cancelling what was left open."""
    return _StickyCancelTask(coro, loop=asyncio.get_running_loop(), name=name)


async def close_within(closing: Awaitable[Any], what: str, seconds: float = CLOSE_WITHIN) -> None:
    """Await ``closing`` (a client's close) for at most ``seconds``, in a task of its own
    that is then left cancelled (sticky): a close that waits on a stopped server, or
    swallows the cancel of a timeout, cannot hold up the caller. Errors are logged, not
    raised: what was being closed is given up either way. A cancellation of the caller
    still reaches it."""

    async def close() -> None:
        await closing

    task = cancel_sticks(close(), name=f"close {what}")
    try:
        done, _ = await asyncio.wait([task], timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        log.warning("kvbus: closing %s did not finish in %g s; left", what, seconds)
        return
    if not task.cancelled() and task.exception() is not None:
        log.debug("kvbus: closing %s: %r", what, task.exception())
