"""The router service's Prometheus series (``/metrics`` of ``kvbus router``), per worker
and policy, among them how each decision's predicted cached tokens compared with what the
engine reported."""

from __future__ import annotations

import enum
import logging
from typing import Final

import prometheus_client as prom

import kvbus.metrics
from kvbus.routing.router import Decision
from kvbus.service.worker_names import RANK

log = logging.getLogger("kvbus.routing.router")
_TOKEN_BUCKETS: Final = (0, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_ERROR_BUCKETS: Final = (-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096)


class Metrics:
    """The router's Prometheus series (``/metrics``), per worker and policy."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        kvbus.metrics.register(self.registry)  # kvbus_publisher_*, kvbus_subscriber_*
        per_worker = ("worker", "policy")

        def counter(name: str, doc: str, labels: tuple[str, ...] = per_worker) -> prom.Counter:
            return prom.Counter(f"kvbus_router_{name}", doc, labels, registry=self.registry)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = per_worker
        ) -> prom.Histogram:
            return prom.Histogram(
                f"kvbus_router_{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(f"kvbus_router_{name}", doc, registry=self.registry)

        self.requests = counter("requests", "Requests forwarded", (*per_worker, "code"))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens routed")
        self.unrouted = counter("unrouted_requests", "Requests forwarded unread (invalid)", ())
        self.prompts_as_ids = counter(
            "prompts_sent_as_ids",
            "Completions an engine answered with their text prompt sent as token ids "
            "(--send-token-ids)",
            (),
        )
        self.segments = counter(
            "prompt_segments",
            "Segments of long prompts (--prompt-cache-mib), by source: cache (their ids "
            "kept from earlier prompts that shared them) or tokenizer",
            ("source",),
        )
        self._segments_counted = (0, 0)
        self.no_worker = counter("no_worker", "Requests answered 503: no worker alive", ())
        self.shed = counter(
            "shed_requests",
            "Requests answered 503 at once, by limit: first_token (the best worker's "
            "predicted time to a first token was over --shed-after) or deadline (its "
            "predicted time to the last token was over --deadline or the request's own)",
            ("limit",),
        )
        self.seconds_per_token = prom.Gauge(
            "kvbus_router_seconds_per_output_token",
            "Each worker's seconds per output token after the first, timed from the steps "
            "of its completion and chat streams as they are relayed (recent ones weigh "
            "most; what --deadline counts for the output)",
            ("worker",),
            registry=self.registry,
        )
        self.slow_clients = counter(
            "slow_clients",
            "Connections closed: no whole request head within --header-timeout of opening "
            "or of the previous response (idle keep-alive connections included)",
            (),
        )
        self.stalled_clients = counter(
            "stalled_clients",
            "Connections dropped: the client read nothing for --client-write-timeout",
            (),
        )
        self.refused = counter(
            "refused_requests",
            "Requests refused before routing: body_too_large (413, --max-body-bytes), "
            "bodies_held (503, --max-held-body-bytes)",
            ("reason",),
        )
        self.busy = counter(
            "busy_worker_waits",
            "Requests that waited --pool-timeout for one of a worker's "
            "--worker-connections and went elsewhere (the worker is not marked down)",
            ("worker",),
        )
        self.body_bytes = gauge(
            "held_body_bytes", "Bytes of request bodies held now (--max-held-body-bytes)"
        )
        self.bus_up = gauge(
            "bus_up",
            "1 while load records arrive on the metrics stream; 0: the bus is down (or no "
            "engine publishes), routing degraded to the engines' own /metrics",
        )
        self.degraded_routes = counter(
            "degraded_routes",
            "Requests routed while the bus was down, or to a worker on load read from its "
            "own endpoint",
            (),
        )
        self.engine_polls = counter(
            "engine_polls",
            "Loads read from the engines' own /health and /metrics, by outcome: ok, failed, "
            "too_large (ENGINE_METRICS_MAX_BYTES), unreadable",
            ("outcome",),
        )
        self.bad_items = counter(
            "bad_stream_items", "Bus items the router could not apply (logged, skipped)", ()
        )
        # Routing accuracy, per request whose response carried usage: what the router
        # expected the engine to find cached, what the engine reported, and the gap.
        self.predicted = histogram(
            "predicted_cached_tokens", "Prompt tokens the router expected cached", _TOKEN_BUCKETS
        )
        self.reported = histogram(
            "reported_cached_tokens", "Cached prompt tokens the engine reported", _TOKEN_BUCKETS
        )
        self.error = histogram(
            "prediction_error_tokens",
            "Reported less predicted cached tokens (negative: the router expected more)",
            _ERROR_BUCKETS,
        )
        # Regret: how much more the worker holding the most of the prompt held.
        self.best = histogram(
            "best_cached_tokens",
            "Prompt tokens the eligible worker holding the longest prefix was expected to "
            "find cached (per request whose response carried usage)",
            _TOKEN_BUCKETS,
        )
        self.regret = histogram(
            "regret_tokens",
            "best_cached_tokens less the chosen worker's: against=predicted, what the "
            "router traded for load; against=reported, what was lost in fact (negative: "
            "the engine found more than the router thought any worker held)",
            _ERROR_BUCKETS,
            (*per_worker, "against"),
        )
        self.predictions = counter(
            "predictions",
            "Predictions checked against usage, by outcome: exact, over, under; unreported: "
            "the usage had no cached_tokens (vLLM runs without --enable-prompt-tokens-details)",
            (*per_worker, "outcome"),
        )
        self._unreported_said: set[str] = set()
        """Workers (configured names) already said to report no cached tokens."""
        self.decision = histogram(
            "decision_seconds",
            "Tokenizing and choosing a worker",
            (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            (),
        )
        self.ttft = histogram(
            "first_byte_seconds",
            "Time to the first byte of the worker's response",
            prom.Histogram.DEFAULT_BUCKETS,
        )
        # P/D (kvbus.service.disagg): the decode hop counts in requests, as any request.
        self.pd_prefills = counter(
            "pd_prefills",
            "Prefill hops of disaggregated requests (max_tokens 1, KV left for the decode "
            "worker), by prefill worker and status code",
            ("worker", "code"),
        )
        self.pd_skipped = counter(
            "pd_prefill_skipped",
            "Disaggregated requests sent whole to their decode worker: held (it holds over "
            "--skip-prefill-above of the prompt), short (no whole block to move), "
            "unsupported (n or best_of over 1, beam search, prompt logprobs), "
            "no_prefill_worker (none may get traffic, or each failed the hop), untokenized "
            "(the router could not read the prompt), unreadable (not a JSON object)",
            ("reason",),
        )
        self.pd_prefill_seconds = histogram(
            "pd_prefill_seconds",
            "Time of a successful prefill hop (the decode hop waits for it)",
            prom.Histogram.DEFAULT_BUCKETS,
            (),
        )
        self.eligible = gauge("eligible_workers", "Workers that may get traffic")
        self.blocks = gauge("indexed_blocks", "Distinct prefix blocks indexed")
        self.ready = gauge("ready", "1 when /health says ready")
        self.unchained = gauge(
            "unchained_blocks", "Stored blocks skipped: their parent was never seen"
        )
        self.peer_requests = gauge(
            "peer_requests", "Other replicas' requests in flight, counted here (--routes-stream)"
        )

    def count_segments(self, kept: int, tokenized: int) -> None:
        """The tokenizer's segment counts (`SegmentedEncoder`) so far, into the counter."""
        before = self._segments_counted
        self.segments.labels("cache").inc(max(0, kept - before[0]))
        self.segments.labels("tokenizer").inc(max(0, tokenized - before[1]))
        self._segments_counted = (kept, tokenized)

    def observe_prediction(self, decision: Decision, reported: int | Unreported) -> None:
        labels = (decision.worker, decision.policy.value)
        if reported is UNREPORTED:
            # Not a miss: vLLM leaves cached_tokens out unless asked to count them.
            # Counted as "over" it would make every prediction look wrong.
            self.predictions.labels(*labels, "unreported").inc()
            worker = RANK.sub("", decision.worker)
            if worker not in self._unreported_said:
                self._unreported_said.add(worker)
                log.warning(
                    "worker %s reports no cached tokens: start vLLM with "
                    "--enable-prompt-tokens-details to measure routing accuracy",
                    worker,
                )
            return
        predicted = decision.predicted_cached_tokens
        self.predicted.labels(*labels).observe(predicted)
        self.reported.labels(*labels).observe(reported)
        self.error.labels(*labels).observe(reported - predicted)
        best = decision.best_cached_tokens
        self.best.labels(*labels).observe(best)
        self.regret.labels(*labels, "predicted").observe(best - predicted)
        self.regret.labels(*labels, "reported").observe(best - reported)
        outcome = "exact" if reported == predicted else "over" if predicted > reported else "under"
        self.predictions.labels(*labels, outcome).inc()


class Unreported(enum.Enum):
    """A response's usage without ``prompt_tokens_details.cached_tokens``: vLLM sends
    ``"prompt_tokens_details": null`` (or, in a stream, leaves it out) unless it runs
    with ``--enable-prompt-tokens-details``."""

    UNREPORTED = "unreported"


UNREPORTED: Final = Unreported.UNREPORTED
