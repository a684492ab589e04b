"""Helpers for benchmarks/compare_cpu.sh: wait for a server, watch its memory, export the model for
peers, and print the comparison table. Each is a subcommand so the shell script stays a script:

    peer_tools.py wait-ready BASE_URL TIMEOUT_S       # seconds until a 1-token completion answers
    peer_tools.py rss-watch PID OUT                   # peak RSS of PID's process tree -> OUT (bytes)
    peer_tools.py export-hf FOLDER                    # the default GGUF as an HF folder (float32)
    peer_tools.py gguf-path                           # where the default model's GGUF lies
    peer_tools.py gemm-rate DTYPE OUT                 # torch's GEMM GFLOP/s and the model's sizes -> OUT (JSON)
    peer_tools.py merge-offline OUT RUN.json...       # one `bench throughput` run a round -> one JSON
    peer_tools.py merge-latency OUT RUN.json...       # one `bench latency` call a round -> one JSON
    peer_tools.py table OUT_DIR                       # the Markdown table from OUT_DIR's JSON files
    peer_tools.py serve-table OUT_DIR/cpu-serve       # the CPU-serve latency table
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import tree_rss_bytes  # noqa: E402  (benchmarks/ is not a package)


def wait_ready(base: str, timeout_s: float) -> int:
    """Poll until /v1/models names a model and a one-token completion succeeds; print the seconds."""
    import urllib.request

    start = time.monotonic()
    model = None
    while time.monotonic() < start + timeout_s:
        try:
            if model is None:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                    model = json.load(resp)["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
            req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                if resp.status == 200:
                    print(f"{time.monotonic() - start:.2f}")
                    return 0
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)
    return 1


def rss_watch(pid: int, out: Path, period_s: float = 1.0) -> int:
    """Sample until PID is gone or we are told to stop (SIGTERM/SIGINT); keep the peak in OUT.

    Each sample sums the kernel's own peak (VmHWM) over the process tree, so a sparse sample misses
    no short peak; the sum of per-process peaks can only overstate the tree's peak. Sparse because
    sampling is not free: walking /proc every 0.1 s took ~5 % of a core, and on 2 cores that stalls
    a server's OpenMP step far more (pagoda serve: 312 instead of 378 total tok/s)."""
    stop = False

    def on_signal(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    peak = 0
    while not stop and Path(f"/proc/{pid}").exists():
        peak = max(peak, tree_rss_bytes(pid, "VmHWM"))
        out.write_text(str(peak))
        time.sleep(period_s)
    out.write_text(str(peak))
    return 0


def export_hf(folder: Path) -> int:
    """The default GGUF dequantized to float32 as a Hugging Face folder (config, safetensors,
    tokenizer), for peers that cannot run Q4_1 GGUF on a CPU (vLLM)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda.model.loader import resolve_model

    src = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # The weights are already dequantized; only the GGUF "quantizer" marker is left, and
    # save_pretrained refuses to write a model that carries it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return 0


def gguf_path() -> int:
    from pagoda.model.loader import resolve_model

    print(resolve_model(None).path)
    return 0


def gemm_rate(dtype_name: str, out: Path, reps: int = 10) -> int:
    """torch's GEMM rate with all threads on the model's largest layer GEMM at prefill size
    ([2048 x hidden] @ [hidden x 2 intermediate], F.linear), plus the parameter counts that turn the
    workload into FLOPs: the rate behind the issue's compute bound."""
    import torch
    import torch.nn.functional as F

    from pagoda.model.loader import load_config, resolve_model

    cfg = load_config(resolve_model(None))
    dtype = getattr(torch, dtype_name)
    m, k, n = 2048, cfg.hidden_size, 2 * cfg.intermediate_size
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    for _ in range(3):
        F.linear(x, w)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    record = {
        "dtype": dtype_name,
        "shape": [m, k, n],
        "threads": torch.get_num_threads(),
        "gflops": 2 * m * n * k / statistics.median(times) / 1e9,
        "non_embedding_params": cfg.num_hidden_layers * per_layer,
        "lm_head_params": cfg.vocab_size * cfg.hidden_size,
    }
    record["read_gb_s"] = read_rate()
    record["gguf_block_bytes"] = _block_bytes(dtype)
    out.write_text(json.dumps(record, indent=2))
    print(f"torch {dtype_name} GEMM {m}x{k}x{n}: {record['gflops']:.1f} GFLOP/s; memory read {record['read_gb_s']:.1f} GB/s")
    return 0


def _block_bytes(dtype) -> int | None:
    """The bytes a one-row decode step reads where Pagoda keeps the default GGUF's blocks beside its
    bf16 weights (exec/gguf_block_linears.py: Q4_0/Q4_1 at 5 bits a weight, Q8_0 at 9, the rest
    bf16), or None where it keeps none (another dtype, no AVX512-BF16, PAGODA_NO_GGUF_BLOCKS=1)."""
    import math

    import torch

    from pagoda.exec.cpu_linear import gemm_kernel
    from pagoda.exec.gguf_block_linears import BYTES_PER_WEIGHT
    from pagoda.model.gguf_file import open_gguf
    from pagoda.model.loader import resolve_model

    if dtype != torch.bfloat16 or gemm_kernel() is None or os.environ.get("PAGODA_NO_GGUF_BLOCKS") == "1":
        return None
    source = resolve_model(None)
    if not source.is_gguf:
        return None
    tensors = [t for t in open_gguf(source.path, light=True).tensors if len(t.shape) == 2]
    if any(t.name == "output.weight" for t in tensors):  # an untied head: the embedding is not read whole
        tensors = [t for t in tensors if t.name != "token_embd.weight"]
    return int(sum(math.prod(int(d) for d in t.shape) * BYTES_PER_WEIGHT.get(t.tensor_type.name, 2) for t in tensors))


def read_rate(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """The machine's memory read rate in GB/s with all threads (best of `reps` fp32 sums over 1 GiB,
    far beyond any cache): the rate behind the single-stream bound, as a decode step reads every
    weight once."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(reps))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_bound(out_dir: Path) -> str | None:
    """Single stream: a decode step reads every weight once (the LM head included), so at most
    read rate / weight bytes tokens per second."""
    rate_file, latency = out_dir / "gemm-rate.json", out_dir / "pagoda-latency.json"
    if not (rate_file.exists() and latency.exists()):
        return None
    rate = json.loads(rate_file.read_text())
    if "read_gb_s" not in rate:
        return None
    import torch

    quantization = os.environ.get("QUANTIZATION") or None
    if quantization == "gguf":  # the blocks as the file holds them, read once a step (the tied head too)
        weight_bytes, kind = os.path.getsize(os.environ["GGUF"]), "packed GGUF"
    elif quantization is None and rate.get("gguf_block_bytes"):  # one row reads the GGUF's blocks
        weight_bytes, kind = rate["gguf_block_bytes"], f"{rate['dtype']} (GGUF blocks where the GEMM reads them)"
    elif quantization is None:
        elt = torch.empty((), dtype=getattr(torch, rate["dtype"])).element_size()
        weight_bytes, kind = (rate["non_embedding_params"] + rate["lm_head_params"]) * elt, rate["dtype"]
    else:
        return None
    bound = rate["read_gb_s"] * 1e9 / weight_bytes
    reached = json.loads(latency.read_text())["results"][0]["pagoda"]["decode_tokens_per_s"]
    return (
        f"Single-stream bound: {weight_bytes / 1e6:.0f} MB of {kind} weights per token at a "
        f"{rate['read_gb_s']:.1f} GB/s read rate = {bound:.0f} tok/s; Pagoda offline decodes {reached:.1f} "
        f"({100 * reached / bound:.0f} % of it)."
    )


def compute_bound(out_dir: Path) -> str | None:
    """The issue's compute bound for the offline run: 2 x non-embedding parameters per processed
    token plus the LM head per sampled token, at the GEMM rate measured in the same run."""
    rate_file, offline = out_dir / "gemm-rate.json", out_dir / "pagoda-offline.json"
    if not (rate_file.exists() and offline.exists()):
        return None
    rate, rec = json.loads(rate_file.read_text()), json.loads(offline.read_text())
    work = rec["workload"]
    flops = 2 * rate["non_embedding_params"] * work["total_tokens"] + 2 * rate["lm_head_params"] * work["output_tokens"]
    bound = work["total_tokens"] / (flops / (rate["gflops"] * 1e9))
    reached = _median([r["total_tokens_per_s"] for r in rec["pagoda"]["runs"]])
    return (
        f"Compute bound: {flops / 1e12:.2f} TFLOP at torch's {rate['dtype']} GEMM rate of {rate['gflops']:.0f} GFLOP/s "
        f"({rate['threads']} threads, {'x'.join(map(str, rate['shape']))}) = {bound:.0f} total tok/s; "
        f"Pagoda offline reaches {100 * reached / bound:.0f} % of it."
    )


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def table(out_dir: Path) -> int:
    """One row per system: medians over its runs. Pagoda offline from `bench throughput`'s JSON;
    served systems from `bench serve` JSONs plus the startup/RSS files the script wrote."""
    nan = float("nan")
    rows: list[tuple] = []
    offline = out_dir / "pagoda-offline.json"
    if offline.exists():
        rec = json.loads(offline.read_text())["pagoda"]
        runs = rec["runs"]
        latency = out_dir / "pagoda-latency.json"
        decode = json.loads(latency.read_text())["results"][0]["pagoda"]["decode_tokens_per_s"] if latency.exists() else nan
        rows.append((
            "pagoda (offline, LLM.generate)",
            _median([r["total_tokens_per_s"] for r in runs]),
            _median([r["output_tokens_per_s"] for r in runs]),
            rec["startup_s"],
            rec["peak_rss_mib"],
            nan, nan, decode,
            "",
        ))
    for system_dir in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        runs = sorted(system_dir.glob("run-*.json"))
        if not runs:
            continue
        totals, outputs, startups, peaks, notes = [], [], [], [], set()
        short_ttft, short_e2e, decode = [], [], []
        for run in runs:
            m = json.loads(run.read_text())["metrics"]
            totals.append(m["total_token_throughput"])
            outputs.append(m["output_token_throughput"])
            if m["failed"] or m["output_len_mismatches"]:
                notes.add(f"{m['failed']} failed, {m['output_len_mismatches']} wrong length")
            stem = run.with_suffix("")
            startups.append(float((stem.parent / f"{stem.name}.startup").read_text() or "nan"))
            peaks.append(int((stem.parent / f"{stem.name}.rss").read_text() or 0) / 2**20)
            for suffix, into in ((".short", (short_ttft, short_e2e)), (".stream", (decode,))):
                one = stem.parent / f"{stem.name}{suffix}"
                if one.exists() and one.read_text().strip():
                    rec = json.loads(one.read_text())
                    keys = ("ttft_ms", "e2e_ms") if suffix == ".short" else ("decode_tok_s",)
                    for key, values in zip(keys, into):
                        values.append(rec[key])
        row = (system_dir.name, _median(totals), _median(outputs), _median(startups), _median(peaks),
               _median(short_ttft), _median(short_e2e), _median(decode))
        rows.append((*row, "; ".join(sorted(notes))))
    if not rows:
        print(f"no results under {out_dir}")
        return 1
    base = rows[0][1] if rows[0][0].startswith("pagoda") else nan
    cpu = out_dir / "cpu.txt"
    if cpu.exists():
        print(cpu.read_text().strip() + "\n")
    print("| system | total tok/s | output tok/s | total vs Pagoda | startup s | peak RSS MiB "
          "| short TTFT ms | short e2e ms | single-stream decode tok/s | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def fmt(v: float, spec: str) -> str:
        return "-" if v != v else format(v, spec)

    for name, total, output, startup, peak, ttft, e2e, dec, note in rows:
        ratio = total / base if base == base and base else nan
        print(f"| {name} | {total:.1f} | {output:.1f} | {ratio:.2f}x | {startup:.1f} | {peak:.0f} "
              f"| {fmt(ttft, '.1f')} | {fmt(e2e, '.0f')} | {fmt(dec, '.1f')} | {note} |")
    for bound in (compute_bound(out_dir), decode_bound(out_dir)):
        if bound:
            print(f"\n{bound}")
    return 0


def merge_offline(out: Path, run_files: list[Path]) -> int:
    """`bench throughput` JSONs of one run each (one a round, between the peers' runs) as one file of
    the same shape: every run in `runs`, the median run's figures in `median`, the median start-up and
    the highest peak RSS."""
    records = [json.loads(f.read_text()) for f in run_files if f.exists()]
    if not records:
        print("no Pagoda offline runs to merge", file=sys.stderr)
        return 1
    merged = records[0]
    runs = [run for rec in records for run in rec["pagoda"]["runs"]]
    by_total = sorted(runs, key=lambda r: r["total_tokens_per_s"])
    merged["runs"] = len(runs)
    merged["pagoda"] = {
        "startup_s": _median([rec["pagoda"]["startup_s"] for rec in records]),
        "peak_rss_mib": max(rec["pagoda"]["peak_rss_mib"] for rec in records),
        "runs": runs,
        "median": by_total[(len(by_total) - 1) // 2],
    }
    out.write_text(json.dumps(merged, indent=2))
    return 0


def serve_table(out_dir: Path) -> int:
    """CPU-serve: one row per system, medians over its runs of each run's p50 (and p90) latencies."""
    print("| system | runs | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | TPOT p50 ms | output tok/s | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for system_dir in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        runs = [json.loads(r.read_text())["metrics"] for r in sorted(system_dir.glob("run-*.json"))]
        if not runs:
            continue

        def med(key: str, stat: str) -> float:
            return _median([m[key][stat] for m in runs])

        print(
            f"| {system_dir.name} | {len(runs)} | {med('ttft_ms', 'p50'):,.0f} | {med('ttft_ms', 'p90'):,.0f} "
            f"| {med('itl_ms', 'p50'):,.0f} | {med('itl_ms', 'p90'):,.0f} | {med('tpot_ms', 'p50'):,.0f} "
            f"| {_median([m['output_token_throughput'] for m in runs]):.1f} | {sum(m['failed'] for m in runs)} |"
        )
    return 0


def merge_latency(out: Path, run_files: list[Path]) -> int:
    """`bench latency` JSONs of one prompt length each (one call a round, between the peers' runs) as
    one file of the same shape: every round's runs in `pagoda_runs`, their medians in `pagoda`, as
    `bench latency` takes them over its own runs."""
    from pagoda.bench.latency import _median_of

    records = [json.loads(f.read_text()) for f in run_files if f.exists()]
    if not records:
        print("no Pagoda single-stream runs to merge", file=sys.stderr)
        return 1
    merged = records[0]
    runs = [run for rec in records for run in rec["results"][0]["pagoda_runs"]]
    merged["results"][0]["pagoda_runs"] = runs
    merged["results"][0]["pagoda"] = _median_of(runs)
    merged["rounds"] = len(records)
    out.write_text(json.dumps(merged, indent=2))
    return 0


def main(argv: list[str]) -> int:
    cmd, *args = argv
    if cmd == "wait-ready":
        return wait_ready(args[0].rstrip("/"), float(args[1]))
    if cmd == "rss-watch":
        return rss_watch(int(args[0]), Path(args[1]))
    if cmd == "export-hf":
        return export_hf(Path(args[0]))
    if cmd == "gguf-path":
        return gguf_path()
    if cmd == "gemm-rate":
        return gemm_rate(args[0], Path(args[1]))
    if cmd == "merge-offline":
        return merge_offline(Path(args[0]), [Path(a) for a in args[1:]])
    if cmd == "merge-latency":
        return merge_latency(Path(args[0]), [Path(a) for a in args[1:]])
    if cmd == "table":
        return table(Path(args[0]))
    if cmd == "serve-table":
        return serve_table(Path(args[0]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
