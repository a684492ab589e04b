#!/usr/bin/env bash
# CPU-offline throughput with --quantization int8 against the unquantized path, alternated so that the
# machine's drift falls on both alike:
#
#   benchmarks/int8_batch_cpu.sh                 # RUNS=5 pairs, DTYPE=auto; run it on a quiet machine
#   DTYPE=float32 RUNS=3 benchmarks/int8_batch_cpu.sh
#   RUNS=1 benchmarks/int8_batch_cpu.sh --quick  # tiny workload: checks the script
#
# Workload: the CPU-offline one (64 requests, prompts in [32, 512], seed 0, 128 output tokens, greedy,
# EOS ignored) on the default model. Each pair runs unquantized, then int8, one `bench throughput`
# run each; the summary gives each side's median total tok/s and the median of the pairs' ratios.
# Results (every run's JSON, summary.txt) in $OUT (default benchmarks/results/int8-batch).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

RUNS=${RUNS:-5}
DTYPE=${DTYPE:-auto}
OUT=${OUT:-benchmarks/results/int8-batch}
PAGODA=${PAGODA:-.venv/bin/pagoda}
PYTHON=${PYTHON:-.venv/bin/python}
N=64 LMIN=32 LMAX=512 OLEN=128
if [ "${1:-}" = --quick ]; then
    N=4 LMIN=16 LMAX=64 OLEN=8
    OUT=$OUT/quick
fi
rm -rf "$OUT"
mkdir -p "$OUT"
grep -o -w 'avx512_bf16\|avx512_vnni\|amx_bf16\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$OUT/cpu.txt"

for run in $(seq 1 "$RUNS"); do
    for quant in none int8; do
        args=()
        [ "$quant" = int8 ] && args=(--quantization int8)
        "$PAGODA" bench throughput --workload random --num-prompts "$N" --input-len-min "$LMIN" \
            --input-len-max "$LMAX" --output-len "$OLEN" --seed 0 --runs 1 --dtype "$DTYPE" "${args[@]}" \
            --json "$OUT/$quant-$run.json" > "$OUT/$quant-$run.log" 2>&1 || { echo "FAILED: $quant run $run"; exit 1; }
        grep 'run 1/1' "$OUT/$quant-$run.log" | sed "s/^/$quant: /"
    done
done

"$PYTHON" - "$OUT" "$RUNS" "$DTYPE" <<'EOF' | tee "$OUT/summary.txt"
import json, statistics, sys
out, runs, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def rate(name):
    data = json.load(open(f"{out}/{name}.json"))
    return data["pagoda"]["median"]["total_tokens_per_s"]

none = [rate(f"none-{i}") for i in range(1, runs + 1)]
int8 = [rate(f"int8-{i}") for i in range(1, runs + 1)]
ratios = [b / a for a, b in zip(none, int8)]
print(f"CPU flags: {open(out + '/cpu.txt').read().strip()}; --dtype {dtype}; {runs} alternated pairs")
print(f"unquantized total tok/s: {', '.join(f'{v:,.1f}' for v in none)} (median {statistics.median(none):,.1f})")
print(f"int8        total tok/s: {', '.join(f'{v:,.1f}' for v in int8)} (median {statistics.median(int8):,.1f})")
print(f"int8 / unquantized per pair: {', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")
EOF
