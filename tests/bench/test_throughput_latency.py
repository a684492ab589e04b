"""`pagoda bench throughput` and `latency` on a tiny random model: the numbers add up."""

from __future__ import annotations

import argparse
import json

import pytest

from pagoda.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "256", "--seed", "0"]


def _check_stats(s: dict, num_requests: int, prompt_tokens: int, output_tokens: int) -> None:
    assert s["num_requests"] == num_requests
    assert s["prompt_tokens"] == prompt_tokens
    assert s["output_tokens"] == output_tokens
    t = s["elapsed_s"]
    assert t > 0
    assert s["requests_per_s"] == pytest.approx(num_requests / t)
    assert s["output_tokens_per_s"] == pytest.approx(output_tokens / t)
    assert s["total_tokens_per_s"] == pytest.approx((prompt_tokens + output_tokens) / t)


def test_throughput_random_with_hf(tiny_model, tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", tiny_model, "--num-prompts", "6", "--input-len-min", "4",
            "--input-len-max", "20", "--output-len", "5", "--compare", "hf", "--hf-batch-sizes", "2,4,64",
            "--runs", "2", "--json", str(out), *ENGINE]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    w = rec["workload"]
    assert w["num_requests"] == 6 and w["output_tokens"] == 30
    assert 6 * 4 <= w["prompt_tokens"] <= 6 * 20
    assert w["total_tokens"] == w["prompt_tokens"] + 30
    assert len(rec["pagoda"]["runs"]) == 2
    for s in rec["pagoda"]["runs"] + [rec["pagoda"]["median"]] + rec["hf"]["runs"]:
        _check_stats(s, 6, w["prompt_tokens"], 30)
    # Batch sizes above the request count are clipped; each is tried once in the first run.
    assert rec["hf"]["batch_sizes"] == [2, 4, 6]
    assert set(rec["hf"]["first_run_by_batch_size"]) == {"2", "4", "6"}
    assert rec["hf"]["best_batch_size"] in (2, 4, 6)
    assert len(rec["hf"]["runs"]) == 2
    # Same weights, greedy, fp32: transformers' tokens agree with Pagoda's for most requests.
    assert max(rec["hf"]["outputs_identical_to_pagoda"].values()) >= 4
    ratio = rec["pagoda"]["median"]["total_tokens_per_s"] / rec["hf"]["median"]["total_tokens_per_s"]
    assert rec["ratio"]["total_tokens_per_s"] == pytest.approx(ratio)
    assert rec["dtype"] == "float32" and rec["env"]["torch"]
    printed = capsys.readouterr().out
    assert "pagoda / transformers" in printed and "total tok/s" in printed

    # The Markdown the docs take: the ratio, and a command line that parses back to the same flags.
    from pagoda.bench.report import command_line, render

    md = render([out])
    assert f"{rec['ratio']['total_tokens_per_s']:.2f}x" in md and "| tp |" in md
    cmd = command_line(rec).split()
    assert cmd[:3] == ["pagoda", "bench", "throughput"] and "--runs" in cmd
    from pagoda.entrypoints.bench import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    again = vars(parser.parse_args(cmd[1:]))
    assert {k: v for k, v in again.items() if k != "func"} == rec["args"]


def test_throughput_prefix_hits_cache_every_run(tiny_model, tmp_path):
    out = tmp_path / "prefix.json"
    # A small token budget spreads the prefills over steps, so later requests find the prefix cached.
    argv = ["bench", "throughput", "--model", tiny_model, "--workload", "prefix", "--num-prompts", "6",
            "--prefix-len", "64", "--suffix-len", "8", "--output-len", "3", "--runs", "2",
            "--max-num-batched-tokens", "80", "--json", str(out), *ENGINE]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert rec["workload"]["prompt_tokens"] == 6 * 72
    runs = rec["pagoda"]["runs"]
    for s in runs:
        _check_stats(s, 6, 6 * 72, 18)
        assert 0 < s["cached_prompt_tokens"] <= 5 * 64
    # The cache is reset between runs: the second run reuses no more than the first.
    assert runs[0]["cached_prompt_tokens"] == runs[1]["cached_prompt_tokens"]


def test_throughput_jsonl(tiny_model, tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps({"prompt": list(range(10, 10 + n)), "max_tokens": m}) for n, m in [(5, 2), (9, 4), (3, 1)]))
    out = tmp_path / "j.json"
    assert main(["bench", "throughput", "--model", tiny_model, "--workload", str(wl), "--json", str(out), *ENGINE]) == 0
    rec = json.loads(out.read_text())
    _check_stats(rec["pagoda"]["median"], 3, 17, 7)


def test_throughput_rejects_requests_longer_than_the_context(tiny_model, capsys):
    argv = ["bench", "throughput", "--model", tiny_model, "--num-prompts", "2", "--input-len-min", "60",
            "--input-len-max", "60", "--output-len", "8", "--max-model-len", "64", *ENGINE]
    assert main(argv) == 1
    assert "max_model_len" in capsys.readouterr().err


def test_latency(tiny_model, tmp_path, capsys):
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", tiny_model, "--input-lens", "8,40", "--output-len", "6", "--runs", "2",
            "--compare", "hf", "--json", str(out), *ENGINE]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    assert [e["prompt_len"] for e in rec["results"]] == [8, 40]
    for e in rec["results"]:
        for who in ("pagoda", "hf"):
            m = e[who]
            assert len(e[f"{who}_runs"]) == 2
            assert m["ttft_ms"] > 0 and m["decode_ms_per_token"] > 0
            assert m["prefill_tokens_per_s"] > 0
            assert m["decode_tokens_per_s"] == pytest.approx(1e3 / m["decode_ms_per_token"])
            for r in e[f"{who}_runs"]:
                assert r["prefill_tokens_per_s"] == pytest.approx(e["prompt_len"] / (r["ttft_ms"] / 1e3))
    assert "decode ms/tok" in capsys.readouterr().out


def test_throughput_qwen3_shaped_model_without_tokenizer(tmp_path):
    # The GPU-offline model's preset (tied embeddings, explicit head_dim), shrunk; a Qwen folder
    # without tokenizer files must still give a random workload over the config's vocabulary.
    from pagoda.bench.models import make_random_model

    model = make_random_model(
        "qwen3-0.6b", tmp_path / "qwen", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024, bos_token_id=1, eos_token_id=2,
    )
    out = tmp_path / "q.json"
    argv = ["bench", "throughput", "--model", str(model), "--num-prompts", "4", "--input-len-min", "10",
            "--input-len-max", "50", "--output-len", "4", "--compare", "hf", "--hf-batch-sizes", "4",
            "--json", str(out), *ENGINE]
    assert main(argv) == 0
    rec = json.loads(out.read_text())
    _check_stats(rec["pagoda"]["median"], 4, rec["workload"]["prompt_tokens"], 16)
    _check_stats(rec["hf"]["median"], 4, rec["workload"]["prompt_tokens"], 16)
