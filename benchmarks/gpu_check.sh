#!/usr/bin/env bash
# One GPU check, under 9 minutes on an H200: the GPU tests, the GPU-offline benchmark against
# transformers, and the mean decode step time beside the HBM bandwidth bound, as one table.
#
#   bash benchmarks/gpu_check.sh            # PYTHON (default python3), MODEL_DIR, OUT (default $OUT or /tmp/gpu-check)
#
# Runs from the source tree (PYTHONPATH, no install: the machine's torch need not match the pin in
# pyproject.toml). The offline path needs no server packages; if msgspec is missing (it is imported
# by pagoda.contracts.messages), a stand-in from benchmarks/gpu_shims is put on the path.
# Each phase has its own time limit, so a hung phase still leaves the table to be printed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-/tmp/qwen3-0.6b-random}
RESULTS=${OUT:-/tmp/gpu-check}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import msgspec" 2>/dev/null; then
    export PYTHONPATH="$PWD/benchmarks/gpu_shims:$PYTHONPATH"
    echo "msgspec not installed: using the offline stand-in in benchmarks/gpu_shims"
fi
unset TRITON_INTERPRET  # the kernel tests run compiled on the GPU
export PAGODA_GPU_MODEL_DIR="$MODEL_DIR"
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"

t0=$SECONDS
phase() { echo "== $1 ($(( SECONDS - t0 )) s elapsed)"; }

phase "random Qwen3-0.6B-shaped bf16 model"
[ -f "$MODEL_DIR/config.json" ] || timeout 90 "$PY" benchmarks/make_random_model.py qwen3-0.6b "$MODEL_DIR" --dtype bfloat16 --seed 0

phase "GPU tests"
# -s: the quantized-path test prints the near-tie gaps it saw (its bounds are first estimates).
timeout 210 "$PY" -m pytest -q -s -p no:cacheprovider \
    tests/exec/test_triton_kernels.py tests/exec/test_triton_moe.py tests/exec/test_triton_quant.py \
    tests/exec/test_triton_kv_fp8.py tests/exec/test_cuda_graphs.py tests/exec/test_gpu_reference.py \
    tests/exec/test_gpu_quantized.py \
    2>&1 | tee "$RESULTS/gpu-tests.log" | grep -v "^Writing\|it/s\]" | tail -30

phase "GPU-offline benchmark (--compare hf)"
# transformers loads into the same process after Pagoda: leave it half the memory.
timeout 200 "$PY" -c '
import argparse, sys
from pagoda.entrypoints.bench import add_bench_parser  # not the whole `pagoda` parser: only bench is needed here
p = argparse.ArgumentParser(prog="pagoda")
add_bench_parser(p.add_subparsers(dest="command", required=True))
ns = p.parse_args(sys.argv[1:])
sys.exit(ns.func(ns))
' bench throughput --model "$MODEL_DIR" --workload random --num-prompts 256 --input-len-min 100 --input-len-max 1024 \
    --output-len 256 --seed 0 --dtype bfloat16 --compare hf --hf-batch-sizes 256 --runs 1 \
    --gpu-memory-utilization 0.5 --json "$RESULTS/gpu-offline.json" 2>&1 | tee "$RESULTS/gpu-offline.log" | tail -12

phase "decode step time"
timeout 75 "$PY" benchmarks/gpu_check.py decode-step --model "$MODEL_DIR" --num-prompts 256 --output-len 32 \
    --json "$RESULTS/decode-step.json" > "$RESULTS/decode-step.log" 2>&1 || tail -5 "$RESULTS/decode-step.log"

phase "summary"
"$PY" benchmarks/gpu_check.py table --tests-log "$RESULTS/gpu-tests.log" --bench-json "$RESULTS/gpu-offline.json" \
    --decode-json "$RESULTS/decode-step.json"
echo "logs and JSON in $RESULTS; total $(( SECONDS - t0 )) s"
