"""Text from the network shown to people: in log lines, on a terminal, as JSON.

Everything here may be called once per bad message, so an attacker sending a million of
them gets one log line per second per kind (`LimitedLog`), and a string they control (a
source name, a medium, an error text) is clipped, and every character in it that is not
printable escaped, so it cannot fake a log line, fill a disk or drive the terminal it is
read on (`shown` for log lines, `displayable` for what is drawn, `terminal_safe_json`
for JSON printed on a terminal).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Final

MAX_SHOWN_NAME: Final = 64
"""Characters of a name from the network (a source, a medium) drawn at most; the middle
of a longer one is elided."""


def displayable(text: str, limit: int = MAX_SHOWN_NAME) -> str:
    """``text`` (a name from the network) as it may be drawn on a terminal.

    Every character Python does not call printable is written as its escape (``\\x1b``,
    ``\\u202e``): C0 and C1 controls, so ESC and with it every escape sequence (CSI,
    OSC 52 clipboard writes, OSC 8 hyperlinks, titles, clear-screen), DEL, bidi
    overrides, zero-width and other format characters, separators other than the
    space. At most ``limit`` characters are kept (at least 8), the middle of a longer
    text elided; the cost is O(limit) whatever the length of ``text``. It does not
    escape rich markup: draw the result as a `rich.text.Text`, never as a markup
    string."""
    limit = max(8, limit)
    text = _clip(text, limit)
    if text.isprintable():
        return text
    escaped = "".join(c if c.isprintable() else _escape(c) for c in text)
    return _clip(escaped, limit)


def _escape(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii")


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    tail = (limit - 3) // 2
    return f"{text[: limit - 3 - tail]}...{text[len(text) - tail :]}"


_NOT_ASCII_PRINTABLE: Final = re.compile(r"[^\x20-\x7e]")


def terminal_safe_json(document: bytes) -> bytes:
    """``document`` (UTF-8 JSON) with every character that is not printable written as a
    ``\\uXXXX`` escape: the same document to a JSON reader, and no control or format
    character reaches a terminal it is printed on (msgspec escapes C0 controls only, not
    DEL, C1 controls such as the 8-bit CSI, or bidi overrides)."""
    if document.isascii() and b"\x7f" not in document:
        return document  # the usual case: names in ASCII
    text = _NOT_ASCII_PRINTABLE.sub(_json_escape, document.decode())
    return text.encode()


def _json_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable():
        return char
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON writes characters past the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


_MAX_SHOWN: Final = 120
"""Characters of a value `shown` in a log line at most."""


def shown(value: object) -> str:
    """``value`` for a log line: quoted (its ``repr``), every character that is not
    printable escaped as `displayable` does (a ``repr`` of a string does, that of any
    other object may not), at most `_MAX_SHOWN` characters, the middle of a longer one
    elided. A string costs O(`_MAX_SHOWN`) whatever its length: it is clipped before it
    is quoted (the call is paid even when `LimitedLog` holds the line back)."""
    if isinstance(value, str):
        value = _clip(value, _MAX_SHOWN - 2)  # the quotes
    return displayable(repr(value), _MAX_SHOWN)


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

    def exception(self, kind: str, message: str, *args: object) -> None:
        """An error with the exception being handled, as `logging.Logger.exception`."""
        self._log(logging.ERROR, kind, message, args, exc_info=True)

    def _log(
        self,
        level: int,
        kind: str,
        message: str,
        args: tuple[object, ...],
        *,
        exc_info: bool = False,
    ) -> None:
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
        self._logger.log(level, message, *args, exc_info=exc_info, stacklevel=3)
