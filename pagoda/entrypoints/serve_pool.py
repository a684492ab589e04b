"""`pagoda serve --model A --model B [--max-loaded-models K]` (or `--models-file`): several models
behind one port, each in its own server process started on demand (`pagoda.serve.model_pool`)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from pagoda.entrypoints.engine_args import engine_flag_fields, flag_name


def read_models(models: list[str], models_file: str | None) -> dict[str, str]:
    """{served name: model}: each --model's name is its folder's or file's name (or NAME=PATH); a
    models file is JSON {name: path} or lines 'NAME PATH'."""
    out: dict[str, str] = {}
    entries = [m.split("=", 1) if "=" in m else (Path(m).stem if Path(m).suffix == ".gguf" else Path(m).name, m)
               for m in models]
    if models_file:
        text = Path(models_file).read_text()
        try:
            entries += list(json.loads(text).items())
        except ValueError:
            entries += [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    for name, path in entries:
        if name in out:
            raise ValueError(f"two models are named {name!r}; name them with NAME=PATH")
        out[name] = path.strip()
    return out


def member_args(ns: argparse.Namespace) -> list[str]:
    """The flags each model's own server gets: the engine flags given, and the serving ones."""
    args: list[str] = []
    for f in engine_flag_fields():
        value = getattr(ns, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            args.append(flag_name(f.name) if value else "--no-" + flag_name(f.name)[2:])
        else:
            args += [flag_name(f.name), value if isinstance(value, str) else json.dumps(value)]
    for key in ns.api_key or ():
        args += ["--api-key", key]
    for flag in ("api_keys_file", "chat_template", "max_waiting_requests", "request_timeout"):
        if getattr(ns, flag) is not None:
            args += [flag_name(flag), str(getattr(ns, flag))]
    return args + ["--log-level", ns.log_level, "--log-format", ns.log_format]


def cmd_serve_pool(ns: argparse.Namespace, models: dict[str, str]) -> int:
    import uvicorn

    from pagoda.model.loader import resolve_model
    from pagoda.serve.model_pool import ModelPool
    from pagoda.serve.pool_app import build_pool_app

    for model in models.values():
        resolve_model(model)  # a bad model fails here, before anything starts
    k = ns.max_loaded_models if ns.max_loaded_models is not None else len(models)
    pool = ModelPool(models, k, member_args(ns), load_timeout=ns.model_load_timeout)
    logging.getLogger("pagoda.serve").info("serving %s (at most %d loaded) on http://%s:%d",
                                           ", ".join(models), k, ns.host, ns.port)
    uvicorn.run(build_pool_app(pool), host=ns.host, port=ns.port, log_config=None, log_level=ns.log_level)
    return 0
