"""The decoder layers' element-wise work on the CPU: fused C++ ops against the PyTorch path.

Per step, for every layer of a SmolLM2-135M-shaped model (30 layers, hidden 576, 9 query and 3 KV
heads of 64, intermediate 1,536): add+RMSNorm, rotary of q and k, add+RMSNorm, SiLU-and-multiply.
Each row is the median over --runs of the time for all layers, the two paths alternating run by
run so that the machine's drift hits both alike.

    .venv/bin/python benchmarks/bench_layer_ops.py [--rows 64 2048] [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.exec.cpu_memory import keep_freed_memory
from pagoda.model.cpu_layer_ops import load_layer_ops
from pagoda.model.layers import RotaryEmbedding, apply_rotary, rms_norm_reference, silu_and_mul_reference

LAYERS, HIDDEN, INTER, HQ, HKV, D = 30, 576, 1536, 9, 3, 64


def step_fn(rows: int, dtype: torch.dtype, fused: bool):
    """One step's element-wise work over LAYERS layers, on fresh inputs of `rows` tokens."""
    ops = load_layer_ops()
    g = torch.Generator().manual_seed(0)
    weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)
    x0 = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    res0 = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * INTER, generator=g).to(dtype)
    positions = torch.randint(0, 600, (rows,), generator=g)
    rotary = RotaryEmbedding(D, {"rope_theta": 100000.0})
    q = qkv[:, : HQ * D].view(rows, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(rows, HKV, D)

    def add_norm(x, res):
        if fused:
            ops.add_rms_norm_(x, res, weight, 1e-5)
            return x, res
        res = x + res
        return rms_norm_reference(res, weight, 1e-5), res

    def run() -> None:
        x, res = x0.clone(), res0.clone()
        if fused:
            table = rotary.table(int(positions.max()) + 1)
        else:
            cos, sin = rotary.cos_sin(positions, dtype)
        for _ in range(LAYERS):
            x, res = add_norm(x, res)
            if fused:
                ops.rotary_(q, positions, table)
                ops.rotary_(k, positions, table)
            else:
                apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            x, res = add_norm(x, res)
            ops.silu_and_mul(gate_up) if fused else silu_and_mul_reference(gate_up)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 2048], help="tokens per step")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    keep_freed_memory()  # as the engine's CPU runner does: temporaries are not faulted in afresh each step
    if load_layer_ops() is None:
        raise SystemExit("the C++ layer ops did not build (PAGODA_NO_CPP=1 or no compiler)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per step ({LAYERS} layers), median of {args.runs}")
    print("| dtype | rows | PyTorch ms | fused ms | speedup |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            fns = {"torch": step_fn(rows, dtype, False), "fused": step_fn(rows, dtype, True)}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for fn in fns.values():
                fn()  # warm-up: first-touch faults, the rotary table
            for _ in range(args.runs):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            torch_ms, fused_ms = (statistics.median(times[n]) * 1e3 for n in ("torch", "fused"))
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {rows} | {torch_ms:.1f} | {fused_ms:.1f} | {torch_ms / fused_ms:.2f}x |")


if __name__ == "__main__":
    main()
