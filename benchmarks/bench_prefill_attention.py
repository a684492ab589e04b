"""Causal prefill attention on the CPU, float32: the C++ kernel against torch's SDPA.

SmolLM2-135M's heads (9 query heads over 3 KV heads of 64); q, k and v are row-strided views of
one fused projection, as the model hands them over. Each row is the median over --runs of one call
per path, the two alternating, for one chunk of n queries at the end of a sequence of S tokens.

    .venv/bin/python benchmarks/bench_prefill_attention.py [--runs 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.exec.cpu_kernels import load_prefill_attention
from pagoda.exec.paged_attention import causal_sdpa

HQ, HKV, D = 9, 3, 64
SHAPES = [(64, 64), (272, 272), (512, 512), (1024, 1024), (2048, 2048), (256, 768)]  # (n, S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    module = load_prefill_attention()
    if module is None:
        raise SystemExit("the C++ prefill attention did not build (PAGODA_NO_CPP=1 or no compiler)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.runs}")
    print("| n | S | SDPA ms | kernel ms | SDPA GFLOP/s | kernel GFLOP/s | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for n, seq_len in SHAPES:
        qkv = torch.randn(seq_len, (HQ + 2 * HKV) * D, generator=g)
        q = qkv[seq_len - n :, : HQ * D].view(n, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(seq_len, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].view(seq_len, HKV, D)
        fns = {"sdpa": causal_sdpa, "kernel": module.prefill_attention}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            fn(q, k, v, D**-0.5)
        for _ in range(args.runs):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(q, k, v, D**-0.5)
                times[name].append(time.perf_counter() - t0)
        sdpa_s, kernel_s = (statistics.median(times[name]) for name in ("sdpa", "kernel"))
        # QK^T and PV over the visible (causal) pairs only.
        flop = 4 * D * HQ * (n * (seq_len - n) + n * (n + 1) / 2)
        print(
            f"| {n} | {seq_len} | {sdpa_s * 1e3:.2f} | {kernel_s * 1e3:.2f} | {flop / sdpa_s / 1e9:.0f} "
            f"| {flop / kernel_s / 1e9:.0f} | {sdpa_s / kernel_s:.2f}x |"
        )


if __name__ == "__main__":
    main()
