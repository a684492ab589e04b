#!/usr/bin/env bash
# The standard CPU workloads of docs/perf-notes.md, side by side with transformers, in one go.
#
#   benchmarks/run_cpu_suite.sh            # CPU-offline fp32 + bf16, CPU-prefix; CPU-serve if `pagoda serve` exists
#   RUNS=5 SERVE=0 benchmarks/run_cpu_suite.sh
#
# Run it on a quiet machine (nothing else using the cores): a busy core stalls every OpenMP
# parallel region and the numbers stop meaning anything. Each result lands in benchmarks/results/
# as NAME.json (every number and setting) and NAME.log (what was printed); at the end the Markdown
# tables for docs/benchmarks.md are printed and saved to benchmarks/results/summary.md.
# Expect roughly 30-60 minutes on a 2-core machine, most of it in transformers' fp32 runs.
#
# Environment: RUNS (default 3), OUT (default benchmarks/results), PAGODA (default .venv/bin/pagoda),
# QUICK=1 (tiny sizes, to check the script), PYTHON (default .venv/bin/python), SERVE (auto | 1 | 0; default auto: run CPU-serve when
# `pagoda serve` exists), PORT (default 8321), EXTRA (flags added to every `bench throughput`).
set -uo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-3}
OUT=${OUT:-benchmarks/results}
PAGODA=${PAGODA:-.venv/bin/pagoda}
PYTHON=${PYTHON:-.venv/bin/python}
SERVE=${SERVE:-auto}
PORT=${PORT:-8321}
EXTRA=${EXTRA:-}
QUICK=${QUICK:-0}
mkdir -p "$OUT"

# The standard sizes; QUICK=1 shrinks them to check the script itself in a minute (numbers meaningless).
N=64 LMIN=32 LMAX=512 OLEN=128 PLEN=1024 SLEN=32 POLEN=32 HFBS=16,32,64 SN=128 SRATE=4
if [ "$QUICK" = 1 ]; then
    N=4 LMIN=16 LMAX=64 OLEN=4 PLEN=64 SLEN=8 POLEN=4 HFBS=2,4 SN=8 SRATE=20 RUNS=1
    OUT=$OUT/quick
    mkdir -p "$OUT"
fi
failed=()

run() {  # run NAME ARGS...: one benchmark, its JSON and log under $OUT; a failure is noted, not fatal
    local name=$1
    shift
    echo "=== $name: $PAGODA $* --json $OUT/$name.json"
    rm -f "$OUT/$name.json"  # never summarise a stale result from an earlier run
    if ! "$PAGODA" "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"; then
        failed+=("$name")
    fi
    echo
}

# CPU-offline: SmolLM2-135M-Instruct, 64 requests, prompts uniform in [32, 512] (seed 0), 128 output tokens.
OFFLINE="bench throughput --workload random --num-prompts $N --input-len-min $LMIN --input-len-max $LMAX --output-len $OLEN --seed 0 --compare hf --hf-batch-sizes $HFBS --runs $RUNS"
# shellcheck disable=SC2086  # word splitting of the flag strings is wanted
run cpu-offline-fp32 $OFFLINE --dtype float32 $EXTRA
# shellcheck disable=SC2086
run cpu-offline-bf16 $OFFLINE --dtype bfloat16 $EXTRA

# CPU-prefix: 64 requests, a 1,024-token shared prefix plus 32 unique tokens, 32 output tokens.
# shellcheck disable=SC2086
run cpu-prefix bench throughput --workload prefix --num-prompts $N --prefix-len $PLEN --suffix-len $SLEN \
    --output-len $POLEN --seed 0 --compare hf --hf-batch-sizes $HFBS --runs "$RUNS" --dtype auto $EXTRA

# CPU-serve: 128 requests at 4 requests/s, prompts in [32, 512], 128 output tokens, against `pagoda serve`.
if [ "$SERVE" = auto ]; then
    if "$PAGODA" serve --help >/dev/null 2>&1; then SERVE=1; else SERVE=0; echo "(no 'pagoda serve' yet: CPU-serve skipped)"; fi
fi
if [ "$SERVE" = 1 ]; then
    "$PAGODA" serve --host 127.0.0.1 --port "$PORT" --dtype auto >"$OUT/cpu-serve-server.log" 2>&1 &
    server_pid=$!
    trap 'kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null' EXIT
    # Ready when a one-token completion succeeds (/v1/models may answer while the model still
    # loads); the seconds until then are (about) the server's startup time.
    if "$PYTHON" - "$PORT" <<'PY' | tee "$OUT/cpu-serve-startup.txt"
import sys, time, httpx
base = f"http://127.0.0.1:{sys.argv[1]}"
start = time.monotonic()
while time.monotonic() < start + 300:
    try:
        model = httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1}
        if httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200:
            print(f"pagoda serve answered its first completion {time.monotonic() - start:.1f} s after launch")
            sys.exit(0)
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        pass
    time.sleep(0.2)
sys.exit(1)
PY
    then
        run cpu-serve bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts $SN --request-rate $SRATE \
            --input-len-min $LMIN --input-len-max $LMAX --output-len $OLEN --seed 0 --plot "$OUT/cpu-serve.png"
    else
        echo "pagoda serve did not answer on port $PORT within 300 s (see $OUT/cpu-serve-server.log)"
        failed+=(cpu-serve)
    fi
    kill "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
    trap - EXIT
fi

jsons=()
for f in "$OUT"/cpu-offline-fp32.json "$OUT"/cpu-offline-bf16.json "$OUT"/cpu-prefix.json "$OUT"/cpu-serve.json; do
    [ -f "$f" ] && jsons+=("$f")
done
if [ ${#jsons[@]} -gt 0 ]; then
    "$PYTHON" -m pagoda.bench.report "${jsons[@]}" | tee "$OUT/summary.md"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
