"""Workers found on the bus: an engine's load record names where it serves
(`kvbus.wire.events.LoadMetrics.url`), and ``kvbus router`` with no ``--worker`` routes
to the engines it hears of. An advertisement is network input, so a URL is taken only
when it is plain (``http(s)://HOST[:PORT]``, no credentials, path or query) and its host
is in the router's allow-list (``--discover-hosts``: IP networks and host names, by
default loopback only): a forged record cannot point the router, and the prompts it
carries, at a host of the forger's choosing outside it."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Final

from yarl import URL

from kvbus.logs import LimitedLog, shown
from kvbus.service.worker_names import RANK

log = logging.getLogger("kvbus.routing.router")
_limited_log: Final = LimitedLog(log, interval=60.0)
MAX_URL: Final = 2048
MAX_NAME: Final = 256
MAX_DISCOVERED: Final = 4096
"""Workers found on the bus at most (further ones are refused, and said)."""
DEFAULT_HOSTS: Final = ("127.0.0.0/8", "::1/128", "localhost", socket.gethostname())
"""Loopback, and this machine's name (what ``vllm serve`` without ``--host`` advertises)."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AllowedHosts:
    """IP networks (``10.0.0.0/8``, a single address) and host names (``vllm-0.vllm``;
    with a leading dot, every name under it: ``.vllm.svc.cluster.local``)."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.networks: list[Network] = []
        self.names: set[str] = set()
        self.suffixes: list[str] = []
        for entry in entries:
            entry = entry.strip().lower()
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if entry.startswith("."):
                    self.suffixes.append(entry)
                else:
                    self.names.add(entry)

    def __contains__(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host in self.names or any(host.endswith(s) for s in self.suffixes)
        return any(address in network for network in self.networks)


def plain_url(url: str, allowed: AllowedHosts) -> str:
    """``url`` as a worker's base URL (``scheme://host:port``); ValueError saying why
    it will not do."""
    if len(url) > MAX_URL:
        raise ValueError(f"longer than {MAX_URL} characters")
    try:
        parsed = URL(url)
    except (TypeError, ValueError):
        raise ValueError("not a URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError("not http(s)://HOST[:PORT]")
    if parsed.user or parsed.password:
        raise ValueError("credentials in it")
    if parsed.path not in ("", "/") or parsed.query_string or parsed.fragment:
        raise ValueError("a path, query or fragment in it")
    if parsed.host.endswith("."):
        # A fully qualified name skips /etc/hosts and the search domains: it may name
        # another host than the same name without its dot, which the list allows.
        raise ValueError("a host name ending in a dot")
    if parsed.host not in allowed:
        raise ValueError(f"host {shown(parsed.host)} not in --discover-hosts")
    return str(parsed.origin())


class WorkerDiscovery:
    """Adds the workers engines advertise to ``workers`` (the router service's map of
    name to base URL, shared by its parts), within ``allowed``; never changes a
    configured one (``--worker``)."""

    def __init__(
        self,
        workers: dict[str, str],
        allowed: AllowedHosts,
        moved: Callable[[str], None],
        live: Callable[[str], bool],
    ) -> None:
        self.workers = workers
        self.allowed = allowed
        self._moved = moved
        """Told the name of a found worker whose URL changed (connections to forget)."""
        self._live = live
        """Whether a worker may get traffic now: while it may, its URL does not move (a
        forged record must not take over a live worker's traffic)."""
        self.candidates: set[str] = set()
        """Names whose kv events are indexed before their first load record (bounded:
        `MAX_DISCOVERED`), so that an engine's history is in the index when it is found."""
        self.configured = frozenset(workers)
        self.found: dict[str, str] = {}
        """Name -> base URL of each worker found on the bus."""
        self.refused = 0
        """Advertisements refused (a bad or disallowed URL, a bad name, too many)."""

    def offer(self, source: str, url: str) -> bool:
        """An engine's load record from ``source`` says it serves at ``url``: whether
        its worker may now be routed to (it is configured or was taken)."""
        name = RANK.sub("", source)
        if name in self.configured:
            return True
        if self.found.get(name) == url:
            return True
        try:
            if not name or len(name) > MAX_NAME or not name.isprintable():
                raise ValueError("a source name that is empty, too long or not printable")
            if name not in self.found and len(self.found) >= MAX_DISCOVERED:
                raise ValueError(f"over {MAX_DISCOVERED} workers found already")
            if name in self.found and self._live(name):
                raise ValueError("its worker is live at another URL (a move waits until it stops)")
            base = plain_url(url, self.allowed)
        except ValueError as error:
            self.refused += 1
            _limited_log.warning(  # one kind: the names are the network's, unbounded
                "refused",
                "not routing to source %s: its advertised URL %s is refused (%s)",
                shown(source),
                "(not shown: it holds credentials)" if "@" in url else shown(url),
                error,
            )
            return name in self.found  # a later bad record does not undo a good one
        moved = name in self.found
        self.found[name] = url
        self.workers[name] = base
        if moved:
            self._moved(name)
        # At most MAX_DISCOVERED names, each moving only once stopped or stale: bounded.
        log.info("worker %s %s %s", shown(name), "moved to" if moved else "found at", shown(base))
        return True

    def indexes(self, name: str) -> bool:
        """Whether the kv events of ``name`` (a source's, less its rank) go into the
        index: a worker's, or one of at most `MAX_DISCOVERED` others not yet found."""
        if name in self.workers or name in self.candidates:
            return True
        if len(self.candidates) < MAX_DISCOVERED:
            self.candidates.add(name)
            return True
        return False
