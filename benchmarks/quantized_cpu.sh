#!/usr/bin/env bash
# Quantized execution on the CPU, the figures docs/benchmarks.md quotes, in one run:
#
#   benchmarks/quantized_cpu.sh            # RUNS=3; run it on a quiet machine
#   RUNS=1 benchmarks/quantized_cpu.sh --quick   # tiny workloads: checks the script
#
# 1. The Q4_1 file side by side with llama.cpp (benchmarks/compare_cpu.sh with QUANTIZATION=gguf and
#    PEERS="pagoda-serve-gguf llamacpp"): Pagoda offline on the packed blocks (CPU-offline throughput
#    and its peak RSS, `bench latency`'s single stream of a 128-token prompt and 256 output tokens),
#    and `pagoda serve --quantization gguf` and llama-server each sent the same single stream.
# 2. CPU-offline throughput (64 requests, prompts in [32, 512], 128 output tokens) unquantized, with
#    --quantization int8 and with --quantization gguf, one after the other, same settings.
# Results in $OUT (default benchmarks/results/quantized-cpu).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

RUNS=${RUNS:-3}
OUT=${OUT:-benchmarks/results/quantized-cpu}
PAGODA=${PAGODA:-.venv/bin/pagoda}
DTYPE=${DTYPE:-float32}
N=64 LMIN=32 LMAX=512 OLEN=128
QUICK=
if [ "${1:-}" = --quick ]; then
    N=4 LMIN=16 LMAX=64 OLEN=8 QUICK=--quick
    OUT=$OUT/quick
fi
rm -rf "$OUT"
mkdir -p "$OUT"
failed=()

echo "=== Q4_1: Pagoda on the packed blocks beside llama.cpp"
QUANTIZATION=gguf PEERS="pagoda-serve-gguf llamacpp" SERVE_PEERS=none RUNS=$RUNS DTYPE=$DTYPE \
    OUT=$OUT/compare benchmarks/compare_cpu.sh $QUICK || failed+=(compare)

for quant in none int8 gguf; do
    echo "=== CPU-offline throughput, quantization: $quant"
    args=()
    [ "$quant" != none ] && args=(--quantization "$quant")
    "$PAGODA" bench throughput --workload random --num-prompts "$N" --input-len-min "$LMIN" \
        --input-len-max "$LMAX" --output-len "$OLEN" --seed 0 --runs "$RUNS" --dtype "$DTYPE" "${args[@]}" \
        --json "$OUT/offline-$quant.json" 2>&1 | tee "$OUT/offline-$quant.log" || failed+=("offline-$quant")
done

[ ${#failed[@]} -eq 0 ] || { echo "FAILED: ${failed[*]}"; exit 1; }
echo "results in $OUT"
