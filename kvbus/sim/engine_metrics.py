"""A simulated engine's ``/metrics``: the series vLLM's OpenAI server exports, under
vLLM's names and labels (``model_name``, ``engine``), so dashboards and routers that
scrape real engines read a simulated one unchanged. One registry per engine."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}
        registry = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=registry).labels(**values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=registry).labels(**values)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self._values = values
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        ).labels(**values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        ).labels(**values)

    def record_step(self, stats: Any) -> None:
        """One step's `SchedulerStats`."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        prefix = stats.prefix_cache_stats
        self.prefix_queries.inc(prefix.queries)
        self.prefix_hits.inc(prefix.hits)
        self.preemptions.inc(getattr(prefix, "preempted_requests", 0))

    def finished(self, reason: str, prompt: int, generated: int) -> None:
        self._success.labels(**self._values, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
