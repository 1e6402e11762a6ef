"""JetStream administration for nats://: each kvbus stream's JetStream stream created
once with the URL's limits (an existing one's kept or, with ``update_stream``, changed),
a server without JetStream told apart and waited for, and a stream's state asked for
briefly while a cluster elects a leader."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import nats.errors
import nats.js.errors
from kvbus.transports import BackendUnusable
from kvbus.transports.nats_options import describe_limits
from nats.js import JetStreamContext, api

log = logging.getLogger("kvbus.transports.nats")

_PROBE_TIMEOUT: Final = 0.5  # seconds a leaderless stream's info request is waited for
JETSTREAM_RECHECK: Final = 2.0
"""Seconds between an append's or a following read's asks whether a server found without
JetStream has it now (restarted with ``-js``): one small request each."""

_no_jetstream_warned: set[str] = set()
"""Servers (as URLs show them, credentials hidden) already said to have no JetStream:
however many transports and retries a process has, it says so once per server."""
_limits_kept_warned: set[tuple[str, str, str, str]] = set()
"""The limit mismatches already logged: a process that opens many transports says each
once. Keyed by what the URLs configure, not by anything from the network."""


class JetStreamUnavailable(BackendUnusable):
    """The NATS server answers, but nothing serves JetStream's API: it runs without
    ``-js`` (or this account has no JetStream). The message says what to do; retrying
    helps only once an operator has enabled it."""


def _no_responders(error: Exception) -> bool:
    """A JetStream API request nobody answered (nats-py turns the server's 503 "no
    responders" status into a bare ServiceUnavailableError; an answer from JetStream
    itself carries a code)."""
    return isinstance(error, nats.js.errors.ServiceUnavailableError) and error.code is None


class StreamAdmin:
    """The JetStream streams of one transport's connection (``connect`` opens it or
    returns it), named ``KVBUS_<stream>``."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[JetStreamContext]],
        display: str,
        limits: dict[str, Any],
        update_stream: bool,
    ) -> None:
        self._connect = connect
        self._display = display
        self._limits = limits
        self._update_stream = update_stream
        self._ready: set[str] = set()

    async def stream(self, stream: str, *, wait: bool = False) -> str:
        """The JetStream stream's name, created with the URL's limits (an existing one
        changed to them only with ``update_stream``) once. On a server without
        JetStream: `JetStreamUnavailable`, or with ``wait`` a wait until it has it."""
        name = f"KVBUS_{stream}"
        if stream in self._ready:
            return name
        js = await self._connect()
        while True:
            try:
                info = await js.stream_info(name)
            except nats.js.errors.ServiceUnavailableError as error:
                await self.without_jetstream(js, error, wait)
                continue  # JetStream answers now
            except nats.js.errors.NotFoundError:
                info = None
            break
        if info is not None:
            await self._check_limits(js, name, info.config)
        else:
            config = {"storage": api.StorageType.FILE, **self._limits}
            try:
                await js.add_stream(name=name, subjects=[f"kvbus.{stream}.>"], **config)
            except nats.js.errors.BadRequestError as refused:
                # Created meanwhile by another client, with its own limits; or refused
                # (a limit the server cannot meet), which leaves no stream to use.
                try:
                    existing = (await js.stream_info(name)).config
                except nats.js.errors.NotFoundError:
                    raise refused from None
                await self._check_limits(js, name, existing)
        self._ready.add(stream)
        return name

    async def without_jetstream(
        self, js: JetStreamContext, error: nats.js.errors.ServiceUnavailableError, wait: bool
    ) -> None:
        """After ``error`` from a JetStream API request: raise it unless JetStream is
        missing altogether (`_jetstream_missing`); if it is, say so once per process and
        raise `JetStreamUnavailable`, or with ``wait`` return once it answers."""
        if not (_no_responders(error) and await _jetstream_missing(js)):
            raise error
        message = (
            f"{self._display} has no JetStream: start nats-server with -js "
            "(or enable jetstream in its config)"
        )
        if self._display not in _no_jetstream_warned:
            _no_jetstream_warned.add(self._display)
            log.error("kvbus: %s", message)
        if not wait:
            raise JetStreamUnavailable(message) from None
        while True:  # polled: nothing announces that a server has JetStream now
            await asyncio.sleep(JETSTREAM_RECHECK)
            if not await _jetstream_missing(js):
                break
        log.warning("kvbus: %s has JetStream now", self._display)

    async def _check_limits(
        self, js: JetStreamContext, name: str, existing: api.StreamConfig
    ) -> None:
        """An existing stream's limits against the URL's: changed to them with
        ``update_stream``, else kept, the difference logged once."""
        wanted = {k: v for k, v in self._limits.items() if getattr(existing, k, None) != v}
        if not wanted:
            return
        if self._update_stream:
            await js.update_stream(existing.evolve(**wanted))
            log.warning(
                "kvbus: nats stream %s on %s: limits changed to %s (update_stream=1)",
                name,
                self._display,
                describe_limits(wanted),
            )
            return
        kept = describe_limits({k: getattr(existing, k, None) for k in wanted})
        asked = describe_limits(wanted)
        if (self._display, name, asked, kept) in _limits_kept_warned:
            return
        _limits_kept_warned.add((self._display, name, asked, kept))
        log.warning(
            "kvbus: nats stream %s on %s keeps its limits %s, not the URL's %s "
            "(a stream's limits are set when it is created; add update_stream=1 to change them)",
            name,
            self._display,
            kept,
            asked,
        )

    async def forget_if_deleted(self, stream: str) -> None:
        """After a publish no stream answered, create the stream again on the next
        append if it was deleted.

        In a cluster, nothing answers for seconds while a new leader is elected after
        the stream leader's server died, and asking for the stream's info then waits out
        the whole timeout: so ask briefly, and forget the stream only when JetStream says
        it does not exist. A publisher retries; its packs go through once a leader is.
        """
        js = await self._connect()
        try:
            await probe(js, f"KVBUS_{stream}")
        except nats.js.errors.NotFoundError:
            self._ready.discard(stream)


async def _jetstream_missing(js: JetStreamContext) -> bool:
    """Whether no JetStream serves this connection's account: nobody answers the
    account info request either (a JetStream server always answers that one
    itself, even while a stream has no leader). Other errors are raised."""
    try:
        await js.account_info()
    except nats.js.errors.ServiceUnavailableError as error:
        if _no_responders(error):
            return True
        raise
    return False


async def probe(js: JetStreamContext, name: str) -> api.StreamState | None:
    """The stream's state, or None when no leader answers now (a cluster electing
    one): after a short wait, not the whole timeout."""
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT):
            return (await js.stream_info(name)).state
    except (
        TimeoutError,
        nats.errors.NoRespondersError,
        nats.js.errors.ServiceUnavailableError,
    ) as error:
        log.debug("kvbus: nats stream %s has no leader now: %r", name, error)
        return None
