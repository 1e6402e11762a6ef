"""Logging what came from the network without letting it flood or forge the log.

Everything here may be called once per bad message, so an attacker sending a million of
them gets one line per second per kind, and a string they control (a source name, an
error text) is quoted and clipped so it cannot fake a log line or fill a disk.
"""

from __future__ import annotations

import logging
import time

_MAX_SHOWN = 120


def shown(value: object) -> str:
    """``value`` quoted (``repr``: control characters escaped) and clipped."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[: _MAX_SHOWN - 4]}...{text[-1]}"


class LimitedLog:
    """A logger that writes at most one line per ``interval`` seconds (default 1) per
    ``kind`` and says how many of that kind it held back in between."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held_back: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        self._log(logging.WARNING, kind, message, args)

    def info(self, kind: str, message: str, *args: object) -> None:
        self._log(logging.INFO, kind, message, args)

    def _log(self, level: int, kind: str, message: str, args: tuple[object, ...]) -> None:
        if not self._logger.isEnabledFor(level):
            return  # nothing shown: nothing to count as held back either
        now = time.monotonic()
        if now - self._last.get(kind, -self._interval) < self._interval:
            self._held_back[kind] = self._held_back.get(kind, 0) + 1
            return
        self._last[kind] = now
        held_back = self._held_back.pop(kind, 0)
        if held_back:
            message += f" (and {held_back} more like it since the previous one shown)"
        self._logger.log(level, message, *args, stacklevel=3)
