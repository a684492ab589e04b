"""`pagoda chat [MODEL | --url URL]`: an interactive chat in the terminal (vLLM's `vllm chat`,
Ollama's `ollama run`), streaming each answer as it is generated and keeping the conversation's
history. Against a local model (loaded in this process) or any OpenAI-compatible server
(`/v1/chat/completions`, streamed). `/reset` starts the conversation again (the system prompt
stays), `/exit` or end of input (Ctrl-D) leaves. Also the local streaming that `pagoda generate
--stream` uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Iterator

from pagoda.config import EngineArgs
from pagoda.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs, field_help

PROMPT = ">>> "
Messages = list[dict[str, str]]


def stream_local(engine: Any, prompt: Any, params: Any) -> Iterator[str]:
    """The text of one request on an in-process `LLMEngine`, piece by piece as the steps make it."""
    rid = engine.add_request(prompt, params, delta=True)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.outputs[0].text:
                    yield out.outputs[0].text
    finally:
        if engine.has_unfinished_requests():  # the reader stopped early (Ctrl-C): free its blocks
            engine.abort_request(rid)


def local_chat(ns: argparse.Namespace) -> Callable[[Messages], Iterator[str]]:
    from pagoda.engine.input_processor import chat_prompt_ids
    from pagoda.engine.llm import LLM

    llm = LLM(ns.model, **engine_kwargs(ns))
    if not getattr(llm.get_tokenizer(), "chat_template", None):
        raise ValueError(f"{ns.model or EngineArgs.model}: the model has no chat template; use `pagoda generate`")
    params = sampling_params(ns, llm.get_default_sampling_params())

    def answer(messages: Messages) -> Iterator[str]:
        ids = chat_prompt_ids(llm.get_tokenizer(), messages, add_generation_prompt=True)
        return stream_local(llm.engine, {"prompt_token_ids": ids}, params)

    return answer


def remote_chat(ns: argparse.Namespace) -> Callable[[Messages], Iterator[str]]:
    import httpx

    base = ns.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    client = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(30.0, read=None))
    try:
        model = ns.model or client.get("/models").raise_for_status().json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{base}: cannot list the served models ({exc})") from None
    fields = {k: v for k, v in (("max_tokens", ns.max_tokens), ("temperature", ns.temperature),
                                ("top_p", ns.top_p), ("top_k", ns.top_k)) if v is not None}

    def answer(messages: Messages) -> Iterator[str]:
        body = {"model": model, "messages": messages, "stream": True, **fields}
        with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(f"the server answered {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ValueError(f"the server failed the answer: {chunk['error'].get('message')}")
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text

    return answer


def sampling_params(ns: argparse.Namespace, defaults: Any) -> Any:
    """The model's defaults, with the flags given; greedy when neither sets a temperature."""
    changes = {k: getattr(ns, k) for k in ("max_tokens", "temperature", "top_p", "top_k") if getattr(ns, k) is not None}
    if getattr(ns, "stop", None):
        changes["stop"] = ns.stop
    if "temperature" not in changes and defaults.temperature == 1.0 and defaults.top_k == 0 and defaults.top_p == 1.0:
        changes["temperature"] = 0.0  # the model names no sampling: answers stay reproducible
    changes.setdefault("max_tokens", 256)
    return defaults.clone(**changes)


def repl(answer: Callable[[Messages], Iterator[str]], system_prompt: str | None, read: Callable[[str], str] = input,
         write: Callable[[str], Any] = sys.stdout.write) -> int:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    history: Messages = list(system)
    write("Chat with the model: /reset starts afresh, /exit (or Ctrl-D) leaves.\n")
    while True:
        try:
            line = read(PROMPT)
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
            write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            history = list(system)
            write("(conversation reset)\n")
            continue
        history.append({"role": "user", "content": line})
        pieces = []
        try:
            for piece in answer(history):
                pieces.append(piece)
                write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            write(" [interrupted]")
        write("\n")
        history.append({"role": "assistant", "content": "".join(pieces)})


def cmd_chat(ns: argparse.Namespace) -> int:
    answer = remote_chat(ns) if ns.url else local_chat(ns)
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    return repl(answer, ns.system_prompt)


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens_default: int | None) -> None:
    s = p.add_argument_group("sampling (default: the model's generation_config.json, else greedy)")
    s.add_argument("--max-tokens", type=int, default=max_tokens_default, help="the most tokens per answer")
    s.add_argument("--temperature", type=float, default=None, help="0: greedy")
    s.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: the smallest set of tokens with this much probability")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0 or -1: all)")


def add_chat_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="chat with a model in the terminal (local, or a server with --url)",
                              description="Chat with a local model, or with any OpenAI-compatible server (--url).",
                              formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=EngineArgs.model,
                   help=field_help("model") + "; with --url, the served model's name (default: the first served)")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server, e.g. http://localhost:8000/v1")
    p.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    p.add_argument("--system-prompt", default=None, help="the system message that opens the conversation")
    add_sampling_flags(p, None)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)
    return p
