"""Cost of one decode-shaped forward by the number of tokens in it, for choosing where speculative
decoding stops paying (`disable_by_batch_size`).

A step of B requests with k drafts each scores B * (k + 1) tokens. Speculation pays while a forward of
B * (k + 1) tokens costs much less than (k + 1) forwards of B tokens, i.e. while the per-token cost
still falls with the batch. This times `LLM`'s engine on B requests, each decoding with its drafts
(k = 0 is plain decoding), as ms per step, through the real runner, so attention over a 256-token
context and sampling are included.

    python benchmarks/forward_cost.py --dtype float32 --batches 1,2,4,8,16,32,64 --k 0,4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagoda.contracts.step import NewRequestData, ScheduledRequest, SchedulerOutput
from pagoda.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--k", default="0,4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="pin torch to N threads (on a shared machine a busy core stalls every parallel region)")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from pagoda.engine.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(map(int, args.k.split(",")))})
    runner = llm.engine.core.runner
    bs = llm.engine.core.kv_cache.block_size
    rng = np.random.default_rng(0)
    ctx = args.context
    print(f"torch threads {torch.get_num_threads()}, context {ctx}")
    base = {}
    for b in map(int, args.batches.split(",")):
        for k in map(int, args.k.split(",")):
            # Requests with contexts already "computed" (random KV content: the cost is the same).
            nblk = -(-(ctx + k + 1) // bs)
            rows, times = [], []
            for i in range(b):
                blocks = list(range(1 + i * nblk, 1 + (i + 1) * nblk))
                prompt = rng.integers(10, 1000, size=ctx).tolist()
                rows.append(ScheduledRequest(f"r{i}", ctx - 1, 1, prompt[-1:], blocks, blocks, ctx, None,
                                             NewRequestData(prompt, [], SamplingParams(temperature=0))))
            runner.execute(SchedulerOutput(rows))  # builds the mirrors
            for n in range(args.steps + 1):  # the first is a warm-up
                step = [ScheduledRequest(f"r{i}", ctx - 1, 1 + k, [7], [], r.block_ids, ctx, None,
                                         spec_token_ids=[5] * k) for i, r in enumerate(rows)]
                t = time.perf_counter()
                runner.execute(SchedulerOutput(step))
                if n:
                    times.append(time.perf_counter() - t)
                for r in runner.requests.values():  # undo the mirror's growth: every step is the same
                    del r.output_token_ids[:]
                    r.num_tokens = ctx
            runner.release([f"r{i}" for i in range(b)])
            ms = 1e3 * statistics.median(times)
            if k == 0:
                base[b] = ms
            extra = f"  ({ms / base[b]:.2f}x the plain step)" if k and b in base else ""
            print(f"batch {b:3d} k {k}: {ms:8.2f} ms/step, {ms / (b * (k + 1)):6.3f} ms/token{extra}", flush=True)


if __name__ == "__main__":
    main()
