"""What a command says on stderr (its stdout is data): progress lines, and once that the
bus does not answer. Shared by ``kvbus tail``/``bridge``/``compact`` (kvbus.cli) and
``kvbus top``."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Final

from kvbus.bus.subscription import SubscriptionStats
from kvbus.config import DEFAULT_COMMAND_URL, redact_url

URL_HELP: Final = f"transport URL (default $KVBUS_URL, else {DEFAULT_COMMAND_URL})"
UNREACHABLE_CHECK: Final = 0.5
"""Seconds between a command's looks at whether its bus answers (`say_if_unreachable`)."""


def say(line: str) -> None:
    """One progress line of a command, on stderr (stdout is its data)."""
    print(line, file=sys.stderr, flush=True)


async def say_if_unreachable(
    command: str, url: str, stats: Callable[[], list[SubscriptionStats]]
) -> None:
    """Say once, on stderr, that the bus does not answer: when a read of the
    subscriptions ``stats()`` failed before any of them delivered anything (they retry
    for ever, quietly at the default log level, and would look like an empty bus).
    Runs until cancelled."""
    while True:
        await asyncio.sleep(UNREACHABLE_CHECK)
        counts = stats()
        if any(s.delivered for s in counts):
            return  # it answers
        failures = sum(s.transport_errors for s in counts)
        if failures:
            say(
                f"kvbus {command}: cannot read {redact_url(url)} ({failures} failed tries): "
                "is the server running (NATS with JetStream: nats-server -js) and the URL "
                "right? Still trying; -v shows each error, Ctrl-C stops"
            )
            return
