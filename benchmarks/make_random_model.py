"""Save a random-weight model of a known shape as a Hugging Face folder, for `pagoda bench`.

    .venv/bin/python benchmarks/make_random_model.py qwen3-0.6b /tmp/qwen3-0.6b-random --dtype bfloat16

Presets: tiny-llama (smoke tests), qwen3-0.6b (the GPU-offline workload), llama-1b (tensor-parallel
overhead, benchmarks/bench_tp.py). The seed fixes the weights.
"""

from __future__ import annotations

import argparse

from pagoda.bench.models import PRESETS, make_random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    path = make_random_model(args.preset, args.out_dir, seed=args.seed, dtype=args.dtype)
    print(f"saved {args.preset} (seed {args.seed}, {args.dtype}) to {path}")


if __name__ == "__main__":
    main()
