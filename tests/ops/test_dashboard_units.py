"""The dashboard's parts without a server: percentiles from histogram buckets, rates and windows
from the sampled registry (on a fake clock), per-tenant counters, the recent-requests list and the
waterfall of a timeline. The end-to-end tests (a real server, Chromium, a pty) are beside these."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.contracts.messages import EngineCoreOutputs, EngineCoreStats
from pagoda.ops.dashboard.figures import SERIES, History, dashboard_registry, figures, histogram_quantile, read_samples
from pagoda.ops.dashboard.waterfall import segments
from pagoda.ops.metrics import ServerMetrics
from pagoda.ops.recent_requests import RecentRequests
from pagoda.ops.request_events import FinishedRequest, RequestTracker
from pagoda.ops.tenant_usage import TenantUsage
from tests.ops.test_ops_units import _delta

INF = math.inf


def test_histogram_quantile_interpolates_within_the_bucket_as_promql():
    buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (INF, 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.9)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    # Past the last finite bound: that bound (PromQL does the same).
    assert histogram_quantile(0.99, [(1.0, 1.0), (2.0, 1.0), (INF, 5.0)]) == 2.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _setup(spec_stats: EngineCoreStats | None = None):
    stats = [spec_stats or EngineCoreStats(num_running=3, num_waiting=2, kv_usage=0.25)]
    metrics = ServerMetrics("tiny", 256, lambda: stats[0])
    usage = TenantUsage(metrics.registry, "tiny")
    clock = Clock()
    sampled = dashboard_registry(metrics.registry)  # what the dashboard samples
    history = History(lambda: read_samples(sampled), keep_s=60, clock=clock)
    return metrics, usage, clock, history, stats


@pytest.mark.parametrize("prefix", ["pagoda", "vllm"])
def test_the_sampled_registry_holds_every_series_the_figures_read(prefix):
    """The once-a-second sample reads a restricted registry: it must hold exactly the full
    registry's samples of the figures' series (gauges of the core-stats collector, counters,
    histogram buckets, tenants' counters), so that the figures are the same."""
    stats = EngineCoreStats(num_running=3, num_waiting=2, kv_usage=0.25, prefix_cache_queries=7)
    metrics = ServerMetrics("tiny", 256, lambda: stats, prefix=prefix)
    usage = TenantUsage(metrics.registry, "tiny")
    usage.on_request_started("r", "acme", 5)
    metrics.on_first_token(0.3, 10)
    metrics.on_tokens(4, 0.02)
    full = read_samples(metrics.registry)
    names = {n for v in SERIES.values() for n in (v, v + "_bucket")}
    wanted = {k: v for k, v in full.items() if k[0] in names}
    assert {k[0] for k in wanted} >= {SERIES["running"], SERIES["prefix_queries"], SERIES["ttft"] + "_bucket",
                                      SERIES["tenant_prompt_tokens"]}
    assert read_samples(dashboard_registry(metrics.registry)) == wanted
    assert len(wanted) < len(full) / 2  # the point of it


def test_rates_and_windowed_percentiles_follow_the_samples():
    metrics, usage, clock, history, stats = _setup()
    clock.t = 5.0
    for _ in range(10):
        metrics.on_first_token(0.3, 10)  # 100 prompt tokens, TTFT in the (0.25, 0.5] bucket
    metrics.on_tokens(40, None)
    history.sample()
    clock.t = 10.0
    history.sample()
    f = figures(history, rate_window_s=10, window_s=60, spec_enabled=False)
    assert (f["running"], f["waiting"], f["kv_cache_usage_perc"]) == (3, 2, 0.25)
    assert f["rate_window_s"] == 10.0
    assert f["prompt_tokens_per_s"] == pytest.approx(10.0) and f["generation_tokens_per_s"] == pytest.approx(4.0)
    assert f["totals"]["prompt_tokens"] == 100 and f["totals"]["generation_tokens"] == 40
    assert f["latency"]["ttft"]["count"] == 10
    assert f["latency"]["ttft"]["p50"] == pytest.approx(0.375)
    assert f["latency"]["itl"] == {"p50": None, "p90": None, "p99": None, "count": 0}
    assert f["spec_decode"] is None
    # A minute later with nothing new: no rate, and the window no longer holds those TTFTs.
    for t in range(15, 75, 5):
        clock.t = float(t)
        history.sample()
    f = figures(history, rate_window_s=10, window_s=60, spec_enabled=False)
    assert f["prompt_tokens_per_s"] == 0.0 and f["window_s"] == 60.0
    assert f["latency"]["ttft"]["count"] == 0 and f["latency"]["ttft"]["p50"] is None
    assert f["totals"]["prompt_tokens"] == 100


def test_history_keeps_only_what_the_longest_window_needs():
    _, _, clock, history, _ = _setup()
    for t in range(1, 200):
        clock.t = float(t)
        history.sample()
    assert len(history._samples) <= 62
    assert history.baseline(199 - 60)[0] == 139.0
    assert history.baseline(-5)[0] == history._samples[0][0]  # older than kept: the oldest


def test_prefix_hit_rate_preemptions_and_spec_acceptance_come_from_the_core_stats():
    stats = EngineCoreStats(prefix_cache_queries=200, prefix_cache_hits=50, num_preemptions=3,
                            spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=30)
    metrics, _, clock, history, box = _setup(stats)
    clock.t = 1.0
    box[0] = EngineCoreStats(prefix_cache_queries=300, prefix_cache_hits=130, num_preemptions=4,
                             spec_num_drafts=12, spec_num_draft_tokens=50, spec_num_accepted_tokens=35)
    f = figures(history, 10, 60, spec_enabled=True)
    assert f["prefix_cache_hit_rate"] == pytest.approx(80 / 100)  # in the window
    assert f["prefix_cache_hit_rate_total"] == pytest.approx(130 / 300)
    assert f["totals"]["preemptions"] == 4 and f["preemptions_in_window"] == 1
    assert f["spec_decode"] == {"draft_tokens": 50, "accepted_tokens": 35, "acceptance_rate": pytest.approx(0.5),
                                "acceptance_rate_total": pytest.approx(0.7)}


def test_tenant_usage_counts_requests_and_tokens_also_of_aborted_requests():
    metrics, usage, clock, history, _ = _setup()
    tracker = RequestTracker([metrics, usage])
    usage.on_request_started("a1", "team-a", 10)
    usage.on_request_started("a2", "team-a", 7)
    usage.on_request_started("b1", "team-b", 5)
    tracker.on_output(EngineCoreOutputs(), [_delta("a1", [1, 2, 3]), _delta("b1", [4])])
    tracker.on_output(EngineCoreOutputs(), [_delta("a1", [5], finished=True, reason="length"), _delta("a2", [6, 7])])
    tracker.on_abort("a2")
    usage.on_request_tokens("a2", 9)  # after its end: no longer counted
    clock.t = 2.0
    rows = {t["tenant"]: t for t in figures(history, 10, 60, False)["tenants"]}
    assert {k: (v["requests"], v["prompt_tokens"], v["generation_tokens"]) for k, v in rows.items()} == {
        "team-a": (2, 17, 6), "team-b": (1, 5, 1)}
    assert rows["team-a"]["generation_tokens_per_s"] == pytest.approx(3.0)
    text = metrics.render().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, s.labels["tenant"]): s.value for s in fams["pagoda:tenant_generation_tokens"].samples
               if s.name.endswith("_total")}
    assert samples == {("pagoda:tenant_generation_tokens_total", "team-a"): 6.0,
                       ("pagoda:tenant_generation_tokens_total", "team-b"): 1.0}


def _finished(rid: str, reason: str = "stop", tokens: int = 3) -> FinishedRequest:
    return FinishedRequest(rid, reason, 100.0, 101.5, 5, tokens, 0, 16, None, None, 100.2, 101.5)


def test_recent_requests_are_newest_first_bounded_and_keep_live_ones():
    clock = Clock()
    recent = RecentRequests(max_finished=2, clock=clock)
    for i in range(5):
        clock.t = float(i)
        recent.on_request_started(f"r{i}", "team-a", 4 + i)
    clock.t = 10.0
    recent.on_request_tokens("r0", 1)
    recent.on_request_tokens("r0", 2)
    row = recent.rows()[-1]
    assert (row["request_id"], row["status"], row["generation_tokens"], row["ttft"]) == ("r0", "running", 3, 10.0)
    recent.on_finished(_finished("r0"))
    recent.on_finished(_finished("r1", "length"))
    recent.on_aborted("r2")
    # Two ended rows kept at most (r0 dropped), the live ones always.
    assert [(r["request_id"], r["status"]) for r in recent.rows()] == [
        ("r4", "waiting"), ("r3", "waiting"), ("r2", "aborted"), ("r1", "finished")]
    r1 = recent.rows()[-1]
    assert (r1["finish_reason"], r1["e2e"], r1["prompt_tokens"], r1["generation_tokens"]) == ("length", 1.5, 5, 3)
    assert recent.rows(limit=1)[0]["request_id"] == "r4"
    recent.on_aborted("unknown")  # nothing to show, nothing breaks
    assert len(recent.rows()) == 4


TIMELINE = {
    "request_id": "r", "status": "finished", "arrival_time": 100.0, "num_admissions": 2, "num_preemptions": 1,
    "events": [
        {"event": "arrived", "time": 100.0},
        {"event": "admitted", "time": 100.5, "cached_tokens": 16, "resumed": False},
        {"event": "prefill", "time": 100.5, "start": 16, "tokens": 16},
        {"event": "prefill", "time": 101.0, "start": 32, "tokens": 8},
        {"event": "first_token", "time": 101.25},
        {"event": "decode", "start": 101.25, "end": 103.0, "tokens": 9},
        {"event": "preempted", "time": 103.0, "output_tokens": 10},
        {"event": "admitted", "time": 104.0, "cached_tokens": 0, "resumed": True},
        {"event": "prefill", "time": 104.0, "start": 0, "tokens": 50},
        {"event": "decode", "start": 104.5, "end": 105.0, "tokens": 5},
        {"event": "finished", "time": 105.0, "reason": "length", "output_tokens": 16},
    ],
}


def test_waterfall_segments_of_a_preempted_request():
    segs = segments(TIMELINE, now=200.0)
    got = [(s["kind"], s["start"], s["end"], s.get("tokens")) for s in segs]
    assert got == [
        ("queue", 0.0, 0.5, None),
        ("cache_hit", 0.5, 0.5, 16),
        ("prefill", 0.5, 1.0, 16),
        ("prefill", 1.0, 1.25, 8),  # until the first token
        ("decode", 1.25, 3.0, 9),
        ("preempted", 3.0, 4.0, None),  # waiting again until re-admitted
        ("prefill", 4.0, 4.5, 50),
        ("decode", 4.5, 5.0, 5),
        ("finish", 5.0, 5.0, None),
    ]
    assert not any(s["open"] for s in segs)


def test_waterfall_of_a_live_request_ends_open_segments_now():
    waiting = {"request_id": "w", "status": "waiting", "arrival_time": 10.0, "num_admissions": 0,
               "num_preemptions": 0, "events": [{"event": "arrived", "time": 10.0}]}
    assert [(s["kind"], s["end"], s["open"]) for s in segments(waiting, now=12.5)] == [("queue", 2.5, True)]
    decoding = dict(TIMELINE, status="running", events=TIMELINE["events"][:5] + [
        {"event": "decode", "start": 101.25, "end": None, "tokens": None}])
    last = segments(decoding, now=102.0)[-1]
    assert (last["kind"], last["start"], last["end"], last["open"]) == ("decode", 1.25, 2.0, True)


def test_figures_read_vllm_named_series_and_sum_over_replicas():
    """Under --metrics-prefix vllm the series are read as their pagoda: names; with data-parallel
    replicas (one series per `engine` label) the figures are the totals over them."""
    by_engine = {"0": EngineCoreStats(num_running=2, prefix_cache_queries=100, prefix_cache_hits=10),
                 "1": EngineCoreStats(num_running=3, prefix_cache_queries=50, prefix_cache_hits=40)}
    metrics = ServerMetrics("m", 64, lambda: None, lambda: by_engine, prefix="vllm")
    assert "vllm:num_requests_running" in metrics.render().decode()
    samples = read_samples(metrics.registry)
    assert samples[("pagoda:num_requests_running", ())] == 5
    assert samples[("pagoda:prefix_cache_hits_total", ())] == 50
