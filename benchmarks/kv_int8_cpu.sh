#!/bin/bash
# `--kv-cache-dtype int8` against the default cache, side by side on one machine: CPU-offline
# throughput at dtype=auto and on the Q4_1 file kept packed (`--quantization gguf`), each with the
# process's peak RSS (/usr/bin/time's maxrss, KiB), then one stream's decode (128-token prompt, 256
# output tokens). Alternates the two caches; read medians, on a machine with nothing else running.
#   benchmarks/kv_int8_cpu.sh | tee benchmarks/results/kv-int8-DATE/bench.log
set -u
cd "$(dirname "$0")/.."
P=.venv/bin/pagoda
G=$(.venv/bin/python benchmarks/peer_tools.py gguf-path) || { echo "the default model is not installed"; exit 1; }
W="--workload random --num-prompts 64 --input-len-min 32 --input-len-max 512 --output-len 128 --seed 0 --runs 1"
grep -o -w 'avx512_bf16\|avx2\|avx512_vnni\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for r in 1 2 3; do
  for kv in auto int8; do
    echo "== offline bf16 kv=$kv run $r"
    /usr/bin/time -f "maxrss_kb=%M" $P bench throughput $W --dtype auto --kv-cache-dtype $kv 2>&1 | grep -iE "total|tok/s|maxrss|KV cache:" | tail -4
  done
done
for r in 1 2; do
  for kv in auto int8; do
    echo "== offline Q4_1 gguf kv=$kv run $r"
    /usr/bin/time -f "maxrss_kb=%M" $P bench throughput $W --model $G --quantization gguf --kv-cache-dtype $kv 2>&1 | grep -iE "total|tok/s|maxrss|KV cache:" | tail -4
  done
done
for r in 1 2; do
  for kv in auto int8; do
    echo "== one stream bf16 kv=$kv run $r"
    $P bench latency --input-lens 128 --output-len 256 --runs 3 --kv-cache-dtype $kv 2>&1 | grep -E "^ *128"
    echo "== one stream Q4_1 kv=$kv run $r"
    /usr/bin/time -f "maxrss_kb=%M" $P bench latency --model $G --quantization gguf --input-lens 128 --output-len 256 --runs 3 --kv-cache-dtype $kv 2>&1 | grep -E "^ *128|maxrss"
  done
done
