"""Decode speed of a mixture of experts against a dense model with the same active parameters.

    flock /tmp/pagoda-bench.lock .venv/bin/python benchmarks/moe_decode.py

Two random-weight models of one shape but the feed-forward block: a Mixtral (8 experts of
`--expert-inter`, top-2) and a Llama whose MLP is two experts wide (`2 * --expert-inter`), so a token
passes through the same number of weights in both (the router's E x H is the only extra). Each batch
size (1 and 32 by default) decodes `--tokens` tokens per request through `LLM.generate`, greedy;
a decode rate is (tokens of a long run - tokens of a short run) / (their time difference), which
takes the prefill out. The models alternate, `--repeats` times, and the medians are reported, with
the MoE's rate over the dense model's: the issue's bar is 0.8 at batch 1 and at batch 32.
`--quantization int8` runs both models with int8 weights (the MoE's experts as QuantExperts, the
dense model's MLP as QuantLinear), the same comparison for weights kept quantized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def save_models(root: Path, args: argparse.Namespace) -> dict[str, str]:
    import torch
    import transformers

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                  max_position_embeddings=4096, tie_word_embeddings=False)
    configs = {
        "moe": transformers.MixtralConfig(**common, intermediate_size=args.expert_inter, num_local_experts=args.experts,
                                          num_experts_per_tok=args.top_k, sliding_window=None),
        "dense": transformers.LlamaConfig(**common, intermediate_size=args.top_k * args.expert_inter),
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        folders[name] = str(root / name)
        model.save_pretrained(folders[name])
        total = sum(p.numel() for p in model.parameters())
        print(f"{name}: {total / 1e6:.0f}M parameters", flush=True)
        del model
    return folders


def decode_rate(llm, batch: int, tokens: int, vocab: int) -> float:
    """Decode tokens per second for `batch` requests (prefill taken out by a short run)."""
    from pagoda import SamplingParams

    prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % (vocab - 3) + 3 for j in range(16)]} for i in range(batch)]

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    short, long = 4, 4 + tokens
    return batch * tokens / (timed(long) - timed(short))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-inter", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per request in the timed difference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["int8"], help="both models' weights kept int8")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()

    from pagoda import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folders = save_models(Path(tmp), args)
        llms = {name: LLM(folder, dtype=args.dtype, max_num_seqs=max(args.batches), num_gpu_blocks_override=512,
                          quantization=args.quantization)
                for name, folder in folders.items()}
        rates: dict[tuple[str, int], list[float]] = {}
        for batch in args.batches:
            for llm in llms.values():  # warm-up: oneDNN primitives, the load cache's pages
                decode_rate(llm, batch, 4, args.vocab)
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    rates.setdefault((name, batch), []).append(decode_rate(llm, batch, args.tokens, args.vocab))
    results = []
    for batch in args.batches:
        moe, dense = (statistics.median(rates[(n, batch)]) for n in ("moe", "dense"))
        results.append({"batch": batch, "moe_tok_s": round(moe, 1), "dense_tok_s": round(dense, 1),
                        "ratio": round(moe / dense, 2),
                        "runs": {n: [round(r, 1) for r in rates[(n, batch)]] for n in ("moe", "dense")}})
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
