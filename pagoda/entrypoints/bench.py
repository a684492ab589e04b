"""`pagoda bench throughput | latency | serve`: the flags, and the glue to the benchmark modules
(pagoda.bench).

Engine flags are the ones `pagoda generate` takes (vLLM's names); `--seed` seeds both the engine and
the workload, `--dtype` applies to Pagoda and the transformers reference alike.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

from pagoda.bench.common import BenchError
from pagoda.config import EngineArgs
from pagoda.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs, field_help


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A benchmark that cannot produce trustworthy numbers says why and exits 1, no traceback."""

    def run(ns: argparse.Namespace) -> int:
        try:
            return fn(ns)
        except BenchError as exc:
            print(f"pagoda bench: error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # e.g. --json or --plot could not be written after the run
            print(f"pagoda bench: error: {exc}", file=sys.stderr)
            return 1

    return run


def _set_threads(ns: argparse.Namespace) -> None:
    if ns.torch_threads is not None:
        import torch

        if ns.torch_threads < 1:
            raise ValueError("--torch-threads must be >= 1")
        torch.set_num_threads(ns.torch_threads)


def cmd_throughput(ns: argparse.Namespace) -> int:
    from pagoda.bench.throughput import run_throughput

    _set_threads(ns)
    run_throughput(ns, engine_kwargs(ns))
    return 0


def cmd_latency(ns: argparse.Namespace) -> int:
    from pagoda.bench.latency import run_latency

    _set_threads(ns)
    run_latency(ns, engine_kwargs(ns))
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from pagoda.bench.serve import run_serve

    record = run_serve(ns)
    # Numbers over a partly failed run are still written, but scripts must notice the failures.
    return 0 if record["metrics"]["failed"] == 0 else 1


def _rate(text: str) -> float:
    value = float(text)  # float() takes "inf"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _add_model_and_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EngineArgs.model, help=field_help("model"))
    p.add_argument("--compare", choices=["hf"], default=None, help="also run transformers on the same workload")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write every number and the settings here")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads for both engines (default: torch's choice, one per core)",
    )
    p.add_argument(
        "--disable-detokenize", action="store_true", help="skip Pagoda's detokenization (transformers never detokenizes)"
    )


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, latency, serve (docs/benchmarks.md)",
                                  formatter_class=HelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser(
        "throughput",
        help="offline throughput of LLM.generate on a workload",
        description="Offline throughput: requests/s, output tokens/s and total (prompt + output) tokens/s.",
        formatter_class=HelpFormatter,
    )
    _add_model_and_output(tp)
    tp.add_argument("--workload", default="random", help="random, prefix, or a .jsonl file of {prompt, max_tokens}")
    tp.add_argument("--num-prompts", type=int, default=None, help="requests (default 64; a .jsonl: all its lines)")
    tp.add_argument("--input-len-min", type=int, default=32, help="random: shortest prompt")
    tp.add_argument("--input-len-max", type=int, default=512, help="random: longest prompt")
    tp.add_argument("--prefix-len", type=int, default=1024, help="prefix: shared prefix tokens")
    tp.add_argument("--suffix-len", type=int, default=32, help="prefix: unique tokens per request")
    tp.add_argument("--output-len", type=int, default=128, help="output tokens per request (a .jsonl's default)")
    tp.add_argument("--hf-batch-sizes", default="16,32,64", help="transformers batch sizes to try; the fastest counts")
    tp.add_argument("--runs", type=int, default=1, help="repeat K times and report the median run")
    add_engine_args(tp)
    tp.set_defaults(func=_guard(cmd_throughput))

    lat = sub.add_parser(
        "latency",
        help="one request's prefill and decode speed across prompt lengths",
        description="Single-request latency: prefill tokens/s (prompt / TTFT) and decode ms/token.",
        formatter_class=HelpFormatter,
    )
    _add_model_and_output(lat)
    lat.add_argument("--input-lens", default="32,128,512,1024", help="prompt lengths to measure")
    lat.add_argument("--output-len", type=int, default=128, help="tokens to decode per request")
    lat.add_argument("--runs", type=int, default=5, help="median over K requests per prompt length")
    add_engine_args(lat)
    lat.set_defaults(func=_guard(cmd_latency))

    sv = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (ours or another)",
        description="Streams /v1/completions requests at Poisson arrivals or fixed concurrency; "
        "reports TTFT, ITL, TPOT, E2E, throughput and goodput.",
        formatter_class=HelpFormatter,
    )
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    sv.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    sv.add_argument("--endpoint", default="/v1/completions", help="the streaming completions route")
    sv.add_argument("--tokenizer", default=None, help="model whose tokenizer draws the prompts (default: SmolLM2)")
    sv.add_argument("--vocab-size", type=int, default=None, help="draw token ids from [0, V) without loading a tokenizer")
    sv.add_argument("--prompt-format", choices=["ids", "text"], default="ids", help="send token ids (exact) or text")
    sv.add_argument("--num-prompts", type=int, default=128, help="requests to send")
    sv.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per second; inf: all at once")
    sv.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    sv.add_argument("--input-len-min", type=int, default=32, help="shortest prompt")
    sv.add_argument("--input-len-max", type=int, default=512, help="longest prompt")
    sv.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    sv.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    sv.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: time to first token at most this")
    sv.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: time per output token at most this")
    sv.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput: end-to-end latency at most this")
    sv.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests sent first")
    sv.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    sv.add_argument("--request-timeout", type=float, default=None, help="seconds; default: none")
    sv.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds the warm-up waits for a server still starting (503)"
    )
    sv.add_argument("--json", default=None, metavar="OUT.json", help="write every number and the settings here")
    sv.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs and throughput over time")
    sv.set_defaults(func=_guard(cmd_serve))
