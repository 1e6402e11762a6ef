"""The router service without the bus: it says when the bus goes down or comes back,
reads the load of workers the bus tells nothing of from their own endpoints (vLLM's
``/health`` and ``/metrics``), and names the configured workers no engine publishes as.
The bus is not in the request path: routing goes on, degraded, on what this reads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from typing import Final

import aiohttp

from kvbus.logs import LimitedLog, displayable
from kvbus.routing.router import Router
from kvbus.service.bus_followers import MAX_ENGINE_RANKS, BusFollowers
from kvbus.service.router_metrics import Metrics
from kvbus.service.upstream import Upstream
from kvbus.service.worker_names import RANK
from kvbus.wire.events import LoadMetrics

log = logging.getLogger("kvbus.routing.router")
_limited_log = LimitedLog(log)  # one line a second per kind
ENGINE_METRICS_MAX_BYTES: Final = 4 * 2**20
"""The most bytes of an engine's ``/metrics`` read (vLLM's is tens of KiB per engine);
a larger answer is not read further, counted (``kvbus_router_engine_polls_total``
``outcome="too_large"``) and its load not used."""
_ENGINE_GAUGES: Final = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_cache_usage",
}
_ENGINE_LABEL: Final = re.compile(rb'(?:^|,)engine="(\d{1,6})"')
_MAX_REQUESTS_FIGURE: Final = 2**31
_SHOWN_SOURCES: Final = 8
"""Of those, named in a message at most."""


class BusWatch:
    """Every ``engine_poll_interval`` (`run`): the bus's state in the log and
    /metrics, the engines' own load where the bus's is old, and the set-up mistakes
    seen (`problems`)."""

    def __init__(
        self,
        workers: dict[str, str],
        router: Router,
        metrics: Metrics,
        followers: BusFollowers,
        upstream: Upstream,
        engine_poll_interval: float,
    ) -> None:
        self.workers = workers
        self.router = router
        self.metrics = metrics
        self.followers = followers
        self.upstream = upstream
        self.engine_poll_interval = engine_poll_interval
        """Seconds between reads of the load of workers the bus tells nothing of lately
        from their own endpoints (each read within a fifth of ``stale_after``)."""
        self._bus_was_up = True
        self.polls: dict[str, asyncio.Task[None]] = {}
        """Reads of a worker's own endpoint in flight."""
        self._told: set[str] = set()
        self.problems: list[str] = []
        """Mistakes in the set-up the router can see (a worker no engine publishes as)."""

    async def run(self) -> None:
        """Every ``engine_poll_interval``: says when the bus goes down or comes back,
        reads the load of each worker the bus told nothing of for half ``stale_after``
        from its own endpoint (before what the router last knew goes stale), and looks
        for workers no engine publishes as."""
        while True:
            self._check_bus()
            for name in self.workers:
                if name not in self.polls and self._needs_engine_load(name):
                    self.polls[name] = asyncio.create_task(self._poll_engine(name))
            self._check_names()
            await asyncio.sleep(self.engine_poll_interval)

    def _check_bus(self) -> None:
        up = self.followers.bus_up
        self.metrics.bus_up.set(int(up))
        if up == self._bus_was_up:
            return
        self._bus_was_up = up
        if up:
            log.info("the bus is back: routing on its load records and index again")
        else:
            log.warning(
                "no load record on the metrics stream for %ss: the bus is down (or no engine "
                "publishes); routing on what the router knew and the engines' own /metrics",
                self.router.stale_after,
            )

    def _needs_engine_load(self, name: str) -> bool:
        """Whether some engine of worker ``name`` has sent no load record on the bus
        for half ``stale_after`` (or never did)."""
        sources = self.followers.load_sources.get(name)
        if not sources:
            return True
        threshold = self.router.stale_after / 2
        return any(self.router.load_age(s) > threshold for s in sources)

    async def _poll_engine(self, name: str) -> None:
        """Worker ``name``'s load from its own endpoint: ``/health`` (200: its engine
        lives), then ``/metrics``, within a fifth of ``stale_after``; given to the
        router for each of its engines whose bus record is old."""
        session = self.upstream.session
        assert session is not None
        base = self.workers[name]
        outcome = "failed"
        try:
            async with asyncio.timeout(self.router.stale_after / 5):
                async with session.get(f"{base}/health") as response:
                    if response.status != 200:
                        raise ValueError(f"/health answered {response.status}")
                async with session.get(
                    f"{base}/metrics", headers={"Accept-Encoding": "identity"}
                ) as response:
                    if response.status != 200:
                        raise ValueError(f"/metrics answered {response.status}")
                    text = await _read_bounded(response, ENGINE_METRICS_MAX_BYTES)
            loads = engine_loads(text, time.time())
            outcome = "ok" if loads else "unreadable"
        except _TooLarge as error:
            outcome = "too_large"
            _limited_log.warning(
                "engine metrics", "the /metrics of worker %s is refused: %s", name, error
            )
            return
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.debug("could not read the load of worker %s: %r", name, error)
            return
        finally:
            self.metrics.engine_polls.labels(outcome).inc()
            self.polls.pop(name, None)
        threshold = self.router.stale_after / 2
        for engine, load in loads.items():
            # A worker whose engine publishes as bare NAME (no rank) keeps that name.
            bare = engine == 0 and self.router.load_age(name) < math.inf
            source = name if bare else f"{name}/dp{engine}"
            if self.router.load_age(source) > threshold:
                self.followers.add_load_source(source)
                self.router.apply_engine_load(source, load)

    def _check_names(self) -> None:
        """Once the bus has been up for ``stale_after``: a message for each configured
        worker no item on the bus came from (logged once), naming what did come."""
        if not self.followers.bus_up or not self.followers.load_read:
            return
        if time.monotonic() - self.followers.started < self.router.stale_after:
            return
        unseen = [name for name in self.workers if name not in self.followers.heard_names]
        self.problems = [self._unseen(name) for name in unseen]
        for name, message in zip(unseen, self.problems, strict=True):
            if name not in self._told:
                self._told.add(name)
                log.warning("%s", message)  # its names already made displayable

    def _unseen(self, name: str) -> str:
        shown_name = displayable(name)
        others = sorted(self.followers.other_sources)
        if not others:
            return (
                f"no engine publishes as `{shown_name}`; sources seen: none (set "
                f"KVBUS_SOURCE={shown_name} and KVBUS_URL to this router's --url on that engine)"
            )
        seen = ", ".join(f"`{displayable(s)}`" for s in others[:_SHOWN_SOURCES])
        if len(others) > _SHOWN_SOURCES:
            seen += ", ..."
        other = displayable(RANK.sub("", others[0]))
        return (
            f"no engine publishes as `{shown_name}`; sources seen: {seen} (set "
            f"KVBUS_SOURCE={shown_name} on that engine, or --worker {other}=URL)"
        )


def engine_loads(text: bytes, now: float) -> dict[int, LoadMetrics]:
    """Each engine's load in a vLLM ``/metrics`` answer (Prometheus text), by its
    ``engine`` label (the data-parallel rank; 0 when unlabelled), stamped ``now``: the
    sum of each gauge's series per engine. An engine without both request gauges, or
    with a figure that is not a finite number, is left out; counts are brought into
    0..2^31 (the router clamps the usage). One pass over the text per gauge, O(size)."""
    figures: dict[int, dict[str, float]] = {}
    text = b"\n" + text
    for name, field in _ENGINE_GAUGES.items():
        needle = b"\n" + name
        start = 0
        while (found := text.find(needle, start)) >= 0:
            end = text.find(b"\n", found + 1)
            end = len(text) if end < 0 else end
            start = end
            rest = text[found + len(needle) : end]
            if rest[:1] == b"{":
                labels, brace, rest = rest[1:].rpartition(b"}")
                if not brace:
                    continue
            elif rest[:1] == b" ":
                labels = b""
            else:
                continue  # another series whose name starts alike
            parts = rest.split()
            with contextlib.suppress(ValueError):
                value = float(parts[0]) if parts else math.nan
                if not math.isfinite(value):
                    continue
                match = _ENGINE_LABEL.search(labels)
                engine = int(match.group(1)) if match else 0
                if engine not in figures and len(figures) >= MAX_ENGINE_RANKS:
                    continue
                engine_figures = figures.setdefault(engine, {})
                engine_figures[field] = engine_figures.get(field, 0.0) + value
    return {
        engine: LoadMetrics(
            ts=now,
            engine_index=engine,
            running=_request_count(found["running"]),
            waiting=_request_count(found["waiting"]),
            kv_cache_usage=found.get("kv_cache_usage", 0.0),
        )
        for engine, found in figures.items()
        if "running" in found and "waiting" in found
    }


def _request_count(value: float) -> int:
    return int(min(max(value, 0.0), _MAX_REQUESTS_FIGURE))


class _TooLarge(Exception):
    """An answer over the bytes it may have."""


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """``response``'s body, refused (`_TooLarge`) past ``limit`` bytes before more is
    read; one the server compressed anyway (asked not to) is refused too, as what it
    would decompress to is unbounded by what arrives."""
    if response.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise _TooLarge("compressed")
    if (response.content_length or 0) > limit:
        raise _TooLarge(f"{response.content_length} bytes")
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise _TooLarge(f"over {limit} bytes")
    return bytes(data)
