"""The nats:// URL: its servers and options, read and checked (an unknown or malformed
option is a ValueError naming it, the URL's credentials hidden), and stream limits named
back the way the URL names them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NamedTuple
from urllib.parse import parse_qs, urlsplit

from nats.js import api

from kvbus.config import redact_url

DEFAULT_TIMEOUT: Final = 5.0

_LIMIT_OPTIONS: Final[dict[str, tuple[str, Callable[[str], Any]]]] = {
    # URL option: (its StreamConfig field, how its text is read)
    "max_age": ("max_age", float),
    "max_bytes": ("max_bytes", int),
    "max_msgs": ("max_msgs", int),
    "replicas": ("num_replicas", int),
    "duplicate_window": ("duplicate_window", float),
    "storage": ("storage", api.StorageType),
}
_OPTION_OF_FIELD: Final = {field: option for option, (field, _) in _LIMIT_OPTIONS.items()}


class NatsOptions(NamedTuple):
    servers: list[str]
    """Server URLs as nats-py takes them, credentials included."""
    display: str
    """The servers as messages show them, credentials hidden."""
    timeout: float
    update_stream: bool
    limits: dict[str, Any]
    """The URL's limits by StreamConfig field: a new stream's, or an existing one's
    with ``update_stream``."""


def parse_url(url: str) -> NatsOptions:
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    netloc = parts.netloc or "127.0.0.1:4222"
    credentials, _, hosts = netloc.rpartition("@")
    prefix = f"{parts.scheme}://{credentials + '@' if credentials else ''}"
    timeout = _take_option(query, "timeout", float, url)
    update_stream = bool(_take_option(query, "update_stream", _flag, url))
    limits: dict[str, Any] = {}
    for option, (field, convert) in _LIMIT_OPTIONS.items():
        value = _take_option(query, option, convert, url)
        if value is not None:
            limits[field] = value
    if query:
        raise ValueError(f"unknown nats:// options {sorted(query)} in {redact_url(url)}")
    return NatsOptions(
        servers=[prefix + host for host in hosts.split(",")],
        display=redact_url(f"{parts.scheme}://{netloc}"),
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        update_stream=update_stream,
        limits=limits,
    )


def _take_option(
    query: dict[str, str], option: str, convert: Callable[[str], Any], url: str
) -> Any:
    """``query``'s ``option`` (removed from it) converted, or None when absent; a value
    that does not convert is a ValueError naming it, the URL's credentials hidden."""
    if option not in query:
        return None
    text = query.pop(option)
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"bad nats:// option {option}={text!r} in {redact_url(url)}") from None


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError(text)


def describe_limits(limits: dict[str, Any]) -> str:
    """``max_msgs=2, storage=file``: limits by StreamConfig field, as a URL names them."""
    return ", ".join(
        f"{_OPTION_OF_FIELD.get(field, field)}={getattr(value, 'value', value)}"
        for field, value in sorted(limits.items())
    )
