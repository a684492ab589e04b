"""`pagoda bench serve` against a fake OpenAI-compatible server that streams a known number of tokens."""

from __future__ import annotations

import json
import math

import pytest

from pagoda.bench.serve import arrival_offsets, make_prompts
from pagoda.bench.serve_metrics import compute_metrics
from pagoda.bench.serve_types import RequestResult, ServeConfig
from pagoda.entrypoints.cli import main


def _serve_argv(url: str, out, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--vocab-size", "512", "--num-prompts", "12",
            "--input-len-min", "4", "--input-len-max", "30", "--output-len", "7", "--json", str(out), *extra]


def test_serve_all_at_once(fake_server, tmp_path, capsys):
    srv = fake_server(ttft_s=0.02, itl_s=0.002)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main(_serve_argv(srv.url, out, "--plot", str(png), "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000")) == 0
    rec = json.loads(out.read_text())
    m = rec["metrics"]
    assert rec["model"] == "fake-model"  # discovered through /v1/models
    assert m["completed"] == 12 and m["failed"] == 0
    assert m["total_output_tokens"] == 12 * 7 and m["output_len_mismatches"] == 0 and m["usage_reported"]
    assert m["total_input_tokens"] == sum(r["prompt_len"] for r in rec["requests"])
    assert all(4 <= r["prompt_len"] <= 30 for r in rec["requests"])
    d = m["duration_s"]
    assert m["request_throughput"] == pytest.approx(12 / d)
    assert m["output_token_throughput"] == pytest.approx(84 / d)
    assert m["total_token_throughput"] == pytest.approx((84 + m["total_input_tokens"]) / d)
    # The server's delays bound the latencies from below.
    assert m["ttft_ms"]["min"] >= 20 and m["itl_ms"]["count"] == 12 * 6 and m["itl_ms"]["p50"] >= 1.5
    assert m["tpot_ms"]["count"] == 12 and m["e2e_ms"]["min"] >= 20 + 6 * 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[key]
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert m["max_in_flight"] == 12  # all at once
    assert m["good_requests"] == 12 and m["goodput"] == pytest.approx(m["request_throughput"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(rec["timeline"]["output_tokens_per_s"]) * rec["timeline"]["bin_s"] == pytest.approx(84)
    # What the server was sent: token ids, streaming, EOS ignored, the asked length (+1 warm-up).
    assert len(srv.bodies) == 13
    body = srv.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 7 and body["temperature"] == 0
    assert all(isinstance(t, int) and 0 <= t < 512 for t in body["prompt"])
    assert "TTFT ms" in capsys.readouterr().out
    from pagoda.bench.report import render

    assert "| serve | fake-model | 12/0 |" in render([out])


def test_serve_rate_and_concurrency_cap(fake_server, tmp_path):
    srv = fake_server(ttft_s=0.01, itl_s=0.001)
    out = tmp_path / "s.json"
    argv = _serve_argv(srv.url + "/v1", out, "--request-rate", "100", "--max-concurrency", "2", "--model", "x",
                       "--slo-ttft-ms", "0.001", "--num-warmups", "0")
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    m = rec["metrics"]
    assert m["completed"] == 12 and m["total_output_tokens"] == 84
    assert m["max_in_flight"] <= 2
    assert m["good_requests"] == 0 and m["goodput"] == 0  # no request answers in a microsecond
    assert {b["model"] for b in srv.bodies} == {"x"} and len(srv.bodies) == 12
    sends = sorted(r["send_time_s"] for r in rec["requests"])
    assert sends[-1] > 0.02  # spread by the arrival process, not all at 0


def test_serve_counts_failures_and_events_without_usage(fake_server, tmp_path):
    out = tmp_path / "f.json"
    # No usage chunk: tokens are counted from the stream's events.
    srv = fake_server(ttft_s=0.0, itl_s=0.0, send_usage=False)
    assert main(_serve_argv(srv.url, out, "--num-warmups", "0")) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["total_output_tokens"] == 84 and not m["usage_reported"] and m["output_len_mismatches"] == 0

    # Requests whose first prompt token is the fail token get HTTP 500: counted, not fatal.
    prompts = make_prompts(ServeConfig(base_url="", num_prompts=12, input_len_min=4, input_len_max=30, output_len=7), vocab_size=512)
    bad = prompts[3].prompt[0]
    n_bad = sum(p.prompt[0] == bad for p in prompts)
    srv2 = fake_server(ttft_s=0.0, itl_s=0.0, fail_token=bad)
    assert main(_serve_argv(srv2.url, out, "--num-warmups", "0")) == 1
    rec = json.loads(out.read_text())
    m = rec["metrics"]
    assert all(r["e2e_ms"] >= 0 for r in rec["requests"])  # failed requests have an end time too
    assert m["failed"] == n_bad and m["completed"] == 12 - n_bad
    assert m["total_output_tokens"] == 7 * (12 - n_bad)
    assert any("HTTP 500" in e for e in m["errors"])


def test_serve_waits_for_a_starting_server(fake_server, tmp_path):
    srv = fake_server(ttft_s=0.0, itl_s=0.0, unavailable_for=2)
    out = tmp_path / "w.json"
    assert main(_serve_argv(srv.url, out)) == 0
    assert json.loads(out.read_text())["metrics"]["completed"] == 12
    assert len(srv.bodies) == 2 + 1 + 12  # two 503s, the warm-up, the measured requests


def test_serve_unreachable_server(tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--vocab-size", "64", "--num-prompts", "2", "--model", "m",
            "--ready-timeout", "0.5"]
    assert main(argv) == 1
    assert "error" in capsys.readouterr().err


def test_metrics_from_known_timestamps():
    # Two requests with hand-made timelines: every metric follows from the definitions.
    a = RequestResult(0, 10, 3, send_time=0.0, token_times=[0.1, 0.2, 0.4], end_time=0.4, output_tokens=3, success=True)
    b = RequestResult(1, 20, 3, send_time=0.5, token_times=[0.7, 0.8, 0.9], end_time=1.0, output_tokens=3, success=True)
    cfg = ServeConfig(base_url="", slo_ttft_ms=150, slo_tpot_ms=1000)
    m = compute_metrics([a, b], 1.0, cfg)
    assert m["ttft_ms"]["mean"] == pytest.approx(150)
    assert m["tpot_ms"]["mean"] == pytest.approx((150 + 150) / 2)
    assert m["itl_ms"]["min"] == pytest.approx(100)
    assert m["itl_ms"]["max"] == pytest.approx(200)
    assert m["e2e_ms"]["mean"] == pytest.approx(450)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(1.0)  # only a meets TTFT <= 150
    assert m["max_in_flight"] == 1


def test_poisson_arrivals():
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    xs = arrival_offsets(4000, 50.0, 0)
    assert xs == sorted(xs) and xs[0] == 0.0
    assert xs[-1] / 3999 == pytest.approx(1 / 50, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(10, 4.0, 1) == arrival_offsets(10, 4.0, 1)
