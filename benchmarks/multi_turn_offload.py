"""Multi-turn chat with and without a second KV tier, in one invocation: recomputed prompt tokens
and time to first token.

32 conversations of 6 turns share a 600-token system prompt. Each turn's prompt is the
conversation so far (system prompt, earlier user messages and the model's answers, as token ids)
plus a new user message; turns go round the conversations, `--concurrency` at a time, so a
conversation comes back after all the others have had their turn. The first-tier pool
(`--num-blocks`) is far too small to keep 32 conversations cached; the second tier
(`--kv-offloading-size` GiB of host memory, or `--backend disk`) keeps them. The same workload runs
without the tier, then with it, in fresh engines of the same process:

    python benchmarks/multi_turn_offload.py                 # SmolLM2-135M, both runs, a JSON line each
    python benchmarks/multi_turn_offload.py --backend disk --offload-dir /tmp/kv
    python benchmarks/multi_turn_offload.py --conversations 8 --turns 3   # a quick check

Recomputed prompt tokens = prompt tokens - cached tokens (served by either tier) summed over every
request: a count, exact under any load. TTFT is the wall time from submitting a request to its
first token, p50 over all requests; it depends on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from pagoda import SamplingParams
from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine


def conversation_turns(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per conversation, its user messages (seeded random token ids)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(100, vocab) for _ in range(args.system_tokens)]
    users = [[[rng.randrange(100, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, users


def warm_up(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> None:
    """One batch of the workload's shapes on other tokens (kernels built, first-step costs paid),
    then an empty prefix cache, so that neither run pays for starting."""
    rng = random.Random(args.seed + 1)
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    for i in range(args.concurrency):
        n = args.system_tokens + args.user_tokens * (1 + i % args.turns)
        engine.add_request({"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}, params,
                           request_id=f"warm-up-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    if not engine.core.kv_manager.reset_prefix_cache():
        raise RuntimeError("the warm-up left blocks in use")


def run(args: argparse.Namespace, offload: bool) -> dict:
    extra = dict(kv_offloading_size=args.kv_offloading_size, kv_offloading_backend=args.backend,
                 kv_offloading_dir=args.offload_dir) if offload else {}
    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, device="cpu", block_size=16,
                                  num_gpu_blocks_override=args.num_blocks, max_num_seqs=args.concurrency,
                                  max_model_len=args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens),
                                  **extra), tokenizer=None)
    vocab = engine.core.loaded.config.vocab_size
    system, users = conversation_turns(args, vocab)
    warm_up(engine, args, vocab)
    before = engine.core.stats()
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    ttfts, prompt_tokens, cached_tokens = [], 0, 0
    started = time.perf_counter()
    for turn in range(args.turns):
        for first in range(0, args.conversations, args.concurrency):
            convs = range(first, min(first + args.concurrency, args.conversations))
            submitted, first_token = {}, {}
            for c in convs:
                history[c] += users[c][turn]
                rid = f"c{c}t{turn}"
                engine.add_request({"prompt_token_ids": list(history[c])}, params, request_id=rid)
                submitted[rid] = time.perf_counter()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in first_token and out.outputs[0].token_ids:
                        first_token[out.request_id] = time.perf_counter()
                    if out.finished:
                        c = int(out.request_id[1:].split("t")[0])
                        history[c] += out.outputs[0].token_ids
                        prompt_tokens += len(out.prompt_token_ids)
                        cached_tokens += out.num_cached_tokens
            ttfts += [first_token[rid] - submitted[rid] for rid in submitted]
        print(f"{'with' if offload else 'without'} the second tier: turn {turn + 1} of {args.turns} done "
              f"after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    s = engine.core.stats()
    engine.core.shutdown()
    for name in ("prefix_cache_hits", "kv_offload_hits", "kv_offload_bytes_saved", "kv_offload_bytes_loaded",
                 "num_preemptions"):
        setattr(s, name, getattr(s, name) - getattr(before, name))
    return {
        "second_tier": args.backend if offload else None,
        "requests": len(ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "recomputed_prompt_tokens": prompt_tokens - cached_tokens,
        "first_tier_hit_tokens": s.prefix_cache_hits,
        "second_tier_hit_tokens": s.kv_offload_hits,
        "bytes_saved": s.kv_offload_bytes_saved,
        "bytes_loaded": s.kv_offload_bytes_loaded,
        "preemptions": s.num_preemptions,
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
        "ttft_p90_ms": round(statistics.quantiles(ttfts, n=10)[-1] * 1e3, 1),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=64, help="a chat answer's length (docs/benchmarks.md)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=320, help="the first tier's blocks of 16 tokens")
    p.add_argument("--kv-offloading-size", type=float, default=1.0, help="GiB of the second tier")
    p.add_argument("--backend", default="cpu", choices=("cpu", "disk"))
    p.add_argument("--offload-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    without = run(args, offload=False)
    print(json.dumps(without), flush=True)
    with_tier = run(args, offload=True)
    print(json.dumps(with_tier), flush=True)
    print(json.dumps({
        "recomputed_tokens_ratio": round(without["recomputed_prompt_tokens"] / with_tier["recomputed_prompt_tokens"], 2),
        "ttft_p50_ratio": round(without["ttft_p50_ms"] / with_tier["ttft_p50_ms"], 2),
    }))


if __name__ == "__main__":
    main()
