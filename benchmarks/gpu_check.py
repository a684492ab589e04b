"""The Python half of benchmarks/gpu_check.sh: decode step time against the HBM bound, and the table.

    python benchmarks/gpu_check.py decode-step --model DIR --json OUT.json   # measure
    python benchmarks/gpu_check.py table --tests-log T.log --bench-json B.json --decode-json D.json
    python benchmarks/gpu_check.py decode-step --dry-run                     # tiny model, any device

Decode step time: the workload's first --num-prompts prompts run through `LLM.generate`; every call
of the model runner is timed (it ends by copying the sampled ids to the host, so the time is the
device's), and the pure-decode steps are kept. Each such step must read every weight once and the
K/V of every context token, so its time is bounded below by (weight bytes + KV bytes) / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H200_HBM_BYTES_PER_S = 4.8e12


def measure_decode_steps(
    model: str, num_prompts: int, output_len: int, input_min: int, input_max: int, dtype: str, device: str,
    bandwidth: float, **engine_kwargs: Any,
) -> dict[str, Any]:
    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.bench.throughput import model_info
    from pagoda.bench.workloads import allowed_token_ids, random_workload, special_token_ids, vocab_for

    info = model_info(model)
    allowed = allowed_token_ids(vocab_for(info.tokenizer, info.config), special_token_ids(info.tokenizer, info.config))
    workload = random_workload(num_prompts, input_min, input_max, output_len, allowed, seed=0)
    llm = LLM(model, dtype=dtype, device=device, max_num_seqs=num_prompts, **engine_kwargs)
    core = llm.engine.core
    runner = core.runner
    cfg = core.loaded.config
    elt = torch.empty((), dtype=core.loaded.dtype).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elt
    weight_bytes = sum(p.numel() * p.element_size() for p in core.loaded.model.parameters())

    steps: list[tuple[float, int, int]] = []  # (seconds, batch size, context tokens read)
    execute = runner.execute

    def timed(so):
        t0 = time.perf_counter()
        out = execute(so)
        dt = time.perf_counter() - t0
        if so.scheduled and all(s.num_new_tokens == 1 for s in so.scheduled):
            steps.append((dt, len(so.scheduled), sum(s.num_computed_tokens + 1 for s in so.scheduled)))
        return out

    runner.execute = timed  # an instance attribute: the engine code is untouched
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in workload.requests]
    llm.generate(prompts[: min(2, len(prompts))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    steps.clear()  # the warm-up's steps
    llm.generate(prompts, params, use_tqdm=False)
    if not steps:
        raise SystemExit("no pure-decode step was seen")
    # The steady state: steps with the whole batch decoding.
    full = [s for s in steps if s[1] == max(b for _, b, _ in steps)] or steps
    mean_s = sum(s[0] for s in full) / len(full)
    bound_s = sum((weight_bytes + ctx * kv_per_token) / bandwidth for _, _, ctx in full) / len(full)
    return {
        "model": model,
        "device": str(core.device),
        "graphs": runner.graphs is not None,
        "decode_steps": len(steps),
        "full_batch_steps": len(full),
        "batch_size": full[0][1],
        "mean_context_tokens": sum(c for _, _, c in full) / len(full) / full[0][1],
        "mean_step_ms": mean_s * 1e3,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "bandwidth_bytes_per_s": bandwidth,
        "bound_step_ms": bound_s * 1e3,
        "fraction_of_bound": bound_s / mean_s,
    }


def cmd_decode_step(ns: argparse.Namespace) -> int:
    model = ns.model
    if ns.dry_run:
        from pagoda.bench.models import make_random_model

        model = str(make_random_model("tiny-llama", tempfile.mkdtemp(prefix="gpu-check-"), seed=0, dtype="float32"))
        ns.num_prompts, ns.output_len, ns.input_len_min, ns.input_len_max = 4, 6, 8, 24
        ns.dtype = "float32"
        extra = {"num_gpu_blocks_override": 64}
    else:
        extra = {"gpu_memory_utilization": ns.gpu_memory_utilization}
    record = measure_decode_steps(
        model, ns.num_prompts, ns.output_len, ns.input_len_min, ns.input_len_max, ns.dtype, ns.device, ns.bandwidth,
        **extra,
    )
    print(json.dumps(record, indent=2))
    if ns.json:
        Path(ns.json).write_text(json.dumps(record, indent=2))
    return 0


def _tests_summary(log: Path) -> str:
    if not log.exists():
        return "not run"
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1].strip("= ") if lines else "no pytest summary (see log)"


def cmd_table(ns: argparse.Namespace) -> int:
    from pagoda.bench.common import format_table

    rows: list[list[Any]] = [["GPU tests", _tests_summary(Path(ns.tests_log)), ""]]
    bench = json.loads(Path(ns.bench_json).read_text()) if ns.bench_json and Path(ns.bench_json).exists() else None
    if bench:
        p = bench["pagoda"]["median"]
        rows.append(["pagoda total tok/s", p["total_tokens_per_s"], f"{p['elapsed_s']:.1f} s"])
        if "hf" in bench:
            h = bench["hf"]["median"]
            rows.append([f"transformers total tok/s (bs={bench['hf']['best_batch_size']})", h["total_tokens_per_s"], f"{h['elapsed_s']:.1f} s"])
            rows.append(["pagoda / transformers", bench["ratio"]["total_tokens_per_s"], ""])
            same = bench["hf"]["outputs_identical_to_pagoda"]
            n = bench["workload"]["num_requests"]
            rows.append(["outputs identical to transformers", ", ".join(f"bs={b}: {k}/{n}" for b, k in same.items()), f"greedy, {bench['dtype']}"])
    else:
        rows.append(["throughput benchmark", "missing", ""])
    dec = json.loads(Path(ns.decode_json).read_text()) if ns.decode_json and Path(ns.decode_json).exists() else None
    if dec:
        rows.append([
            f"mean decode step, batch {dec['batch_size']}, ctx {dec['mean_context_tokens']:.0f}",
            f"{dec['mean_step_ms']:.2f} ms",
            f"graphs {'on' if dec['graphs'] else 'off'}",
        ])
        rows.append([
            f"HBM bound at {dec['bandwidth_bytes_per_s'] / 1e12:.1f} TB/s",
            f"{dec['bound_step_ms']:.2f} ms",
            f"{dec['fraction_of_bound']:.0%} of bound",
        ])
    else:
        rows.append(["decode step time", "missing", ""])
    print(format_table(["check", "result", "note"], rows))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode-step")
    d.add_argument("--model", default="/tmp/qwen3-0.6b-random")
    d.add_argument("--num-prompts", type=int, default=256)
    d.add_argument("--output-len", type=int, default=64)
    d.add_argument("--input-len-min", type=int, default=100)
    d.add_argument("--input-len-max", type=int, default=1024)
    d.add_argument("--dtype", default="bfloat16")
    d.add_argument("--device", default="auto")
    d.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    d.add_argument("--bandwidth", type=float, default=H200_HBM_BYTES_PER_S, help="HBM bytes/s (H200: 4.8e12)")
    d.add_argument("--json", default=None)
    d.add_argument("--dry-run", action="store_true", help="a tiny random model and workload, on any device")
    d.set_defaults(func=cmd_decode_step)
    t = sub.add_parser("table")
    t.add_argument("--tests-log", required=True)
    t.add_argument("--bench-json", default=None)
    t.add_argument("--decode-json", default=None)
    t.set_defaults(func=cmd_table)
    ns = ap.parse_args()
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
