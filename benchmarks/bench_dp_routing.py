"""Data-parallel routing: prefix-cache hit tokens of `cache_aware` against `round_robin` (and
`least_load`), and how evenly `cache_aware` spreads a workload without shared prefixes. Counts, not
times: the figures hold on a loaded machine.

Shared-prefix workload: 8 distinct system prompts of 512 tokens, 16 users each, 2 turns (turn 2 =
turn 1's prompt, its answer and a new user message), each turn's 128 requests arriving in a
shuffled order, `--concurrency` in flight. Every policy runs on the same `DataParallelLLM`
(`--dp` replicas, real engine-core processes) with the prefix caches reset in between, so the
policies see the same replicas and the same cache sizes. A replica's KV pool is sized
(`--num-blocks`) so that it cannot keep all 8 system prompts: where a request lands decides
whether its prefix is still there.

Random workload: `--random-requests` prompts of random tokens (no shared prefix) under
`cache_aware`; the replicas' request counts should differ by at most 20 %.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dp_routing.py [--dp 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from collections import Counter

from pagoda.bench.models import make_random_model
from pagoda.config import EngineArgs
from pagoda.engine.replica_set import DataParallelLLM
from pagoda.engine.routing import Router
from pagoda.sampling_params import SamplingParams

SYSTEM_PROMPTS, USERS, SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 8, 16, 512, 32, 16


async def run_batch(engine: DataParallelLLM, prompts: list[tuple[str, list[int]]], max_tokens: int,
                    concurrency: int) -> dict[str, list[int]]:
    """Generate for every (id, prompt) with `concurrency` in flight; the answers by id."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    answers: dict[str, list[int]] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(rid: str, ids: list[int]) -> None:
        async with gate:
            out: list[int] = []
            async for o in engine.generate({"prompt_token_ids": ids}, params, request_id=rid):
                out.extend(o.outputs[0].token_ids)
            answers[rid] = out

    await asyncio.gather(*(one(rid, ids) for rid, ids in prompts))
    return answers


async def shared_prefix_run(engine: DataParallelLLM, policy: str, seed: int, concurrency: int,
                            vocab: int) -> dict:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)]
    users = [(s, u) for s in range(SYSTEM_PROMPTS) for u in range(USERS)]
    first = {f"{s}-{u}": systems[s] + [rng.randrange(3, vocab) for _ in range(USER_TOKENS)] for s, u in users}
    second_msg = {k: [rng.randrange(3, vocab) for _ in range(USER_TOKENS)] for k in first}
    engine.router = Router(policy)
    assert await engine.reset_prefix_cache(), "prefix caches busy"
    before = await engine.engine_stats()
    order = list(first)
    rng.shuffle(order)
    turn1 = await run_batch(engine, [(f"{policy}-t1-{k}", first[k]) for k in order], ANSWER_TOKENS, concurrency)
    rng.shuffle(order)
    turn2 = [(f"{policy}-t2-{k}", first[k] + turn1[f"{policy}-t1-{k}"] + second_msg[k]) for k in order]
    await run_batch(engine, turn2, ANSWER_TOKENS, concurrency)
    after = await engine.engine_stats()
    routed = Counter(engine.routes[rid].replica for rid in engine.routes if rid.startswith(f"{policy}-"))
    return {
        "policy": policy,
        "requests": 2 * len(first),
        "prompt_tokens": after.prefix_cache_queries - before.prefix_cache_queries,
        "hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        "requests_per_replica": dict(sorted(routed.items())),
    }


async def random_run(engine: DataParallelLLM, n: int, seed: int, concurrency: int, vocab: int) -> dict:
    rng = random.Random(seed + 1)
    engine.router = Router("cache_aware")
    prompts = [(f"rand-{i}", [rng.randrange(3, vocab) for _ in range(rng.randrange(64, 512))]) for i in range(n)]
    await run_batch(engine, prompts, 8, concurrency)
    counts = Counter(engine.routes[rid].replica for rid, _ in prompts)
    hi, lo = max(counts.values()), min(counts.values())
    return {"policy": "cache_aware", "requests": n, "requests_per_replica": dict(sorted(counts.items())),
            "max_relative_difference": (hi - lo) / hi}


async def main(ns: argparse.Namespace) -> dict:
    model = ns.model
    if model is None:
        model = str(make_random_model("tiny-llama", tempfile.mkdtemp(prefix="pagoda-dp-bench-"),
                                      max_position_embeddings=2048))
    args = EngineArgs(model=model, device="cpu", dtype="float32", max_model_len=2048, data_parallel_size=ns.dp,
                      num_gpu_blocks_override=ns.num_blocks, max_num_seqs=ns.concurrency)
    engine = DataParallelLLM(args, tokenizer=None)
    await engine.start()
    try:
        vocab = engine.info.vocab_size
        runs = [await shared_prefix_run(engine, p, ns.seed, ns.concurrency, vocab)
                for p in ("round_robin", "least_load", "cache_aware")]
        by = {r["policy"]: r for r in runs}
        result = {
            "dp": ns.dp, "num_blocks_per_replica": ns.num_blocks, "concurrency": ns.concurrency,
            "shared_prefix": runs,
            "hit_ratio_cache_aware_over_round_robin": by["cache_aware"]["hit_tokens"] / max(1, by["round_robin"]["hit_tokens"]),
            "random": await random_run(engine, ns.random_requests, ns.seed, ns.concurrency, vocab),
        }
    finally:
        await engine.shutdown()
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder; default: a tiny random Llama")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks of 16 tokens per replica")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--random-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result here")
    ns = p.parse_args()
    out = asyncio.run(main(ns))
    text = json.dumps(out, indent=2)
    print(text)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(text + "\n")
