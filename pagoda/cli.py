"""The `pagoda` command: generate, serve, bench."""

from __future__ import annotations

import argparse
import sys

from pagoda.config import DTYPES, KV_CACHE_DTYPES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flag names."""
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype; auto: the model's. bfloat16/float16 store an fp32 model's K/V in half the memory "
        "(CPU only; float16 keeps more precision, bfloat16 fp32's range)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs (and prompt logprobs) a request may ask for; -1: the vocabulary")


def engine_kwargs(ns: argparse.Namespace) -> dict:
    keys = (
        "dtype kv_cache_dtype device seed max_model_len max_num_seqs max_num_batched_tokens block_size "
        "enable_prefix_caching enable_chunked_prefill kv_cache_memory num_gpu_blocks_override "
        "gpu_memory_utilization enforce_eager scheduling_policy max_logprobs"
    ).split()
    return {k: getattr(ns, k) for k in keys}


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    llm = LLM(ns.model, **engine_kwargs(ns))
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.sampling_seed)
    if ns.chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(ns.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF folder, .gguf file or SmolLM2-135M-Instruct (default)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from pagoda.bench.cli import add_bench_parser
    from pagoda.serve.cli import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)

    ns = parser.parse_args(argv)
    from pagoda.model.errors import ModelLoadError

    try:
        return ns.func(ns)
    except (ModelLoadError, ValueError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
