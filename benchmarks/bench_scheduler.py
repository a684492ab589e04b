"""Time one scheduler step (schedule() + update()) in steady decode.

256 running requests with 1k-token contexts each decode one token per step; the KV pool is large
enough that nothing is preempted. Prints the median (and p10/p90) over many steps.

    .venv/bin/python benchmarks/bench_scheduler.py [--requests 256] [--context 1024] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagoda.kv import KVCacheManager
from pagoda.sampling_params import SamplingParams
from pagoda.sched import Request, Scheduler, SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()

    n, ctx, steps, bs = args.requests, args.context, args.steps, args.block_size
    max_len = ctx + steps + 16
    num_blocks = 1 + n * (-(-max_len // bs))
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=not args.no_prefix_caching)
    sched = Scheduler(
        # A budget that holds every prompt: one prefill step, then all contexts are equal.
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=n * ctx, max_model_len=max_len), kv
    )
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(n):
        # Distinct prompts (no prefix sharing), so every request owns its whole context.
        prompt = [(i * 7919 + j) % 32000 for j in range(ctx - 1)]
        sched.add_request(Request(f"r{i}", prompt, params, eos_token_id=2))

    token = {f"r{i}": [100 + i] for i in range(n)}
    # Prefill until every request is decoding with a context of `ctx` tokens.
    while True:
        out = sched.schedule()
        sched.update(out, token)
        if len(out.scheduled) == n and all(s.num_new_tokens == 1 for s in out.scheduled):
            break

    total, sched_t, update_t = [], [], []
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        sched.update(out, token)
        t2 = clock()
        total.append(t2 - t0)
        sched_t.append(t1 - t0)
        update_t.append(t2 - t1)
        assert len(out.scheduled) == n
    q = statistics.quantiles(total, n=10)
    us = 1e6
    print(
        f"schedule+update, {n} decoding requests, {ctx}-token contexts, block {bs}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}, {steps} steps: "
        f"median {statistics.median(total) * us:.0f} us (p10 {q[0] * us:.0f}, p90 {q[-1] * us:.0f}; "
        f"schedule {statistics.median(sched_t) * us:.0f}, update {statistics.median(update_t) * us:.0f})"
    )

if __name__ == "__main__":
    main()
