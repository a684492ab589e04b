"""Prometheus metrics with vLLM's names under the prefix `pagoda:` (or `vllm:`, `--metrics-prefix
vllm`, so that vLLM's dashboards and alerts work unchanged), labelled as vLLM's: the model name and
the engine's index (`engine`, "0" for the one engine core).

Everything is recorded in the API process, which is correct across the two processes without
prometheus_client's multiprocess mode: the engine core sends a stats snapshot (running, waiting,
KV usage, cumulative prefix-cache and preemption counters) and the tokens scheduled per step with
every message, and the per-request histograms are observed here from the request's lifecycle
(`pagoda.ops.request_events`). Snapshot values are read at scrape time by a custom collector, so a
scrape always shows the core's latest report.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.contracts.messages import EngineCoreStats
from pagoda.ops.request_events import FinishedRequest

METRICS_PREFIXES = ("pagoda", "vllm")
OWN_PREFIX = "pagoda:"  # series vLLM has no counterpart of keep this prefix under either
LABELS = ["model_name", "engine"]
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
    """Gauges and counters read from the engine core's latest stats snapshot at scrape time. With
    data-parallel replicas (`by_engine`), one series per replica under vLLM's `engine` label."""

    def __init__(self, model_name: str, latest: Callable[[], EngineCoreStats | None], prefix: str, engine: str,
                 by_engine: Callable[[], dict[str, EngineCoreStats]] | None = None) -> None:
        self.model_name = model_name
        self.latest = latest
        self.prefix = prefix
        self.engine = engine
        self.by_engine = by_engine

    def collect(self) -> Iterable:
        if self.by_engine is None:
            yield from self._families(self.latest() or EngineCoreStats(), [self.model_name, self.engine])
            return
        merged: dict[str, Any] = {}
        for engine, s in sorted(self.by_engine().items()):
            for family in self._families(s, [self.model_name, engine]):
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()

    def _families(self, s: EngineCoreStats, labels: list[str]) -> Iterable:
        prefix = self.prefix

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(prefix + name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float, own: bool = False) -> CounterMetricFamily:
            c = CounterMetricFamily((OWN_PREFIX if own else prefix) + name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Number of requests in the engine's running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions by the scheduler (recompute or swap).", s.num_preemptions)
        # The second KV tier (--kv-offloading-size): its hits and misses in prompt tokens, bytes moved, swaps
        # (Pagoda's own: vLLM has no such series, so they keep pagoda: under --metrics-prefix vllm).
        yield counter("kv_offload_queries", "Prompt tokens looked up in the second KV tier (first-tier misses).",
                      s.kv_offload_queries, own=True)
        yield counter("kv_offload_hits", "Prompt tokens loaded from the second KV tier instead of computed.",
                      s.kv_offload_hits, own=True)
        yield counter("kv_offload_bytes_saved", "Bytes copied from the KV cache to the second tier.",
                      s.kv_offload_bytes_saved, own=True)
        yield counter("kv_offload_bytes_loaded", "Bytes copied from the second tier back to the KV cache.",
                      s.kv_offload_bytes_loaded, own=True)
        yield counter("num_swaps_out", "Preemptions that swapped the request's KV blocks to the second tier.",
                      s.num_swaps_out, own=True)
        yield counter("num_swaps_in", "Swapped-out requests resumed from the second tier.", s.num_swaps_in, own=True)
        yield counter("spec_decode_num_drafts", "Speculative steps of a request (rows with draft tokens).",
                      s.spec_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=[*LABELS, "position"])
        for pos, n in enumerate(s.spec_num_accepted_tokens_per_pos):
            per_pos.add_metric([*labels, str(pos)], n)
        yield per_pos

    def describe(self) -> Iterable:
        return self.collect()


class _WeightVersionCollector(Collector):
    """pagoda:weight_version_info{weight_version=...} 1: the version served now, read at scrape time."""

    def __init__(self, model_name: str, version: Callable[[], str]) -> None:
        self.model_name = model_name
        self.version = version

    def collect(self) -> Iterable:
        g = GaugeMetricFamily(OWN_PREFIX + "weight_version_info", "The weight version served (value 1).",
                              labels=["model_name", "weight_version"])
        g.add_metric([self.model_name, self.version() or ""], 1)
        yield g

    def describe(self) -> Iterable:
        return self.collect()


class ServerMetrics:
    """The server's metrics registry; `render()` is the /metrics body."""

    def __init__(self, model_name: str, max_model_len: int, latest_stats: Callable[[], EngineCoreStats | None],
                 stats_by_engine: Callable[[], dict[str, EngineCoreStats]] | None = None,
                 prefix: str = "pagoda", engine: str = "0", weight_version: Callable[[], str] | None = None) -> None:
        """`stats_by_engine`: data-parallel replicas' stats by index (one series each); `prefix`: one of
        METRICS_PREFIXES; `engine`: the engine core's index, vLLM's `engine` label; `weight_version`: the
        version served now (Pagoda's own series, always under `pagoda:`)."""
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        prefix += ":"
        self.model_name = model_name
        self.engine = engine
        self.registry = CollectorRegistry()
        reg, labels = self.registry, LABELS
        self.registry.register(_CoreStatsCollector(model_name, latest_stats, prefix, engine, stats_by_engine))
        if weight_version is not None:
            self.registry.register(_WeightVersionCollector(model_name, weight_version))
        self._by_version = Counter(OWN_PREFIX + "request_success_by_weight_version",
                                   "Requests finished, by the weight version that produced them.",
                                   ["model_name", "weight_version"], registry=reg)
        token_buckets = one_two_five_buckets(max(max_model_len, 1))

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=reg).labels(model_name, engine)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=reg).labels(model_name, engine)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced output.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter(
            prefix + "request_success", "Requests ended, by finish reason (stop, length, abort).",
            [*LABELS, "finished_reason"], registry=reg,
        )
        # Every reason's series exists from the start (at 0, as vLLM does), so that the first
        # request to end with a reason shows in rate()/increase() instead of creating the series.
        for reason in FINISH_REASONS:
            self._success.labels(model_name, engine, reason)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive outputs of a sequence.", _ITL_BUCKETS)
        # vLLM's older name of the same observations, which its Grafana dashboard still reads.
        self.tpot_old = hist("time_per_output_token_seconds", "Deprecated: inter_token_latency_seconds.", _ITL_BUCKETS)
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
        self.params_n = hist("request_params_n", "The n parameter of finished requests.", (1, 2, 5, 10, 20))
        self.max_generation = hist("request_max_num_generation_tokens",
                                   "The most tokens one sequence of a finished request generated.", token_buckets)
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
            self.tpot_old.observe(since_previous)

    def on_iteration_tokens(self, counts: list[int]) -> None:
        for n in counts:
            self.iteration_tokens.observe(n)

    def on_finished(self, r: FinishedRequest) -> None:
        self._success.labels(self.model_name, self.engine, r.finish_reason).inc()
        self._by_version.labels(self.model_name, r.weight_version or "").inc()
        self.e2e.observe(r.e2e_latency)
        self.prompt_len.observe(r.num_prompt_tokens)
        self.generation_len.observe(r.num_generation_tokens)
        if r.max_tokens is not None:
            self.max_tokens.observe(r.max_tokens)
        self.params_n.observe(r.num_sequences)
        if r.max_sequence_tokens is not None:
            self.max_generation.observe(r.max_sequence_tokens)
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
        self._success.labels(self.model_name, self.engine, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
