"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own (no process-wide state).

Engine gauges (requests running / waiting, KV blocks, prefix-hit rate, tokens/s) are set by the engine thread
after every step from `Engine.stats()`, and the preemptions counter is advanced from it; latencies are observed
there as tokens come out (time to first token once per request, inter-token latency per sample).

Counters are named without `_total` (prometheus_client appends it: `hf_paged_preemptions_total`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Every metric the server exports, prefixed `hf_paged_`."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"hf_paged_{name}", doc, registry=registry)

        self.running = gauge("requests_running", "Requests prefilling or decoding in the engine.")
        self.waiting = gauge("requests_waiting", "Requests queued in the engine (not admitted, or preempted).")
        self.blocks_in_use = gauge("kv_blocks_in_use", "KV blocks referenced by live requests.")
        self.blocks_cached = gauge("kv_blocks_cached", "Unreferenced KV blocks kept for prefix hits (evictable).")
        self.blocks_total = gauge("kv_blocks_total", "KV blocks the pool has allocated storage for.")
        self.prefix_hit_rate = gauge("prefix_hit_rate", "Prompt tokens served from the prefix cache / tokens looked up.")
        self.preemptions = Counter("hf_paged_preemptions", "Requests preempted for memory.", registry=registry)
        self._preemptions_seen = 0  # Engine.stats().preemptions already counted
        self.tokens_per_s = gauge("tokens_per_second", "Output tokens per second of engine step time.")
        self.generated = Counter("hf_paged_generation_tokens", "Output tokens produced.", registry=registry)
        self.prompt_tokens = Counter("hf_paged_prompt_tokens", "Prompt tokens received.", registry=registry)
        self.finished = Counter(
            "hf_paged_requests_finished", "Requests finished, by finish reason.", ["finish_reason"], registry=registry
        )
        self.aborted = Counter("hf_paged_requests_aborted", "Requests cancelled (client gone).", registry=registry)
        self.rejected = Counter("hf_paged_requests_rejected", "Requests refused, by reason.", ["reason"], registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"hf_paged_{name}", doc, buckets=_LATENCY_BUCKETS, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "From a request's arrival to its first token (once per request).")
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens of one sample.")
        self.e2e = histogram("request_latency_seconds", "From a request's arrival to its last token.")

    def record_engine(self, stats: EngineStats) -> None:
        """Sets the engine gauges from `Engine.stats()`."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.blocks_in_use.set(stats.pool.blocks_in_use)
        self.blocks_cached.set(stats.pool.blocks_cached)
        self.blocks_total.set(stats.pool.blocks_total)
        queried = stats.prefix_query_tokens
        self.prefix_hit_rate.set(stats.prefix_hit_tokens / queried if queried else 0.0)
        if stats.preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.preemptions
        self.tokens_per_s.set(stats.tokens_per_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
