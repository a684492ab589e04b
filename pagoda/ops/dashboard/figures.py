"""The dashboard's figures, computed from the Prometheus registry that /metrics renders: gauges as
they are, rates and hit rates from counter deltas, and latency percentiles from histogram bucket
deltas over a sliding window (interpolated within a bucket, as PromQL's `histogram_quantile`).

The series it reads are named once, in `SERIES` (under `pagoda:`; a server started with
`--metrics-prefix vllm` has its `vllm:` series read as `pagoda:` ones), so that a change of metric
names is one change here. Labels other than the series' own are summed over (`model_name`, and
`engine`: the total over data-parallel replicas). `History` keeps a sample per second for the windows.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable

from prometheus_client import CollectorRegistry

from pagoda.ops.metrics import FINISH_REASONS, OWN_PREFIX as PREFIX
from pagoda.ops.tenant_usage import TENANT_GENERATION_TOKENS, TENANT_PROMPT_TOKENS, TENANT_REQUESTS

# Sample name -> value, with labels other than model_name and engine as a sorted tuple.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

SERIES = {
    "running": PREFIX + "num_requests_running",
    "waiting": PREFIX + "num_requests_waiting",
    "kv_usage": PREFIX + "kv_cache_usage_perc",
    "prompt_tokens": PREFIX + "prompt_tokens_total",
    "generation_tokens": PREFIX + "generation_tokens_total",
    "request_success": PREFIX + "request_success_total",
    "prefix_queries": PREFIX + "prefix_cache_queries_total",
    "prefix_hits": PREFIX + "prefix_cache_hits_total",
    "preemptions": PREFIX + "num_preemptions_total",
    "spec_draft_tokens": PREFIX + "spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": PREFIX + "spec_decode_num_accepted_tokens_total",
    "ttft": PREFIX + "time_to_first_token_seconds",
    "itl": PREFIX + "inter_token_latency_seconds",
    "e2e": PREFIX + "e2e_request_latency_seconds",
    "tenant_requests": TENANT_REQUESTS + "_total",
    "tenant_prompt_tokens": TENANT_PROMPT_TOKENS + "_total",
    "tenant_generation_tokens": TENANT_GENERATION_TOKENS + "_total",
}
LATENCIES = ("ttft", "itl", "e2e")
_VLLM = "vllm:"
_SUMMED_LABELS = ("model_name", "engine")
QUANTILES = (0.5, 0.9, 0.99)


def dashboard_registry(registry: CollectorRegistry) -> Any:
    """`registry` restricted to the samples the figures read (under either prefix), for the
    once-a-second sample: ~80 samples, not every histogram's buckets (0.64 against 2.2 ms of the API
    process's CPU a read, which streaming requests share with the core's threads)."""
    names = set()
    for name in SERIES.values():
        for n in {name, _VLLM + name[len(PREFIX):] if name.startswith(PREFIX) else name}:
            names.update((n, n + "_bucket"))
    return registry.restricted_registry(sorted(names))


def read_samples(registry: CollectorRegistry) -> Samples:
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            name = PREFIX + s.name[len(_VLLM):] if s.name.startswith(_VLLM) else s.name
            key = (name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in _SUMMED_LABELS)))
            out[key] = out.get(key, 0.0) + s.value
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets sorted by bound, +Inf last; None
    when empty. An observation in the +Inf bucket reads as the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


class History:
    """Registry samples taken every second or so, old enough to cover the longest window."""

    def __init__(self, read: Callable[[], Samples], keep_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.read = read
        self.keep_s = keep_s
        self.clock = clock
        self._samples: deque[tuple[float, Samples]] = deque()
        self.sample()  # the start: every counter at its first value

    def sample(self) -> tuple[float, Samples]:
        now = self.clock()
        entry = (now, self.read())
        self._samples.append(entry)
        # Keep the newest sample at least keep_s old: it is the baseline of the longest window.
        while len(self._samples) >= 2 and self._samples[1][0] <= now - self.keep_s:
            self._samples.popleft()
        return entry

    def baseline(self, since: float) -> tuple[float, Samples]:
        """The newest sample taken at or before `since`, else the oldest one kept."""
        best = self._samples[0]
        for entry in self._samples:
            if entry[0] > since:
                break
            best = entry
        return best


def _get(s: Samples, series: str, **labels: str) -> float:
    return s.get((SERIES[series], tuple(sorted(labels.items()))), 0.0)


def _buckets(s: Samples, series: str) -> dict[float, float]:
    name = SERIES[series] + "_bucket"
    return {float(dict(labels)["le"]): v for (n, labels), v in s.items() if n == name}


def _latency(now: Samples, base: Samples, series: str) -> dict[str, Any]:
    cur, old = _buckets(now, series), _buckets(base, series)
    delta = sorted((le, c - old.get(le, 0.0)) for le, c in cur.items())
    out: dict[str, Any] = {f"p{round(q * 100)}": histogram_quantile(q, delta) for q in QUANTILES}
    out["count"] = int(delta[-1][1]) if delta else 0
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _tenants(now: Samples, base: Samples, elapsed: float) -> list[dict[str, Any]]:
    names = sorted({dict(labels).get("tenant", "") for (n, labels) in now if n == SERIES["tenant_requests"]})
    out = []
    for t in names:
        gen = _get(now, "tenant_generation_tokens", tenant=t)
        out.append({
            "tenant": t,
            "requests": int(_get(now, "tenant_requests", tenant=t)),
            "prompt_tokens": int(_get(now, "tenant_prompt_tokens", tenant=t)),
            "generation_tokens": int(gen),
            "generation_tokens_per_s": (gen - _get(base, "tenant_generation_tokens", tenant=t)) / elapsed,
        })
    return out


def figures(history: History, rate_window_s: float, window_s: float, spec_enabled: bool) -> dict[str, Any]:
    """Every figure of the dashboard from the registry now and the history's baselines."""
    t_now = history.clock()
    now = history.read()
    t_rate, rate_base = history.baseline(t_now - rate_window_s)
    t_win, win_base = history.baseline(t_now - window_s)
    rate_elapsed = max(t_now - t_rate, 1e-9)

    def rate(series: str) -> float:
        return (_get(now, series) - _get(rate_base, series)) / rate_elapsed

    def in_window(series: str) -> float:
        return _get(now, series) - _get(win_base, series)

    finished = {r: int(_get(now, "request_success", finished_reason=r)) for r in FINISH_REASONS}
    out: dict[str, Any] = {
        "rate_window_s": round(t_now - t_rate, 3),
        "window_s": round(t_now - t_win, 3),
        "running": int(_get(now, "running")),
        "waiting": int(_get(now, "waiting")),
        "kv_cache_usage_perc": _get(now, "kv_usage"),
        "prompt_tokens_per_s": rate("prompt_tokens"),
        "generation_tokens_per_s": rate("generation_tokens"),
        "totals": {
            "prompt_tokens": int(_get(now, "prompt_tokens")),
            "generation_tokens": int(_get(now, "generation_tokens")),
            "requests_finished": sum(finished.values()),
            "requests_by_reason": finished,
            "preemptions": int(_get(now, "preemptions")),
            "prefix_cache_queries": int(_get(now, "prefix_queries")),
            "prefix_cache_hits": int(_get(now, "prefix_hits")),
        },
        "preemptions_in_window": int(in_window("preemptions")),
        "prefix_cache_hit_rate": _ratio(in_window("prefix_hits"), in_window("prefix_queries")),
        "prefix_cache_hit_rate_total": _ratio(_get(now, "prefix_hits"), _get(now, "prefix_queries")),
        "latency": {name: _latency(now, win_base, name) for name in LATENCIES},
        "spec_decode": None,
        "tenants": _tenants(now, rate_base, rate_elapsed),
    }
    if spec_enabled:
        drafted, accepted = _get(now, "spec_draft_tokens"), _get(now, "spec_accepted_tokens")
        out["spec_decode"] = {
            "draft_tokens": int(drafted),
            "accepted_tokens": int(accepted),
            "acceptance_rate": _ratio(in_window("spec_accepted_tokens"), in_window("spec_draft_tokens")),
            "acceptance_rate_total": _ratio(accepted, drafted),
        }
    return out
