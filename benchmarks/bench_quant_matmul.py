"""The few-rows quantized matmul (decode) over the default model's weights: the float path (blocks
dequantized in L1, fp32 FMAs) against the integer path (activations rounded to int8, integer dot
products: AVX512-VNNI or AVX2), in GB/s of packed weights read.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_matmul.py                 # M = 1 2 4 8, 15 passes
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_matmul.py --rows 1 --passes 31 --json out.json

The weights: every Q4_1 layer matrix of SmolLM2-135M-Instruct's GGUF (210, 66 MB: beyond the caches,
as in a decode step) and its tied Q8_0 embedding used as the LM head (49152 x 576, 30 MB), timed
apart. One pass multiplies x [M, K] into every matrix once; the two paths alternate pass by pass
(which goes first alternates too) so that a change of load weighs on both; medians over the passes.
Threads: the kernels' OpenMP default (OMP_NUM_THREADS to change it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_weights(path: Path) -> dict[str, list[tuple[torch.Tensor, int, int]]]:
    """{"Q4_1 layers": [(blocks [rows, bytes], type id, K)], "Q8_0 head": [...]} from the GGUF."""
    from pagoda.model.gguf_index import GGUFIndex
    from pagoda.model.quantized import GGUF_KERNEL_TYPES

    groups: dict[str, list[tuple[torch.Tensor, int, int]]] = {"Q4_1 layers": [], "Q8_0 head": []}
    for t in GGUFIndex(path).tensors:
        kind = t.tensor_type.name
        if len(t.shape) != 2 or kind not in ("Q4_1", "Q8_0"):
            continue
        k, rows = int(t.shape[0]), int(t.shape[1])
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))  # copied out of the map
        group = "Q4_1 layers" if kind == "Q4_1" else "Q8_0 head"
        groups[group].append((data, GGUF_KERNEL_TYPES[kind], k))
    return groups


def time_pass(ops, mats, xs) -> float:
    start = time.perf_counter()
    for (data, tid, _), x in zip(mats, xs):
        ops.fused_matmul(x, data, tid, None)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="activation rows M (at most 8)")
    p.add_argument("--passes", type=int, default=15, help="timed passes per path (medians)")
    p.add_argument("--float-isa", default=None, help="the float path (default: the widest this CPU runs)")
    p.add_argument("--int-isa", default=None, help="the integer path (default: the one 'auto' picks)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from pagoda.exec.quant_linear import load_quant_kernels
    from pagoda.model.model_source import default_model_path

    ops = load_quant_kernels()
    if ops is None:
        sys.exit("the quantized matmul kernels did not build")
    ops.set_isa("auto")
    auto = ops.isa()
    int_isa = args.int_isa or auto
    float_isa = args.float_isa or {"avx512_vnni": "avx512", "avx2_int8": "avx2"}.get(auto, auto)
    if int_isa == float_isa:
        sys.exit(f"this CPU runs no integer path (auto is {auto})")
    groups = load_weights(default_model_path())
    torch.manual_seed(0)
    results = []
    print(f"float path {float_isa}, integer path {int_isa}, {args.passes} passes each, medians")
    print(f"{'weights':12s} {'MB':>6s} {'M':>2s} {'float ms':>9s} {'GB/s':>6s} {'int ms':>8s} {'GB/s':>6s} {'speed-up':>8s}")
    for m in args.rows:
        for group, mats in groups.items():
            nbytes = sum(d.numel() for d, _, _ in mats)
            xs = [torch.randn(m, k) for _, _, k in mats]
            times: dict[str, list[float]] = {float_isa: [], int_isa: []}
            for isa in (float_isa, int_isa):  # warm-up: pages touched, code loaded
                ops.set_isa(isa)
                time_pass(ops, mats, xs)
            for i in range(args.passes):
                for isa in ((float_isa, int_isa) if i % 2 == 0 else (int_isa, float_isa)):
                    ops.set_isa(isa)
                    times[isa].append(time_pass(ops, mats, xs))
            f_s, i_s = statistics.median(times[float_isa]), statistics.median(times[int_isa])
            print(f"{group:12s} {nbytes / 1e6:6.1f} {m:2d} {f_s * 1e3:9.3f} {nbytes / f_s / 1e9:6.1f} "
                  f"{i_s * 1e3:8.3f} {nbytes / i_s / 1e9:6.1f} {f_s / i_s:7.2f}x", flush=True)
            results.append({"weights": group, "bytes": nbytes, "rows": m, "float_isa": float_isa, "int_isa": int_isa,
                            "float_s": times[float_isa], "int_s": times[int_isa],
                            "float_median_s": f_s, "int_median_s": i_s})
    ops.set_isa("auto")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
