"""Other router replicas' requests in flight, from their `RouteEvent`s on the routes
stream: bounded, keyed by (replica, request), each counting for ``timeout`` seconds at
most (its end may be lost). `kvbus.routing.router.Router.apply_routes` counts each on its worker
as if it had routed it; this module only keeps them and says which leave.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Final

from kvbus.routing.cost import Decision, Policy
from kvbus.wire.events import RouteEvent

MAX_PEER_REQUESTS: Final = 100_000
"""Other replicas' requests in flight kept at most (all replicas together)."""
MAX_PEER_KEYS: Final = 16_384
"""Blocks of one peer request kept at most (a 512k-token prompt of 32-token blocks)."""
MAX_PEERS: Final = 1024
"""Other replicas with requests in flight kept at most: a request routed by one more is
refused (``Router.peer_rejected``). A replica whose requests all ended takes no room."""


class PeerRequests:
    """peer -> its requests in flight, as `Decision`s (only peers that have some)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        """Seconds another replica's request counts at most (its end may be lost)."""
        self.rejected = 0
        """Events refused: unknown worker, too many keys, requests in flight or peers
        (`MAX_PEER_KEYS`, `MAX_PEER_REQUESTS`, `MAX_PEERS`)."""
        self.count = 0
        """Requests in flight, all peers together."""
        self._requests: dict[str, dict[int, Decision]] = {}
        self._deadlines: OrderedDict[tuple[str, int], float] = OrderedDict()
        """(peer, request) -> when it stops counting, soonest first (one timeout for
        all, so arrival order is deadline order); an ended request leaves at once."""

    @property
    def peers(self) -> int:
        """Peers with requests in flight."""
        return len(self._requests)

    def get(self, peer: str, request: int) -> Decision | None:
        return self._requests.get(peer, {}).get(request)

    def add(
        self, peer: str, event: RouteEvent, number: int | None, policy: Policy, now: float
    ) -> Decision | None:
        """``peer``'s request routed (``event``) to worker ``number`` (None: a worker
        that sent no load record); the request to count, or None: refused."""
        requests = self._requests.get(peer)
        if (
            number is None
            or len(event.keys) > MAX_PEER_KEYS
            or self.count >= MAX_PEER_REQUESTS
            or (requests is None and len(self._requests) >= MAX_PEERS)
            or (requests is not None and event.request in requests)
        ):
            self.rejected += 1
            return None
        blocks = len(event.keys)
        prefill = event.prefill_blocks if math.isfinite(event.prefill_blocks) else 0.0
        decision = Decision(
            worker=event.worker,
            policy=policy,
            prompt_tokens=0,
            matched_tokens=0,
            predicted_cached_tokens=0,
            cost=0.0,
            prefill_blocks=min(max(prefill, 0.0), float(blocks)),
            new_blocks=min(max(event.new_blocks, 0), blocks),
            keys=event.keys,
            window_ends=event.window_ends[:2],
            number=number,
            request=event.request,
            peer=peer,
        )
        if requests is None:
            requests = self._requests[peer] = {}
        requests[event.request] = decision
        self.count += 1
        self._deadlines[(peer, event.request)] = now + self.timeout
        return decision

    def drop(self, decision: Decision) -> None:
        """A peer's request no longer in flight: out of every map (a peer left with
        none goes too); the caller ends it (`Router.finished`)."""
        requests = self._requests[decision.peer]
        del requests[decision.request]
        if not requests:
            del self._requests[decision.peer]
        del self._deadlines[(decision.peer, decision.request)]
        self.count -= 1

    def forget(self, peer: str) -> list[Decision]:
        """Drop every request of ``peer`` (it restarted or stopped); those to end."""
        dropped = list(self._requests.get(peer, {}).values())
        for decision in dropped:
            self.drop(decision)
        return dropped

    def expire(self, now: float) -> list[Decision]:
        """Drop the requests whose time ran out by ``now``; those to end."""
        deadlines = self._deadlines
        dropped: list[Decision] = []
        while deadlines:
            (peer, request), deadline = next(iter(deadlines.items()))
            if deadline > now:
                break
            decision = self._requests[peer][request]
            self.drop(decision)
            dropped.append(decision)
        return dropped
