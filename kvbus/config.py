"""Where settings come from: an explicit argument beats the environment, which beats
the built-in default."""

from __future__ import annotations

import os
import re
import socket
from typing import Final, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

DEFAULT_URL: Final = "memory://"
"""The library's bus (`kvbus.Publisher`, `kvbus.subscribe`, ``kvbus demo``): embedded,
shared by everything in one process."""
DEFAULT_COMMAND_URL: Final = "nats://127.0.0.1:4222"
"""The bus of the commands run from a shell that talk to other processes (``kvbus tail``,
``top``, ``compact``, ``bridge``, ``router``): a local NATS server (with JetStream), as
the README starts it. An embedded bus would always be empty there."""
DEFAULT_STREAM: Final = "kv"
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PASSWORD_OPTION = re.compile(r"((?:^|&)[^=&]*password=)([^&]*)")


def resolve_url(url: str | None) -> str:
    """``url``, else ``$KVBUS_URL``, else the in-process ``memory://`` bus."""
    return url or os.environ.get("KVBUS_URL") or DEFAULT_URL


URLOrigin = Literal["--url", "KVBUS_URL", "default"]


def resolve_command_url(url: str | None) -> tuple[str, URLOrigin]:
    """The bus of a command run from a shell, and where it came from: ``url`` (its
    ``--url``), else ``$KVBUS_URL``, else `DEFAULT_COMMAND_URL`."""
    if url:
        return url, "--url"
    from_env = os.environ.get("KVBUS_URL")
    if from_env:
        return from_env, "KVBUS_URL"
    return DEFAULT_COMMAND_URL, "default"


def command_url(url: str | None = None) -> str:
    """`resolve_command_url`'s URL alone (an argparse default, say)."""
    return resolve_command_url(url)[0]


def describe_bus(url: str, origin: URLOrigin) -> str:
    """``url`` for a startup line, its password redacted, saying where it came from."""
    if origin == "default":
        return f"{redact_url(url)} (the default: set --url or KVBUS_URL)"
    return f"{redact_url(url)} (from {origin})"


def resolve_stream(stream: str | None) -> str:
    """``stream``, else ``$KVBUS_STREAM``, else ``kv``; validated because it becomes a
    NATS subject token and a Redis key."""
    name = stream or os.environ.get("KVBUS_STREAM") or DEFAULT_STREAM
    if not _STREAM_NAME.match(name):
        raise ValueError(f"invalid stream name {name!r}: use 1-64 of [A-Za-z0-9_-]")
    return name


def resolve_source(source: str | None) -> str:
    """``source``, else ``$KVBUS_SOURCE``, else ``hostname-pid``.

    Set a stable name in production: a restart under the same name is then a new
    epoch of the same source, which consumers handle by resetting that source.
    """
    name = source or os.environ.get("KVBUS_SOURCE") or f"{socket.gethostname()}-{os.getpid()}"
    if not name or len(name) > 200 or any(c.isspace() for c in name):
        raise ValueError(f"invalid source name {name!r}: 1-200 characters, no white space")
    return name


def redact_url(url: str) -> str:
    """``url`` with its password (and any ``*password=`` option's value) replaced by
    ``***``, for logs and reprs (a transport URL carries credentials the way its client
    library reads them)."""
    try:
        parts = urlsplit(url)
        credentials, at, hosts = parts.netloc.rpartition("@")
    except ValueError:
        return "<unparsable url>"
    query = _PASSWORD_OPTION.sub(r"\1***", parts.query)
    if not at:
        return urlunsplit(parts._replace(query=query))
    user, colon, _ = credentials.partition(":")
    # A name with no password may be a token (nats://TOKEN@host): hide it as well.
    shown = f"{user}:***" if colon else "***"
    return urlunsplit(parts._replace(netloc=f"{shown}@{hosts}", query=query))


def redact_text(text: str, urls: list[str]) -> str:
    """``text`` (an error message) with the credentials of ``urls`` blanked out: the
    whole ``user:password`` (or token), the password alone, and each as the client
    library may print it once %-decoded."""
    for url in urls:
        try:
            parts = urlsplit(url)
        except ValueError:
            continue
        credentials = parts.netloc.rpartition("@")[0]
        secrets = [credentials, credentials.partition(":")[2]]
        secrets += [m.group(2) for m in _PASSWORD_OPTION.finditer(parts.query)]
        secrets += [unquote(secret) for secret in secrets]
        # Longest first: a password inside the whole credential goes with it.
        for secret in sorted(filter(None, set(secrets)), key=len, reverse=True):
            text = text.replace(secret, "***")
    return text
