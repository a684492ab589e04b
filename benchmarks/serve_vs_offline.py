"""Pagoda offline against `pagoda serve` on the CPU-offline workload, alternated run by run: the
serve line of issue 22 ("within 5 % of offline") on a machine whose speed drifts over minutes
(docs/perf-notes.md: the same tree ran 909-1,207 total tok/s within the hour), where a served run
measured some minutes after an offline one compares the minutes, not the two paths.

Each round runs every arm once, the order rotating from round to round; each run is a fresh
process (offline: benchmarks/ab_trees.py's timed run) or a fresh server (served: `pagoda serve`,
the 64 prompts sent at once by `pagoda bench serve`, as benchmarks/compare_cpu.sh sends them). The
arms:

    offline      `LLM.generate` of the workload in one process
    serve        `pagoda serve` driven over HTTP, streaming
    serve-nice   the same, with the API process and the load's client at nice NICE: they share the
                 two cores with the engine core's threads, and a thread held up by either holds up
                 the other at the step's next barrier
    serve-nice-api, serve-nice-client   only the one of them at nice NICE
    serve-env    `pagoda serve` with the environment variables of --server-env set (for instance
                 GOMP_SPINCOUNT, how long an OpenMP thread of the engine spins before it sleeps)
    offline-burst  offline, beside a process that wakes every --burst-period-ms and takes
                 --burst-ms of CPU: a stand-in for the API process and the load's client, which
                 stream each engine step's tokens in one burst. What the burst costs the engine's two
                 threads, against its own CPU time, is what a served batch loses to them.

Prints each run (a served one with its streams' median TTFT and ITL), then each arm's median and
each served arm's per-round ratio to offline.

    .venv/bin/python benchmarks/serve_vs_offline.py [--rounds 4] [--arms offline serve serve-nice]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL_NAME = "SmolLM2-135M-Instruct"


def run_offline() -> tuple[float, str]:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/ab_trees.py"), "--ref", "HEAD", "--run-one"],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout
    run = json.loads(out.strip().splitlines()[-1])
    return run["total_tok_s"], f"; prompt steps {run['prompt_steps_s']:.2f} s, decode step {run['decode_step_ms']:.1f} ms"


# Wakes every PERIOD ms (on schedule, not PERIOD after the last burst) and spins BURST ms of its own CPU.
_BURNER = """
import sys, time
burst, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
due = time.perf_counter()
while True:
    due += period
    time.sleep(max(0.0, due - time.perf_counter()))
    start = time.thread_time()
    while time.thread_time() - start < burst:
        pass
"""


def run_offline_beside_bursts(burst_ms: float, period_ms: float) -> tuple[float, str]:
    burner = subprocess.Popen([sys.executable, "-c", _BURNER, str(burst_ms), str(period_ms)])
    try:
        total, steps = run_offline()
    finally:
        burner.kill()
        burner.wait()
    return total, f"{steps}; beside {burst_ms:g} ms of CPU every {period_ms:g} ms"


def renice_process(pid: int, niceness: int) -> None:
    """Every thread of `pid` (Linux's priority is a thread's: setpriority on the pid sets its main one only)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(task), niceness)


def run_served(port: int, api_nice: int, client_nice: int, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Total tok/s of one served run, and its streams' median first-token time and inter-token latency;
    `env`: variables set for the server."""
    server = subprocess.Popen([str(BIN / "pagoda"), "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--max-num-seqs", "64"], cwd=REPO, start_new_session=True, env={**os.environ, **(env or {})},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        subprocess.run([sys.executable, str(REPO / "benchmarks/peer_tools.py"), "wait-ready",
                        f"http://127.0.0.1:{port}", "300"], check=True, capture_output=True)
        if api_nice:
            renice_process(server.pid, api_nice)
        with tempfile.TemporaryDirectory(prefix="pagoda-svo-") as tmp:
            result = Path(tmp) / "run.json"
            client = [str(BIN / "pagoda"), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model",
                      MODEL_NAME, "--num-prompts", "64", "--request-rate", "inf", "--max-concurrency", "64",
                      "--input-len-min", "32", "--input-len-max", "512", "--output-len", "128", "--seed", "0",
                      "--json", str(result)]
            if client_nice:
                client = ["nice", "-n", str(client_nice), *client]
            subprocess.run(client, cwd=REPO, check=True, capture_output=True)
            metrics = json.loads(result.read_text())["metrics"]
            if metrics["failed"] or metrics["output_len_mismatches"]:
                raise SystemExit(f"served run: {metrics['failed']} failed, {metrics['output_len_mismatches']} wrong length")
            return (metrics["total_token_throughput"],
                    f"; TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms, ITL p50 {metrics['itl_ms']['p50']:.1f} ms")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--arms", nargs="+", default=["offline", "serve"],
                        choices=["offline", "serve", "serve-nice", "serve-nice-api", "serve-nice-client", "serve-env",
                                 "offline-burst"])
    parser.add_argument("--nice", type=int, default=10, help="niceness in the serve-nice arms")
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE", help="the serve-env arm's variables")
    parser.add_argument("--port", type=int, default=8437)
    # A served 64-stream batch on a 2-core Xeon: the API ~4.3 ms and the client ~2.2 ms of CPU a ~60 ms step.
    parser.add_argument("--burst-ms", type=float, default=6.5, help="the offline-burst arm's CPU a burst")
    parser.add_argument("--burst-period-ms", type=float, default=55.0, help="the offline-burst arm's time between bursts")
    args = parser.parse_args()
    nice = args.nice
    runners = {"offline": run_offline, "serve": lambda: run_served(args.port, 0, 0),
               "serve-nice": lambda: run_served(args.port, nice, nice),
               "serve-nice-api": lambda: run_served(args.port, nice, 0),
               "serve-nice-client": lambda: run_served(args.port, 0, nice),
               "serve-env": lambda: run_served(args.port, 0, 0, dict(v.split("=", 1) for v in args.server_env)),
               "offline-burst": lambda: run_offline_beside_bursts(args.burst_ms, args.burst_period_ms)}
    results: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for i in range(args.rounds):
        shift = i % len(args.arms)
        for arm in args.arms[shift:] + args.arms[:shift]:
            total, latency = runners[arm]()
            results[arm].append(total)
            print(f"round {i + 1} {arm:>17}: {total:7.1f} total tok/s{latency}", flush=True)
    for arm, runs in results.items():
        line = f"median {arm:>17}: {statistics.median(runs):7.1f} total tok/s"
        if arm != "offline" and "offline" in results:
            ratios = [s / o for s, o in zip(runs, results["offline"])]
            line += (f"; per round vs offline {' / '.join(f'{r:.2f}' for r in ratios)}x, median "
                     f"{statistics.median(ratios):.3f}x; medians' ratio "
                     f"{statistics.median(runs) / statistics.median(results['offline']):.3f}x")
        print(line)


if __name__ == "__main__":
    main()
