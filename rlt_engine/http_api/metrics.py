"""Prometheus metrics of the HTTP server: per-request series it measures, engine series from health().

Request, token and latency series count the requests served over HTTP (IPC clients talk to the
engine directly and are not seen here). KV usage, live workers, restarts, replays, preemptions
and the prefix cache's hits describe the whole engine: they are read from a HealthReport at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protocol.messages import HealthReport, RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
LOOP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


class EngineCollector:
    """Engine-wide series from the latest HealthReport (`engine_up` 0 when the engine did not answer)."""

    def __init__(self) -> None:
        self.report: HealthReport | None = None
        self.up = False

    def update(self, report: HealthReport | None) -> None:
        """Remember a fresh report (None: the engine did not answer; counters keep their last value)."""
        self.up = report is not None
        if report is not None:
            self.report = report

    def collect(self) -> Iterator[Metric]:
        """The engine series (prometheus_client collector protocol)."""
        yield GaugeMetricFamily("rlt_engine_up", "1 when the engine answered the last health check", value=self.up)
        report = self.report
        if report is None:
            return
        alive = [w for w in report.workers if w.alive] if self.up else []
        yield GaugeMetricFamily("rlt_workers_alive", "Worker processes alive", value=len(alive))
        used = GaugeMetricFamily("rlt_kv_blocks_used", "KV blocks in use, per worker", labels=["worker"])
        total = GaugeMetricFamily("rlt_kv_blocks_total", "KV blocks in the pool, per worker", labels=["worker"])
        usage = GaugeMetricFamily("rlt_kv_usage_ratio", "Fraction of KV blocks in use, per worker", labels=["worker"])
        cached = GaugeMetricFamily("rlt_kv_blocks_cached", "KV blocks the prefix cache holds (idle ones count as "
                                   "free), per worker", labels=["worker"])
        for w in alive:
            used.add_metric([str(w.index)], w.kv_blocks_used)
            total.add_metric([str(w.index)], w.kv_blocks_total)
            usage.add_metric([str(w.index)], w.kv_blocks_used / max(w.kv_blocks_total, 1))
            cached.add_metric([str(w.index)], w.kv_blocks_cached)
        yield from (used, total, usage, cached)
        yield GaugeMetricFamily("rlt_engine_requests_running", "Requests running in the engine (all clients)",
                                value=report.running)
        yield GaugeMetricFamily("rlt_engine_requests_waiting", "Requests waiting in the engine (all clients)",
                                value=report.waiting)
        yield CounterMetricFamily("rlt_worker_restarts", "Replacement workers started",
                                  value=report.num_worker_restarts)
        yield CounterMetricFamily("rlt_replays", "Requests replayed after a worker died", value=report.num_replays)
        yield CounterMetricFamily("rlt_preemptions", "Requests preempted for KV space", value=report.num_preemptions)
        yield CounterMetricFamily("rlt_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                  "(one lookup per admission)", value=report.prefix_cache_queries)
        yield CounterMetricFamily("rlt_prefix_cache_hits", "Prompt tokens whose K/V came from the prefix cache",
                                  value=report.prefix_cache_hits)
        yield GaugeMetricFamily("rlt_prefix_cache_hit_ratio", "prefix_cache_hits / prefix_cache_queries since start",
                                value=report.prefix_cache_hit_ratio)


class Metrics:
    """Every series of one HTTP server, in its own registry."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("rlt_requests", "Requests (one per choice) finished, by finish reason",
                                ["finish_reason"], registry=registry)
        self.rejected = Counter("rlt_requests_rejected", "HTTP requests refused, by status code", ["status"],
                                registry=registry)
        self.prompt_tokens = Counter("rlt_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter("rlt_generation_tokens", "Tokens generated", registry=registry)
        self.running = Gauge("rlt_http_requests_running", "Requests (choices) in flight over HTTP", registry=registry)
        self.ttft = Histogram("rlt_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.itl = Histogram("rlt_inter_token_latency_seconds", "Time between successive deltas of a request",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("rlt_e2e_request_latency_seconds", "Request latency, arrival to final output",
                             buckets=E2E_BUCKETS, registry=registry)
        self.loops = Histogram("rlt_loops_per_token", "Loops run for each generated token (its exit depth)",
                               buckets=LOOP_BUCKETS, registry=registry)
        self.engine = EngineCollector()
        registry.register(self.engine)  # type: ignore[arg-type]

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        """Start timing one admitted request (one choice)."""
        return RequestTracker(self, num_prompt_tokens)


class RequestTracker:
    """Timings and counts of one request, observed as its deltas arrive; `end()` records it once.

    A request counts from its first delta (the engine admitted it); one refused before that is
    counted by HTTP status in `rlt_requests_rejected` instead.
    """

    def __init__(self, metrics: Metrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = self.last = time.monotonic()
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0
        self.admitted = False
        self.ended = False

    def on_delta(self, delta: RequestOutput) -> None:
        """Observe one delta: TTFT for the first tokens, ITL after, loops for each token."""
        m = self.metrics
        if not self.admitted:
            self.admitted = True
            m.running.inc()
            m.prompt_tokens.inc(self.num_prompt_tokens)
        if not delta.token_ids:
            return
        now = time.monotonic()
        (m.ttft if self.num_tokens == 0 else m.itl).observe(now - self.last)
        self.last = now
        self.num_tokens += len(delta.token_ids)
        m.generation_tokens.inc(len(delta.token_ids))
        for depth in delta.exit_depths:
            m.loops.observe(depth)

    def end(self, finish_reason: str | None) -> None:
        """Record an admitted request as finished (`abort` when the client left); idempotent."""
        if self.ended or not self.admitted:
            return
        self.ended = True
        m = self.metrics
        m.running.dec()
        m.requests.labels(finish_reason or "abort").inc()
        m.e2e.observe(time.monotonic() - self.arrival)
