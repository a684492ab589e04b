"""What an engine step costs besides the model's arithmetic, at 64 and 256 running requests.

Runs `EngineCore.step()` in steady decode on a 2-layer, 64-wide random model (benchmarks'
`tiny-llama` preset), whose forward is a small share of the step, and splits the step by timing
the engine's own methods: the scheduler (`schedule` + `update`), the runner's input preparation
(`prepare`), the model forward, the sampling metadata, the sampler, and the rest (output assembly, bookkeeping). Medians
over the steps, in microseconds.

    .venv/bin/python benchmarks/bench_step_overhead.py [--requests 64,256] [--context 512] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable

from pagoda.bench.models import make_random_model
from pagoda.config import EngineArgs
from pagoda.contracts.messages import EngineCoreRequest
from pagoda.engine.core import EngineCore
from pagoda.exec.sampling_metadata import SamplingMetadata
from pagoda.sampling_params import SamplingParams


def timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def measure(model_dir: str, num_requests: int, context: int, steps: int) -> dict[str, float]:
    args = EngineArgs.from_kwargs(model=model_dir, device="cpu", dtype="float32", max_num_seqs=num_requests,
                                  max_num_batched_tokens=8192, max_model_len=context + steps + 64)
    core = EngineCore(args)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7 + j) % 500 + 3 for j in range(context)]
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    while core.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()
    ):
        core.step()  # prefill everything first: what follows is pure decode
    totals: dict[str, float] = defaultdict(float)
    sched, runner = core.scheduler, core.runner
    sched.schedule = timed(totals, "schedule", sched.schedule)
    sched.update = timed(totals, "update", sched.update)
    runner.prepare = timed(totals, "prepare", runner.prepare)
    runner.model.forward = timed(totals, "forward", runner.model.forward)
    runner.sampler = timed(totals, "sample", runner.sampler)
    SamplingMetadata.build = timed(totals, "sampling_meta", SamplingMetadata.build)
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        totals.clear()
        start = time.perf_counter()
        core.step()
        step = time.perf_counter() - start
        per_step["step"].append(step)
        for name, t in totals.items():
            per_step[name].append(t)
        per_step["rest"].append(step - sum(totals.values()))
    return {name: statistics.median(v) * 1e6 for name, v in per_step.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model("tiny-llama", tmp, seed=0, dtype="float32")
        cols = ["step", "schedule", "update", "prepare", "forward", "sampling_meta", "sample", "rest"]
        print("| running | " + " | ".join(f"{c} us" for c in cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for n in (int(x) for x in ns.requests.split(",")):
            m = measure(str(model_dir), n, ns.context, ns.steps)
            print(f"| {n} | " + " | ".join(f"{m.get(c, 0.0):,.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
