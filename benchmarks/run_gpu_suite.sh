#!/usr/bin/env bash
# GPU-offline (docs/perf-notes.md): a random-weight Qwen3-0.6B-shaped model in bf16, 256 requests,
# prompts uniform in [100, 1024] (seed 0), 256 output tokens, EOS ignored, side by side with
# transformers. Run on the GPU machine; results go to benchmarks/results/gpu-offline.{json,log}.
#
#   benchmarks/run_gpu_suite.sh          # RUNS (default 3), MODEL_DIR (default /tmp/qwen3-0.6b-random)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
OUT=${OUT:-benchmarks/results}
PAGODA=${PAGODA:-.venv/bin/pagoda}
PYTHON=${PYTHON:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-/tmp/qwen3-0.6b-random}
mkdir -p "$OUT"

[ -f "$MODEL_DIR/config.json" ] || "$PYTHON" benchmarks/make_random_model.py qwen3-0.6b "$MODEL_DIR" --dtype bfloat16 --seed 0
# Pagoda sizes its KV cache from free memory: leave room for transformers, loaded in the same process.
"$PAGODA" bench throughput --model "$MODEL_DIR" --workload random --num-prompts 256 --input-len-min 100 \
    --input-len-max 1024 --output-len 256 --seed 0 --dtype bfloat16 --compare hf --hf-batch-sizes 64,128,256 \
    --runs "$RUNS" --gpu-memory-utilization 0.5 --json "$OUT/gpu-offline.json" 2>&1 | tee "$OUT/gpu-offline.log"
"$PYTHON" -m pagoda.bench.report "$OUT/gpu-offline.json"
