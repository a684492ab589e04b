"""What bounds an MoE decode step on this CPU: the experts' bytes against the memory's read rate.

    flock /tmp/pagoda-bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_layer_bandwidth.py

The shapes of benchmarks/moe_decode.py (hidden 1024, 8 experts of 1024, top-2, bf16): `--layers`
layers' experts (each its own weights, so that nothing stays in the 32 MiB L3 from one call to the
next, as in a real step) through the grouped kernel (exec/cpu_grouped_moe.py) at `--tokens` rows,
against the dense MLP of the same active parameters (oneDNN-packed gate-up and down, 2048 wide) and
a plain read of as many bytes (torch's sum over float32). Prints each one's time per layer and the
rate at which it read its weights; the MoE layer cannot beat bytes / read rate.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def best_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    from pagoda.exec.cpu_grouped_moe import GroupedExperts, grouped_fused_experts
    from pagoda.exec.cpu_linear import PackedLinear
    from pagoda.model.fused_moe import select_experts
    from pagoda.model.layers import silu_and_mul

    hidden, inter, experts, layers = 1024, 1024, 8, args.layers
    torch.manual_seed(0)
    moe = [GroupedExperts((torch.randn(experts, 2 * inter, hidden) * 0.03).bfloat16(),
                          (torch.randn(experts, hidden, inter) * 0.03).bfloat16()) for _ in range(layers)]
    dense = [(PackedLinear(torch.nn.Linear(hidden, 4 * inter, bias=False).bfloat16()),
              PackedLinear(torch.nn.Linear(2 * inter, hidden, bias=False).bfloat16())) for _ in range(layers)]
    x = torch.randn(args.tokens, hidden).bfloat16()
    weights, ids = select_experts(torch.randn(args.tokens, experts), 2, True)
    active = len(set(ids.flatten().tolist()))
    moe_bytes = active * 3 * inter * hidden * 2  # per layer: the experts that got a row
    dense_bytes = 3 * 2 * inter * hidden * 2
    plain = torch.randn(layers * moe_bytes // 4)  # float32, as many bytes as the experts read

    results = {
        "moe": best_ms(lambda: [grouped_fused_experts(x, e, weights, ids) for e in moe], args.runs) / layers,
        "dense": best_ms(lambda: [d(silu_and_mul(g(x))) for g, d in dense], args.runs) / layers,
        "plain_read": best_ms(lambda: plain.sum(), args.runs) / layers,
    }
    read_rate = moe_bytes / results["plain_read"] / 1e6
    out = {
        "threads": torch.get_num_threads(), "tokens": args.tokens, "experts_with_rows": active,
        "moe_ms_per_layer": round(results["moe"], 3), "moe_GB_s": round(moe_bytes / results["moe"] / 1e6, 1),
        "dense_ms_per_layer": round(results["dense"], 3), "dense_GB_s": round(dense_bytes / results["dense"] / 1e6, 1),
        "plain_read_GB_s": round(read_rate, 1), "moe_floor_ms": round(moe_bytes / read_rate / 1e6, 3),
        "moe_over_dense_time": round(results["moe"] / results["dense"], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
