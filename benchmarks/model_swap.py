"""Swap times of the model lifecycle, measured through the HTTP API:

1. several models, `--max-loaded-models 1`: requests alternate between models A and B, so each one
   unloads the other model and loads its own (its own engine core process): the seconds of each such
   request, against a request to the model already loaded;
2. hot weight updates: one server on A, `POST /update_weights` to B and back (drain mode, idle
   server): the load seconds (on a thread, while serving) and the swap seconds (the pause between
   two steps) the server reports.

    .venv/bin/python benchmarks/model_swap.py                       # two random tiny-llama models
    .venv/bin/python benchmarks/model_swap.py --model-a A --model-b B --rounds 4
    .venv/bin/python benchmarks/model_swap.py -- --dtype float32    # flags after -- go to `pagoda serve`
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, body: dict | None = None, timeout: float = 900.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagoda", "serve", *args, "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            call(f"{url}/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def complete(url: str, model: str) -> float:
    t0 = time.perf_counter()
    call(f"{url}/v1/completions", {"model": model, "prompt": [1, 5, 9, 33], "max_tokens": 4, "temperature": 0})
    return time.perf_counter() - t0


def pool_swaps(a: str, b: str, rounds: int, extra: list[str]) -> None:
    proc, url = start(["--model", f"a={a}", "--model", f"b={b}", "--max-loaded-models", "1", *extra])
    try:
        complete(url, "a")  # first load, not a swap
        warm = [complete(url, "a") for _ in range(3)]
        swaps = []
        for i in range(rounds):
            swaps.append(complete(url, "b" if i % 2 == 0 else "a"))
        loads = {m["id"]: m["last_load_s"] for m in call(f"{url}/v1/models")["data"]}
    finally:
        stop(proc)
    print(f"model pool, K=1: request to the loaded model {statistics.median(warm):.3f} s (median of 3); "
          f"request that swaps models {statistics.median(swaps):.2f} s (median of {rounds}: "
          f"{', '.join(f'{s:.2f}' for s in swaps)}); last load per model {loads}")


def weight_updates(a: str, b: str, rounds: int, extra: list[str]) -> None:
    proc, url = start([a, *extra])
    try:
        complete(url, "")
        reports = [call(f"{url}/update_weights", {"model_path": b if i % 2 == 0 else a, "version": f"v{i}"})
                   for i in range(rounds)]
    finally:
        stop(proc)
    load = [r["load_s"] for r in reports]
    swap = [r["swap_s"] * 1000 for r in reports]
    print(f"hot weight update, drain: load {statistics.median(load):.2f} s (median of {rounds}: "
          f"{', '.join(f'{s:.2f}' for s in load)}), swap {statistics.median(swap):.1f} ms "
          f"({', '.join(f'{s:.1f}' for s in swap)}); {reports[0]['bytes_copied'] / 2**20:.1f} MiB copied")


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-a")
    ap.add_argument("--model-b")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    a, b = args.model_a, args.model_b
    if a is None or b is None:
        from pagoda.bench.models import make_random_model

        tmp = tempfile.mkdtemp(prefix="pagoda-swap-")
        a = a or str(make_random_model("tiny-llama", os.path.join(tmp, "a"), seed=0, dtype="float32"))
        b = b or str(make_random_model("tiny-llama", os.path.join(tmp, "b"), seed=1, dtype="float32"))
    pool_swaps(a, b, args.rounds, extra)
    weight_updates(a, b, args.rounds, extra)


if __name__ == "__main__":
    main()
