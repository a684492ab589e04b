"""The `pagoda` command: the top parser, `pagoda --version`, `pagoda generate`, and `main`, which runs
a subcommand and turns a refused argument or model into one `pagoda: error:` line and exit code 2.

`pagoda serve` lives in entrypoints/serve.py, `pagoda chat` in entrypoints/chat.py, `pagoda bench` in
entrypoints/bench.py, `pagoda top` in entrypoints/top.py, `pagoda router` in entrypoints/router.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagoda.config import EngineArgs
from pagoda.entrypoints.bench import add_bench_parser
from pagoda.entrypoints.chat import add_chat_parser, add_sampling_flags, sampling_params, stream_local
from pagoda.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs, field_help
from pagoda.entrypoints.router import add_router_parser
from pagoda.entrypoints.serve import add_serve_parser
from pagoda.entrypoints.top import add_top_parser
from pagoda.version import __version__


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagoda.engine.llm import LLM

    llm = LLM(ns.model, **engine_kwargs(ns))
    params = sampling_params(ns, llm.get_default_sampling_params()).clone(seed=ns.sampling_seed)
    if ns.chat:
        from pagoda.engine.input_processor import chat_prompt_ids

        if not getattr(llm.get_tokenizer(), "chat_template", None):
            raise ValueError("this model has no chat template")
        messages = [{"role": "user", "content": ns.prompt}]
        prompt = {"prompt_token_ids": chat_prompt_ids(llm.get_tokenizer(), messages, add_generation_prompt=True)}
    else:
        prompt = ns.prompt
    if ns.stream:
        for piece in stream_local(llm.engine, prompt, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        return 0
    out = llm.generate(prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help="generate text for one prompt", formatter_class=HelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--model", default=EngineArgs.model, help=field_help("model"))
    add_sampling_flags(gen, 64)
    gen.add_argument("--stop", action="append", default=None, help="stop before this text (repeatable)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="the request's own sampling seed")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagoda {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_top_parser(sub)
    add_router_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from pagoda.model.errors import ModelLoadError

    try:
        return ns.func(ns)
    except (ModelLoadError, ValueError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
