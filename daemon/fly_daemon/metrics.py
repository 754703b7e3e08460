"""Prometheus metrics of the daemon, in a registry of its own, served on an opt-in loopback port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from fly_llm.common.stats import PromptStats, RequestStats

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Counters, gauges and histograms for requests, batching, tokens and speculation."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fly_requests", "Generate requests by outcome (ok or an error code).",
                                ["outcome"], registry=r)
        self.queue_depth = Gauge("fly_queue_depth", "Requests admitted but not yet in the batch.", registry=r)
        self.active = Gauge("fly_active_requests", "Requests in the running batch.", registry=r)
        self.batch_size = Histogram("fly_batch_size", "Requests per engine step.", buckets=_BATCH_BUCKETS,
                                    registry=r)
        self.prompt_tokens = Counter("fly_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.completion_tokens = Counter("fly_completion_tokens", "Tokens generated.", registry=r)
        self.drafted = Counter("fly_drafted_tokens", "Draft tokens proposed.", registry=r)
        self.accepted = Counter("fly_accepted_tokens", "Draft tokens kept, natively or loosely (FLy).", ["kind"],
                                registry=r)
        self.mat = Gauge("fly_mean_accepted_tokens", "Tokens emitted per target forward, over all requests.",
                         registry=r)
        self.ttft = Histogram("fly_time_to_first_token_seconds", "Admission to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fly_inter_token_latency_seconds", "Time per generated token after the first.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_hit_tokens = Counter("fly_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                                        registry=r)
        self.prefill_tokens = Counter("fly_prefill_tokens", "Prompt tokens prefilled by the target.", registry=r)
        self.cache_evictions = Counter("fly_prefix_cache_evictions", "Prefix-cache blocks evicted.", registry=r)
        self.cache_bytes = Gauge("fly_prefix_cache_bytes", "Bytes of KV held by the prefix cache.", registry=r)
        self._prompt_seen = PromptStats()

    def finished(self, outcome: str, prompt_tokens: int = 0, stats: RequestStats | None = None) -> None:
        """Count one request that ended with `outcome` ('ok' or an error code)."""
        self.requests.labels(outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if stats is not None:
            self.drafted.inc(stats.drafted)
            self.accepted.labels(kind="native").inc(stats.accepted_native)
            self.accepted.labels(kind="loose").inc(stats.accepted_loose)

    def prompt_work(self, stats: PromptStats) -> None:
        """Bring the prompt and prefix-cache metrics up to the engine's running totals (which only grow)."""
        seen = self._prompt_seen
        self.cache_hit_tokens.inc(stats.cached_tokens - seen.cached_tokens)
        self.prefill_tokens.inc(stats.prefilled_tokens - seen.prefilled_tokens)
        self.cache_evictions.inc(stats.cache_evictions - seen.cache_evictions)
        self.cache_bytes.set(stats.cache_bytes)
        self._prompt_seen = stats

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics over HTTP on host:port (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)
