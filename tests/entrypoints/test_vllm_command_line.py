"""A vLLM launch line works: `pagoda serve org/name` from the local Hugging Face cache with vLLM's
common flags serves; flags that mean nothing here warn once; flags of features not here yet end the
command in one line with exit code 2; sizes take 4G; `--help` groups and explains every flag; and
the model's generation_config.json sets the defaults of what a request leaves unset."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import httpx
import pytest

from pagoda.config import EngineArgs, parse_size
from pagoda.entrypoints.cli import build_parser
from pagoda.entrypoints.engine_args import engine_kwargs
from pagoda.version import __version__
from tests.model_files_helpers import (MAX_TOKENS, PROMPT_IDS, REPETITION_PENALTY, add_to_hub_cache,
                                       save_model_with_generation_config)
from tests.serve.serve_helpers import REPO, ServerProcess

VLLM_LINE = ["-tp", "1", "--trust-remote-code", "--swap-space", "4", "--disable-log-requests",
             "--kv-cache-memory-bytes", "64M", "--max-model-len", "256", "--dtype", "float32",
             "--max-num-seqs", "8", "--seed", "0", "--gpu-memory-utilization", "0.9"]


def _pagoda(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "pagoda", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("text, size", [("4G", 4 * 2**30), ("512M", 512 * 2**20), ("1.5g", 1_500_000_000),
                                        ("2k", 2000), ("64KiB", 64 * 1024), ("4096", 4096), (123, 123)])
def test_sizes_read_as_vllms(text, size):
    assert parse_size(text) == size


def test_size_flags_take_suffixes_and_refuse_nonsense(capsys):
    ns = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "4G"])
    assert EngineArgs.from_kwargs(**engine_kwargs(ns)).kv_cache_memory == 4 * 2**30
    assert EngineArgs(kv_cache_memory="512M").kv_cache_memory == 512 * 2**20
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--kv-cache-memory", "4X"])
    assert exit_.value.code == 2 and "not a size: '4X'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--enable-lora"], "--enable-lora"), (["--cpu-offload-gb", "4"], "--cpu-offload-gb"),
                                         (["--max-loras", "2"], "--max-loras")])
def test_unsupported_vllm_flags_exit_2_with_one_line(argv, flag):
    r = _pagoda("serve", "--port", "1", *argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("pagoda: error: ") and flag in lines[0]


def test_meaningless_flags_warn_once(capsys):
    from pagoda.entrypoints.vllm_compat import _WarnIgnored

    _WarnIgnored.warned.clear()  # once per process, and this process may have parsed them before
    ns = build_parser().parse_args(["serve", "--trust-remote-code", "--swap-space", "4", "--trust-remote-code"])
    err = capsys.readouterr().err.splitlines()
    assert sum("--trust-remote-code has no effect" in line for line in err) == 1
    assert sum("--swap-space has no effect" in line for line in err) == 1
    assert not hasattr(ns, "trust_remote_code") and not hasattr(ns, "swap_space")


def test_version():
    r = _pagoda("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"pagoda {__version__}")


def test_help_groups_every_flag_with_help_text():
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    titles = [g.title for g in serve._action_groups if g._group_actions]
    for title in ("frontend (the HTTP server)", "model", "cache", "parallel", "scheduler"):
        assert title in titles
    for action in serve._actions:
        if action.help is argparse.SUPPRESS:  # the refused vLLM flags: not offered
            continue
        assert action.help and action.help.strip(), f"{action.option_strings or action.dest} has no help"
    text = _pagoda("serve", "--help").stdout
    assert "--kv-cache-memory-bytes" in text and "(default: 256)" in text and "--enable-lora" not in text


# -- end to end: a vLLM command line, a model by its id from a fake HF cache, generation defaults -----
@pytest.fixture(scope="module")
def gen_model(tmp_path_factory):
    return save_model_with_generation_config(tmp_path_factory.mktemp("vllm_line_model"))


@pytest.fixture(scope="module")
def server(gen_model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_home") / "hub"
    add_to_hub_cache(cache, "acme/tiny-chat", gen_model.folder)
    srv = ServerProcess(["acme/tiny-chat", "--revision", "main", *VLLM_LINE],
                        env={"HF_HUB_CACHE": str(cache), "HF_HOME": ""}).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _complete(srv, **body) -> dict:
    r = httpx.post(f"{srv.base_url}/completions", json={"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.slow
def test_a_vllm_command_line_serves_a_model_by_its_hf_id(server):
    models = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["acme/tiny-chat"]
    log = server.log_tail(200_000)
    for flag in ("--trust-remote-code", "--swap-space", "--disable-log-requests"):
        assert log.count(f"{flag} has no effect") == 1, log[-3000:]
    assert _complete(server)["text"]


@pytest.mark.slow
def test_served_requests_take_the_models_generation_defaults(server, gen_model):
    def tokenizer_ids(choice: dict) -> list[int]:
        return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]

    ids = dict(logprobs=0, return_tokens_as_token_ids=True)
    unset = _complete(server, **ids)
    # Greedy (top_k 1) with the model's repetition penalty, ended by its extra EOS id: transformers' answer.
    assert tokenizer_ids(unset) == gen_model.hf_reference and unset["finish_reason"] == "stop"
    # The request's own values win: no penalty, and a temperature of 0.
    own = _complete(server, repetition_penalty=1.0, temperature=0, **ids)
    assert tokenizer_ids(own) == gen_model.plain and own["finish_reason"] == "length"
    # null is unset: the defaults again.
    assert tokenizer_ids(_complete(server, repetition_penalty=None, top_k=None, **ids)) == gen_model.hf_reference
    assert REPETITION_PENALTY != 1.0
