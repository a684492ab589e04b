"""Paged decode attention on the CPU: how fast the C++ kernel reads the KV cache, per cache dtype.

A decode step late in the CPU-offline workload: 64 sequences of SmolLM2-135M's heads (9 query heads
over 3 KV heads of 64) with contexts uniform in [96, 576], 16-token blocks, each sequence's blocks
consecutive (a fresh pool), and 30 layers, each with its own K and V cache. Three figures per cache
dtype, each the median over --runs:

- step: one kernel call per layer; the rate at which the context's K/V is read from memory.
- compute: the same calls with every block table pointing at the same 20 blocks, so the data stays
  in cache; the rate the kernel's arithmetic allows (in bytes of that dtype read per second).
- the machine's streaming read rate: torch's sum over one contiguous tensor of a step's size.

A step slower than both ceilings is bound by how the blocks are fetched; one near the compute rate
is bound by the kernel's arithmetic (the case to watch on a machine with more memory bandwidth).

    .venv/bin/python benchmarks/bench_decode_attention.py [--runs 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from pagoda.exec.cpu_kernels import load_cpu_kernels

LAYERS, SEQS, HQ, HKV, D, BS = 30, 64, 9, 3, 64, 16
# (cache dtype, query dtype): a model's own dtype, and a float32 model over a 16-bit cache.
CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]


def median_s(fn: Callable[[], object], runs: int, calls: int = 1) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def consecutive_tables(lens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Block tables giving each sequence the next free blocks in order, and the blocks used."""
    counts = ((lens + BS - 1) // BS).tolist()
    tables = torch.zeros(len(counts), max(counts), dtype=torch.long)
    start = 0
    for row, n in enumerate(counts):
        tables[row, :n] = torch.arange(start, start + n)
        start += n
    return tables, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ paged-cache kernels did not build (PAGODA_NO_CPP=1 or no compiler)")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(96, 577, (SEQS,), generator=g)
    tables, num_blocks = consecutive_tables(lens)
    shared = torch.arange(20).repeat(SEQS, 1)  # 20 blocks: 320 tokens each, all in cache
    shared_lens = torch.full((SEQS,), 20 * BS)
    scale = D**-0.5
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {SEQS} sequences, "
          f"{int(lens.sum())} context tokens, {LAYERS} layers; median of {args.runs}")
    print("| cache dtype | query dtype | step ms | step GB/s | compute GB/s | streaming read GB/s |")
    print("|---|---|---:|---:|---:|---:|")
    for cache_dtype, q_dtype in CASES:
        shape = (num_blocks, BS, HKV, D)
        caches = [(torch.randn(shape, generator=g).to(cache_dtype), torch.randn(shape, generator=g).to(cache_dtype))
                  for _ in range(LAYERS)]
        q = torch.randn(SEQS, HQ, D, generator=g).to(q_dtype)

        def step() -> None:
            for k_cache, v_cache in caches:
                kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale)

        k0, v0 = caches[0]
        step_s = median_s(step, args.runs)
        compute_s = median_s(lambda: kernels.paged_decode(q, k0, v0, shared, shared_lens, scale), args.runs, calls=20)
        size = cache_dtype.itemsize
        step_bytes = int(lens.sum()) * 2 * HKV * D * size * LAYERS
        compute_bytes = int(shared_lens.sum()) * 2 * HKV * D * size
        flat = torch.randn(step_bytes // 4, generator=g)
        stream_s = median_s(lambda: flat.sum(), args.runs)
        del flat
        print(f"| {str(cache_dtype).removeprefix('torch.')} | {str(q_dtype).removeprefix('torch.')} "
              f"| {step_s * 1e3:.1f} | {step_bytes / step_s / 1e9:.1f} | {compute_bytes / compute_s / 1e9:.1f} "
              f"| {step_bytes / stream_s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
