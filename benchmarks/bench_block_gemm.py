"""The bf16 GEMM of a few rows over GGUF blocks against over bf16 (exec/csrc/block_tile.h).

SmolLM2-135M's four linears over 30 layers (each its own, cold, weights: random Q4_1 blocks, as its
GGUF file holds them) and its LM head (random Q8_0, 49,152 x 576), at 1, 2 and 4 rows. Both copies
stand for the same bf16 weights, so the script first checks that the two give the same bits; then
it alternates the two, call by call, and prints the medians over --runs of each, and the rate at
which each reads its bytes.

    .venv/bin/python benchmarks/bench_block_gemm.py [--runs 15] [--rows 1 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagoda.exec.cpu_linear import gemm_kernel, pack_gemm
from pagoda.exec.gguf_block_linears import pack_blocks, widen_blocks
from pagoda.model.quantized import QuantizedTensor

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (N, K)
LAYERS, VOCAB = 30, 49152


def _blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> QuantizedTensor:
    """Random valid blocks: float16 scales (and Q4_1's minimum) of a trained model's size, random values."""
    nb = cols // 32
    d = (rng.uniform(0.001, 0.01, (rows, nb))).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if kind == "Q4_1":
        m = (-rng.uniform(0.0, 0.05, (rows, nb))).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
        raw = np.concatenate([d, m, rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)], axis=-1)
    else:
        raw = np.concatenate([d, rng.integers(0, 256, (rows, nb, 32), dtype=np.uint8)], axis=-1)
    return QuantizedTensor(kind, rows, cols, torch.from_numpy(raw.reshape(rows, -1).copy()))


def _both(kind: str, n: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    blocks = pack_blocks([_blocks(kind, n, k, rng)])
    return pack_gemm(widen_blocks(blocks, n)), blocks, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    kernel = gemm_kernel()
    if kernel is None:
        raise SystemExit("this CPU has no AVX512-BF16: the bf16 GEMM (and its block path) does not run here")
    rng = np.random.default_rng(0)
    layers = [_both("Q4_1", n, k, rng) for _ in range(LAYERS) for n, k in SHAPES]
    head = _both("Q8_0", VOCAB, 576, rng)
    groups = {"layers": layers, "head": [head]}
    for rows in args.rows:
        x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
        for bf16, blocks, n in layers[:4] + [head]:
            k = bf16.shape[1] * 2
            same = torch.equal(kernel.gemm_bf16(x[k], bf16, None, n).view(torch.int16),
                               kernel.gemm_bf16(x[k], bf16, None, n, blocks).view(torch.int16))
            assert same, f"{rows} rows, {n} x {k}: the block path's bits differ"

        def timed(group: list, use_blocks: bool) -> float:
            t0 = time.perf_counter()
            for bf16, blocks, n in group:
                kernel.gemm_bf16(x[bf16.shape[1] * 2], bf16, None, n, blocks if use_blocks else None)
            return (time.perf_counter() - t0) * 1e3

        for name, group in groups.items():
            for _ in range(2):
                timed(group, False), timed(group, True)
            pairs = [(timed(group, False), timed(group, True)) for _ in range(args.runs)]
            plain, packed = (statistics.median(p[i] for p in pairs) for i in (0, 1))
            plain_bytes = sum(b.numel() * 2 for b, _, _ in group)
            block_bytes = sum(q.numel() for _, q, _ in group)
            print(f"{rows} row(s), {name}: bf16 {plain:.2f} ms ({plain_bytes / plain / 1e6:.1f} GB/s of "
                  f"{plain_bytes / 1e6:.0f} MB), blocks {packed:.2f} ms ({block_bytes / packed / 1e6:.1f} GB/s of "
                  f"{block_bytes / 1e6:.0f} MB): {plain / packed:.2f}x")


if __name__ == "__main__":
    main()
