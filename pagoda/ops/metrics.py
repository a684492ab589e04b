"""Prometheus metrics with vLLM's names under the prefix `pagoda:`, labelled with the model name.

Everything is recorded in the API process, which is correct across the two processes without
prometheus_client's multiprocess mode: the engine core sends a stats snapshot (running, waiting,
KV usage, cumulative prefix-cache and preemption counters) and the tokens scheduled per step with
every message, and the per-request histograms are observed here from the request's lifecycle
(`pagoda.ops.request_events`). Snapshot values are read at scrape time by a custom collector, so a
scrape always shows the core's latest report.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.contracts.messages import EngineCoreStats
from pagoda.ops.request_events import FinishedRequest

PREFIX = "pagoda:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to and including the first value >= limit."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            out.append(float(m * scale))
            if m * scale >= limit:
                return out
        scale *= 10


class _CoreStatsCollector(Collector):
    """Gauges and counters read from the engine core's latest stats snapshot at scrape time."""

    def __init__(self, model_name: str, latest: Callable[[], EngineCoreStats | None]) -> None:
        self.model_name = model_name
        self.latest = latest

    def collect(self) -> Iterable:
        s = self.latest() or EngineCoreStats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Number of requests in the engine's running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (recompute) by the scheduler.", s.num_preemptions)
        yield counter("spec_decode_num_drafts", "Speculative steps of a request (rows with draft tokens).",
                      s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(s.spec_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos

    def describe(self) -> Iterable:
        return self.collect()


class _WeightVersionCollector(Collector):
    """pagoda:weight_version_info{weight_version=...} 1: the version served now, read at scrape time."""

    def __init__(self, model_name: str, version: Callable[[], str]) -> None:
        self.model_name = model_name
        self.version = version

    def collect(self) -> Iterable:
        g = GaugeMetricFamily(PREFIX + "weight_version_info", "The weight version served (value 1).",
                              labels=["model_name", "weight_version"])
        g.add_metric([self.model_name, self.version() or ""], 1)
        yield g

    def describe(self) -> Iterable:
        return self.collect()


class ServerMetrics:
    """The server's metrics registry; `render()` is the /metrics body."""

    def __init__(self, model_name: str, max_model_len: int, latest_stats: Callable[[], EngineCoreStats | None],
                 weight_version: Callable[[], str] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        self.registry.register(_CoreStatsCollector(model_name, latest_stats))
        if weight_version is not None:
            self.registry.register(_WeightVersionCollector(model_name, weight_version))
        self._by_version = Counter(PREFIX + "request_success_by_weight_version",
                                   "Requests finished, by the weight version that produced them.",
                                   ["model_name", "weight_version"], registry=reg)
        token_buckets = one_two_five_buckets(max(max_model_len, 1))

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced output.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(
            PREFIX + "request_success", "Requests ended, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=reg,
        )
        # Every reason's series exists from the start (at 0, as vLLM does), so that the first
        # request to end with a reason shows in rate()/increase() instead of creating the series.
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive outputs of a sequence.", _ITL_BUCKETS)
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Per request: decode time / (output tokens - 1), per sequence.",
            _ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last output.", _REQUEST_TIME_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from entering the engine to first scheduled.",
                          _REQUEST_TIME_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                            _REQUEST_TIME_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from the first token to the last.",
                           _REQUEST_TIME_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Time from first scheduled to the last token.",
                              _REQUEST_TIME_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.", token_buckets)
        self.generation_len = hist("request_generation_tokens", "Generated tokens of finished requests.",
                                   token_buckets)
        self.max_tokens = hist("request_params_max_tokens", "The max_tokens parameter of finished requests.",
                               token_buckets)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens scheduled per engine step.",
                                     one_two_five_buckets(16384))
        # Plain running totals for the periodic status line (reading Counter values back is clumsy).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    # -- observations (the request-event tracker calls these) -----------------------------------
    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.total_prompt_tokens += num_prompt_tokens

    def on_tokens(self, num_tokens: int, since_previous: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        self.total_generation_tokens += num_tokens
        if since_previous is not None:
            self.itl.observe(since_previous)

    def on_iteration_tokens(self, counts: list[int]) -> None:
        for n in counts:
            self.iteration_tokens.observe(n)

    def on_finished(self, r: FinishedRequest) -> None:
        self._success.labels(self.model_name, r.finish_reason).inc()
        self._by_version.labels(self.model_name, r.weight_version or "").inc()
        self.e2e.observe(r.e2e_latency)
        self.prompt_len.observe(r.num_prompt_tokens)
        self.generation_len.observe(r.num_generation_tokens)
        if r.max_tokens is not None:
            self.max_tokens.observe(r.max_tokens)
        if r.queue_time is not None:
            self.queue.observe(r.queue_time)
        if r.prefill_time is not None:
            self.prefill.observe(r.prefill_time)
        if r.decode_time is not None:
            self.decode.observe(r.decode_time)
        tpot = r.time_per_output_token
        if tpot is not None:
            self.tpot.observe(tpot)
        if r.inference_time is not None:
            self.inference.observe(r.inference_time)

    def on_aborted(self, request_id: str) -> None:
        self._success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
