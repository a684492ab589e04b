"""`bench serve`'s numbers: the summary metrics over a run's requests (latency percentiles,
throughput, goodput), the timeline of tokens/s and requests in flight, and the printed report."""

from __future__ import annotations

import math
from typing import Any

from pagoda.bench.common import format_table, summarize
from pagoda.bench.serve_types import RequestResult, ServeConfig


def timeline(results: list[RequestResult], duration: float, bins: int = 60) -> dict[str, Any]:
    """Output tokens/s and requests in flight over time, in equal bins over the run."""
    ok = [r for r in results if r.success]
    start = min((r.send_time for r in results), default=0.0)
    width = max(duration / bins, 1e-3)
    n = max(1, math.ceil(duration / width))
    tokens = [0.0] * n
    in_flight = [0] * n
    for r in ok:
        # Spread usage-reported tokens over the events when a chunk carries several tokens.
        per_event = r.output_tokens / len(r.token_times)
        for t in r.token_times:
            tokens[min(int((t - start) / width), n - 1)] += per_event
    for r in results:
        a = int((r.send_time - start) / width)
        b = min(int((r.end_time - start) / width), n - 1)
        for i in range(max(a, 0), b + 1):
            in_flight[i] += 1
    return {
        "bin_s": width,
        "t_s": [(i + 0.5) * width for i in range(n)],
        "output_tokens_per_s": [x / width for x in tokens],
        "in_flight": in_flight,
    }


def max_in_flight(results: list[RequestResult]) -> int:
    """The most requests open at once: a sweep over send (+1) and end (-1) events."""
    events = sorted([(r.send_time, 1) for r in results] + [(r.end_time, -1) for r in results], key=lambda e: (e[0], e[1]))
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def compute_metrics(results: list[RequestResult], duration: float, cfg: ServeConfig) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    in_tokens = sum(r.prompt_len for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok]
    dur = duration if duration > 0 else float("nan")

    def good(r: RequestResult) -> bool:
        checks = [
            (cfg.slo_ttft_ms, r.ttft),
            (cfg.slo_tpot_ms, r.tpot if r.tpot is not None else 0.0),
            (cfg.slo_e2e_ms, r.e2e),
        ]
        return all(v is not None and v * 1e3 <= slo for slo, v in checks if slo is not None)

    has_slo = any(s is not None for s in (cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_e2e_ms))
    n_good = sum(good(r) for r in ok) if has_slo else None
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "output_len_mismatches": sum(r.output_tokens != r.output_len for r in ok),
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_in_flight": max_in_flight(results),
        "ttft_ms": summarize(ttfts, 1e3),
        "tpot_ms": summarize(tpots, 1e3),
        "itl_ms": summarize(itls, 1e3),
        "e2e_ms": summarize(e2es, 1e3),
        "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms, "e2e_ms": cfg.slo_e2e_ms},
        "good_requests": n_good,
        "goodput": (n_good / dur) if n_good is not None else None,
    }


def print_report(m: dict[str, Any], cfg: ServeConfig, model: str) -> None:
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    conc = cfg.max_concurrency or "unlimited"
    print(f"serve benchmark: {cfg.base_url} model {model}, {cfg.num_prompts} requests at {rate} req/s, max concurrency {conc}")
    lines = [
        ("successful requests", m["completed"]),
        ("failed requests", m["failed"]),
        ("duration (s)", m["duration_s"]),
        ("input tokens", m["total_input_tokens"]),
        ("output tokens", m["total_output_tokens"]),
        ("request throughput (req/s)", m["request_throughput"]),
        ("output token throughput (tok/s)", m["output_token_throughput"]),
        ("total token throughput (tok/s)", m["total_token_throughput"]),
        ("max requests in flight", m["max_in_flight"]),
    ]
    if m["goodput"] is not None:
        lines.append(("goodput (req/s)", m["goodput"]))
        lines.append(("requests within SLO", f"{m['good_requests']}/{m['completed'] + m['failed']}"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        shown = f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
        print(f"  {k.ljust(width)}  {shown}")
    rows = [
        [name, m[key]["mean"], m[key]["p50"], m[key]["p90"], m[key]["p99"]]
        for name, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"), ("ITL ms", "itl_ms"), ("E2E ms", "e2e_ms"))
    ]
    print(format_table(["latency", "mean", "p50", "p90", "p99"], rows))
    if m["output_len_mismatches"]:
        print(f"warning: {m['output_len_mismatches']} requests did not return exactly {cfg.output_len} tokens (ignore_eos unsupported?)")
    for err in m["errors"]:
        print(f"error: {err}")
