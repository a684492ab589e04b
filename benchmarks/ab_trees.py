"""The CPU-offline workload on two trees of this repository, alternated, one process a run: an A/B
of a change on a machine whose speed drifts over minutes (docs/perf-notes.md, "2026-12-06 (late)":
the same tree ran 972-1,221 total tok/s within one hour, so runs of one tree after the other's
compare the hours, not the trees).

A temporary worktree at --ref runs against the checkout, pair by pair, the order within a pair
alternating. Each run loads the default model, warms up, then times `LLM.generate` of the workload
(64 random prompts of 32-512 tokens, 128 output tokens, greedy, EOS ignored: `pagoda bench
throughput`'s), recording each engine step's time. Per run: total tok/s, the seconds of the steps
with prompt tokens, and the median pure decode step; then each tree's medians. Only one benchmark
at a time: every run wants both cores.

    .venv/bin/python benchmarks/ab_trees.py --ref HEAD~1 [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_one() -> None:
    """One timed run in this process, from the tree on PYTHONPATH; prints a JSON line."""
    from pagoda.bench.throughput import build_workload, model_info
    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    ns = argparse.Namespace(workload="random", num_prompts=64, input_len_min=32, input_len_max=512, output_len=128,
                            seed=0)
    llm = LLM()
    workload = build_workload(ns, model_info(None))
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in workload.requests]
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:4], params, use_tqdm=False)
    llm.reset_prefix_cache()
    executor = llm.engine.core.executor
    execute, steps = executor.execute, []

    def timed(so):
        t0 = time.perf_counter()
        out = execute(so)
        steps.append((so.total_num_scheduled_tokens, len(so.scheduled), time.perf_counter() - t0))
        return out

    executor.execute = timed
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.prompt_ids) + r.output_len for r in workload.requests)
    print(json.dumps({
        "total_tok_s": tokens / elapsed,
        "prompt_steps_s": sum(s for n, rows, s in steps if n > rows),
        "decode_step_ms": 1000 * statistics.median(s for n, rows, s in steps if n == rows),
        "tree": str(Path(__import__("pagoda").__file__).parent.parent),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the git revision to run against the checkout")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--run-one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        return run_one()
    with tempfile.TemporaryDirectory(prefix="pagoda-ab-") as tmp:
        ref_tree = Path(tmp) / "ref"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(ref_tree), args.ref], check=True,
                       capture_output=True)
        try:
            results: dict[str, list[dict]] = {args.ref: [], "checkout": []}
            for i in range(args.pairs):
                order = [(args.ref, ref_tree), ("checkout", REPO)]
                for name, tree in order if i % 2 == 0 else order[::-1]:
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--ref", args.ref, "--run-one"],
                                         cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
                    run = json.loads(out.strip().splitlines()[-1])
                    assert Path(run["tree"]).resolve() == tree.resolve(), f"ran {run['tree']}, not {tree}"
                    results[name].append(run)
                    print(f"pair {i + 1} {name:>10}: {run['total_tok_s']:7.1f} total tok/s, prompt steps "
                          f"{run['prompt_steps_s']:.2f} s, decode step {run['decode_step_ms']:.1f} ms", flush=True)
            for name, runs in results.items():
                print(f"median {name:>10}: {statistics.median(r['total_tok_s'] for r in runs):7.1f} total tok/s, "
                      f"decode step {statistics.median(r['decode_step_ms'] for r in runs):.1f} ms")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(ref_tree)], check=False,
                           capture_output=True)


if __name__ == "__main__":
    main()
