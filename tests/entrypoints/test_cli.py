"""The `pagoda` command line: engine flags generated from `EngineArgs`, one default for each, shown in
`--help`, and reaching the engine; the composition root is imported by nothing else in `pagoda`."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli import build_parser
from pagoda.entrypoints.engine_args import add_engine_args, engine_flag_fields, engine_kwargs

REPO = Path(__file__).resolve().parents[2]
# vLLM's names, as `pagoda` has taken them; a rename here breaks users' scripts.
ENGINE_FLAGS = [
    "--revision", "--tokenizer", "--generation-config", "--dtype", "--kv-cache-dtype", "--device", "--seed", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching", "--enable-chunked-prefill",
    "--long-prefill-token-threshold", "--scheduling-policy", "--kv-cache-memory", "--num-gpu-blocks-override",
    "--gpu-memory-utilization", "--enforce-eager", "--tensor-parallel-size", "--pipeline-parallel-size", "--enable-expert-parallel",
    "--data-parallel-size", "--distributed-executor-backend", "--max-logprobs", "--speculative-config",
    "--kv-offloading-size", "--kv-offloading-backend", "--kv-offloading-dir", "--preemption-mode", "--weight-version", "--quantization",
]


def test_parallel_flags_take_vllms_short_names():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["-tp", "2", "-pp", "3", "-dp", "4", "--distributed-executor-backend", "mp"])
    assert (ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.distributed_executor_backend) == (2, 3, "mp")
    assert ns.data_parallel_size == 4
    assert p.parse_args([]).distributed_executor_backend is None


def _subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {a.dest: a.default for a in parser._actions}


def test_engine_flags_are_vllms_names():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = [a.option_strings[0] for a in p._actions if a.option_strings and a.dest != "help"]
    assert flags == ENGINE_FLAGS


@pytest.mark.parametrize("path", [("serve",), ("generate",), ("bench", "throughput"), ("bench", "latency")])
def test_every_engine_field_has_a_flag_with_its_default(path):
    defaults = _defaults(_subparser(*path))
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    if path != ("serve",):
        names.remove("served_model_name")  # a serve flag only
    for name in names:
        field = next(f for f in dataclasses.fields(EngineArgs) if f.name == name)
        assert name in defaults, f"{' '.join(path)}: no flag for EngineArgs.{name}"
        assert defaults[name] == field.default, name


def test_speculative_config_json_reaches_engine_args():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    spec = EngineArgs.from_kwargs(**engine_kwargs(ns)).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 5, 5)
    assert EngineArgs.from_kwargs(**engine_kwargs(p.parse_args([]))).speculative_config is None


def test_engine_kwargs_reach_engine_args():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--long-prefill-token-threshold", "64", "--enforce-eager", "--no-enable-prefix-caching",
                       "--max-logprobs", "-1", "--gpu-memory-utilization", "0.5", "--dtype", "half"])
    args = EngineArgs.from_kwargs(**engine_kwargs(ns))
    assert (args.long_prefill_token_threshold, args.enforce_eager, args.enable_prefix_caching) == (64, True, False)
    assert (args.max_logprobs, args.gpu_memory_utilization, args.dtype) == (-1, 0.5, "half")
    # Unset, every flag is the field's default: the command line and the Python API agree.
    assert EngineArgs.from_kwargs(**engine_kwargs(p.parse_args([]))) == EngineArgs()
    assert {f.name for f in engine_flag_fields()} == set(engine_kwargs(p.parse_args([])))


def test_serve_passes_long_prefill_token_threshold_to_the_engine(monkeypatch):
    import pagoda.ops.logs as logs
    import pagoda.serve.server as server

    seen = {}

    class Stop(Exception):
        pass

    def make_state(engine_args, config, *args, **kwargs):
        seen["args"], seen["config"] = engine_args, config
        raise Stop

    monkeypatch.setattr(server, "make_state", make_state)
    monkeypatch.setattr(logs, "configure_logging", lambda *args: None)  # this process's logging stays as it is
    ns = build_parser().parse_args(["serve", "--long-prefill-token-threshold", "64", "--served-model-name", "a", "b"])
    with pytest.raises(Stop):
        ns.func(ns)
    assert seen["args"].long_prefill_token_threshold == 64
    assert seen["args"].served_model_name == "a" and seen["config"].served_model_names == ["a", "b"]


def test_help_shows_defaults():
    text = " ".join(_subparser("serve").format_help().split("\nfrontend (the HTTP server):")[1].split())
    for flag, default in [("--max-num-seqs", "256"), ("--long-prefill-token-threshold", "0"), ("--dtype", "auto"),
                          ("--port", "8000"), ("--no-enable-prefix-caching", "True"), ("--no-enforce-eager", "False")]:
        entry = text[text.index(flag + " "):]
        entry = entry[: entry.find(" --", len(flag))]
        assert f"(default: {default})" in entry, entry


def test_python_m_pagoda_serve_help():
    env = {**os.environ, "COLUMNS": "250"}
    r = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--help"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--long-prefill-token-threshold" in r.stdout and "(default: 2048)" in r.stdout


def test_nothing_else_imports_the_command_line():
    """The composition root sits on top: no other package in pagoda imports it, and no benchmark
    module imports the `pagoda` facade (pagoda/__init__.py)."""
    for path in (REPO / "pagoda").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("pagoda/entrypoints/") or rel == "pagoda/__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("pagoda.entrypoints"), f"{rel} imports {name}"
                if rel.startswith("pagoda/bench/"):
                    assert name != "pagoda", f"{rel} imports the pagoda facade"


@pytest.mark.parametrize("argv, message", [
    (["router"], "no backend given"),
    (["router", "--backend", "ftp://host:1"], "is not an http(s) URL"),
    (["router", "--backend", "http://a:1", "--backend", "http://a:1/"], "a backend is given twice"),
    (["router", "--backends-file", "/nonexistent/backends"], "cannot read --backends-file"),
    (["router", "--backend", "http://a:1", "--health-interval", "0"], "health interval and timeout must be > 0"),
])
def test_router_refuses_bad_backends_in_one_line(argv, message, capsys):
    from pagoda.entrypoints.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagoda: error: ") and message in err and "\n" not in err


def test_router_reads_a_backends_file(tmp_path):
    from pagoda.serve.router_backends import read_backends_file

    f = tmp_path / "backends"
    f.write_text("# the pool\nhttp://10.0.0.1:8000\n\nhttp://10.0.0.2:8000  # second\n")
    assert read_backends_file(str(f)) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    ns = build_parser().parse_args(["serve", "-dp", "2", "--routing-policy", "session"])
    assert (ns.data_parallel_size, ns.routing_policy) == (2, "session")
