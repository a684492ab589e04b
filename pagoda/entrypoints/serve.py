"""`pagoda serve [MODEL]`: the OpenAI-compatible server's flags (vLLM's names), and the wiring of
logging, API keys, the app, its operations routes and the server behind them.

`pagoda.entrypoints.cli` registers this subcommand through `add_serve_parser`.
--host and --port default to $PAGODA_HOST / $PAGODA_PORT when set (so `make serve` can be pointed
at another port without editing the Makefile), else 0.0.0.0:8000 as vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from pagoda.config import EngineArgs
from pagoda.engine.routing import ROUTING_POLICIES
from pagoda.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs, field_help
from pagoda.entrypoints.vllm_compat import add_vllm_compat_args
from pagoda.serve.reasoning_parsers import REASONING_PARSERS
from pagoda.serve.tool_parsers import TOOL_PARSERS


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...).",
        formatter_class=HelpFormatter,
    )
    p._optionals.title = "frontend (the HTTP server)"  # vLLM's --help title for the flags added to `p` itself
    p.add_argument("model", nargs="?", default=EngineArgs.model, help=field_help("model"))
    p.add_argument("--model", dest="model_flag", action="append", default=None,
                   help="the model, as a flag (as vLLM accepts); repeated (NAME=PATH or PATH): several models, "
                        "each its own engine, routed by the request's model field")
    p.add_argument("--models-file", default=None, help="several models: JSON {name: path} or lines 'NAME PATH'")
    p.add_argument("--max-loaded-models", type=int, default=None,
                   help="with several models: the most loaded at once (least recently used unloaded first)")
    p.add_argument("--model-load-timeout", type=float, default=300.0,
                   help="with several models: seconds a request waits for its model to load (then 503)")
    p.add_argument("--host", default=os.environ.get("PAGODA_HOST", "0.0.0.0"), help="address to listen on")
    p.add_argument("--port", type=int, default=int(os.environ.get("PAGODA_PORT", "8000")), help="port to listen on")
    p.add_argument(
        "--api-key", action="append", default=None,
        help="accept this API key (repeatable); with keys set, every /v1 route needs one",
    )
    p.add_argument(
        "--api-keys-file", default=None,
        help="JSON or lines 'KEY [REQUESTS_PER_SECOND [TOKENS_PER_MINUTE [PRIORITY]]]' ('-' = unset)",
    )
    p.add_argument("--served-model-name", nargs="+", default=EngineArgs.served_model_name,
                   help="name(s) clients use for the model; the first is the one reported")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 429 while this many requests are already waiting for the engine")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request is aborted (504); default: none")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model may call the tools, parsed by --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model family's tool-call syntax: hermes (Hermes, Qwen2.5, Qwen3), llama3_json "
                        "(Llama 3.1-3.3), mistral (Mistral v3 tokenizers)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="put the model's <think> text into reasoning_content instead of content")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the least severe log lines shown")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object per line (both processes, uvicorn included)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one INFO line per finished request (with its id); else at DEBUG")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between engine status lines while busy (0: none)")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic engine status lines")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="export a trace per request (queue, prefill, decode spans) to this OTLP/HTTP URL, "
                        "e.g. http://localhost:4318/v1/traces")
    p.add_argument("--metrics-prefix", default="pagoda", choices=["pagoda", "vllm"],
                   help="the prefix of /metrics names; vllm: vLLM's names, so its dashboards and alerts work unchanged")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting (0: stop at once)")
    p.add_argument("--routing-policy", default="cache_aware", choices=ROUTING_POLICIES,
                   help="with --data-parallel-size > 1, which replica serves a request: the one holding the longest "
                        "prefix of its prompt (cache_aware), the least loaded, in turn (round_robin), or by "
                        "session (the X-Session-Id header, else the request's `user`)")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        p.add_argument(f"--allowed-{name}", nargs="+", default=["*"], metavar=name[:-1].upper(),
                       help=f"CORS: the {what} browsers may use, separated by spaces or as a JSON list (vLLM's form)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and Authorization headers")
    p.add_argument("--root-path", default="", help="ASGI root path when behind a path-based proxy")
    add_engine_args(p)
    add_vllm_compat_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(ns: argparse.Namespace) -> int:
    # Imported here, not at the top: `pagoda --help` and the other subcommands need none of them.
    from pagoda.model.loader import DEFAULT_MODEL, resolve_model
    from pagoda.ops.logs import LogSetup, configure_logging
    from pagoda.ops.server_ops import OpsConfig, install_ops
    from pagoda.serve.app import ServerConfig, build_app
    from pagoda.serve.chat_output import ChatParsers
    from pagoda.serve.server import make_state, run_server
    from pagoda.serve.tenants import build_registry

    configure_logging(ns.log_level, ns.log_format, "api")
    if ns.models_file or len(ns.model_flag or ()) > 1:
        from pagoda.entrypoints.serve_pool import cmd_serve_pool, read_models

        return cmd_serve_pool(ns, read_models([*([ns.model] if ns.model else []), *(ns.model_flag or ())],
                                              ns.models_file))
    model = ns.model_flag[0] if ns.model_flag else ns.model
    if ns.model_flag and ns.model and model != ns.model:
        raise ValueError(f"two different models given: {ns.model!r} and --model {model!r}")
    source = resolve_model(model, ns.revision)  # a bad model fails here, before anything starts
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0")
    if ns.request_timeout is not None and ns.request_timeout <= 0:
        raise ValueError("--request-timeout must be > 0")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    if ns.drain_timeout < 0 or ns.log_stats_interval < 0:
        raise ValueError("--drain-timeout and --log-stats-interval must be >= 0")
    names = ns.served_model_name or [model or DEFAULT_MODEL]
    try:
        tenants = build_registry(ns.api_key or _env_keys(), ns.api_keys_file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read API keys: {exc}") from None
    chat_template = _read_template(ns.chat_template)
    parsers = ChatParsers.from_names(ns.reasoning_parser, ns.tool_call_parser, ns.enable_auto_tool_choice)
    engine_args = EngineArgs.from_kwargs(model=model, served_model_name=names[0], **engine_kwargs(ns))
    config = ServerConfig(
        served_model_names=names,
        max_waiting_requests=ns.max_waiting_requests,
        request_timeout=ns.request_timeout,
        allowed_origins=_cors_list("--allowed-origins", ns.allowed_origins),
        allowed_methods=_cors_list("--allowed-methods", ns.allowed_methods),
        allowed_headers=_cors_list("--allowed-headers", ns.allowed_headers),
        allow_credentials=ns.allow_credentials,
        chat_parsers=parsers,
    )
    state = make_state(
        engine_args, config, tenants, chat_template=chat_template, log_level=ns.log_level,
        log_setup=LogSetup(ns.log_level, ns.log_format, "engine-core"), routing_policy=ns.routing_policy,
    )
    app = build_app(state)
    install_ops(app, state, OpsConfig(
        log_requests=ns.enable_log_requests,
        log_stats_interval=0.0 if ns.disable_log_stats else ns.log_stats_interval,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        metrics_prefix=ns.metrics_prefix,
    ))
    logging.getLogger("pagoda.serve").info(
        "serving %s (%s) on http://%s:%d%s", names[0], source.path, ns.host, ns.port,
        f" with {len(tenants)} API key(s)" if tenants.enabled else "",
    )
    code = run_server(
        state, ns.host, ns.port, log_level=ns.log_level, app=app, drain_timeout=ns.drain_timeout,
        own_logging=True, root_path=ns.root_path,
    )
    if state.startup_error is not None:
        # The engine core could not start with these arguments (found only once it loaded the
        # model): end as the checks above do, with one line and exit code 2 (pagoda.entrypoints.cli.main).
        raise ValueError(state.startup_error)
    return code


def _cors_list(flag: str, values: list[str]) -> list[str]:
    """A CORS flag's values: words, or vLLM's one JSON list (`'["http://a", "http://b"]'`)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not a JSON list ({exc.msg} at column {exc.colno})") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{flag}: the JSON must be a list of strings, got {values[0]}")
        return parsed
    return list(values)


def _env_keys() -> list[str] | None:
    key = os.environ.get("PAGODA_API_KEY")
    return [key] if key else None


def _read_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        # Not Jinja (no tag, no expression): a mistyped path, which would otherwise be served as the
        # template text itself.
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    return value

