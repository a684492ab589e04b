"""max_model_len against the model's context: the default, vLLM's refusal of a longer value, and the
PAGODA_ALLOW_LONG_MAX_MODEL_LEN override, through the function, `LLM` and `pagoda generate`
(`pagoda serve`: tests/serve/test_serve_units.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagoda import SamplingParams
from pagoda.engine.context_length import ALLOW_LONG_MAX_MODEL_LEN_ENV, resolve_max_model_len
from tests.conftest import make_engine

TOO_LONG = "User-specified max_model_len (513) is greater than the derived max_model_len (max_position_embeddings=512"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    # A developer's shell may set it; every test here states what it wants.
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)


@pytest.mark.parametrize(
    "requested, config, want",
    [
        (None, SimpleNamespace(max_position_embeddings=512), 512),
        (None, SimpleNamespace(max_position_embeddings=40960), 8192),  # the default is capped
        (None, SimpleNamespace(), 2048),  # a config that names no context length
        (512, SimpleNamespace(max_position_embeddings=512), 512),  # the whole context is fine
        (40960, SimpleNamespace(max_position_embeddings=40960), 40960),  # past the default cap, within the model's
        (10**6, SimpleNamespace(), 10**6),  # an unknown context refuses nothing
    ],
)
def test_resolve_accepts(requested, config, want):
    assert resolve_max_model_len(requested, config) == want


def test_resolve_refuses_longer_than_the_context_in_one_line():
    with pytest.raises(ValueError) as info:
        resolve_max_model_len(513, SimpleNamespace(max_position_embeddings=512))
    msg = str(info.value)
    assert msg.startswith(TOO_LONG) and ALLOW_LONG_MAX_MODEL_LEN_ENV + "=1" in msg and "\n" not in msg


def test_resolve_names_the_sliding_window_that_capped_the_context():
    # The loader has set max_position_embeddings to the window (config.json said more).
    config = SimpleNamespace(max_position_embeddings=4096, sliding_window=4096, layer_types=None)
    with pytest.raises(ValueError, match=r"max_position_embeddings=4096 in the model's config, capped at its sliding"):
        resolve_max_model_len(8192, config)
    full = SimpleNamespace(max_position_embeddings=4096, sliding_window=4096, layer_types=["full_attention"])
    with pytest.raises(ValueError) as info:
        resolve_max_model_len(8192, full)
    assert "sliding window" not in str(info.value)


@pytest.mark.parametrize("value, allowed", [("1", True), ("true", True), (" TRUE ", True), ("0", False), ("", False)])
def test_resolve_override_env(monkeypatch, caplog, value, allowed):
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, value)
    config = SimpleNamespace(max_position_embeddings=512)
    if not allowed:
        with pytest.raises(ValueError):
            resolve_max_model_len(513, config)
        return
    with caplog.at_level(logging.WARNING, logger="pagoda.engine.context_length"):
        assert resolve_max_model_len(513, config) == 513
    assert any(r.levelno == logging.WARNING and TOO_LONG in r.getMessage() for r in caplog.records)


# -- through the front doors, on the tiny Llama (max_position_embeddings 512) ------------------------
def test_llm_refuses_a_max_model_len_past_the_model_context(tiny_llama3_fp32):
    from pagoda import LLM

    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama3_fp32.source.path), device="cpu", max_model_len=513, num_gpu_blocks_override=64)
    assert str(info.value).startswith(TOO_LONG) and "\n" not in str(info.value)


def test_llm_default_max_model_len_is_the_model_context(tiny_llama3_fp32):
    assert make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64).engine.max_model_len == 512


def test_override_env_lets_the_engine_run_past_the_model_context(tiny_llama3_fp32, monkeypatch):
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_model_len=1024)
    assert llm.engine.max_model_len == 1024
    # A prompt the model's own context would not hold is accepted and served.
    prompt = [3 + i % 500 for i in range(600)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_cli_generate_refuses_in_one_line(tiny_llama3_fp32, capsys):
    from pagoda.entrypoints.cli import main

    argv = ["generate", "hi", "--model", str(tiny_llama3_fp32.source.path), "--device", "cpu", "--max-model-len", "513"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error: " + TOO_LONG) and err.count("\n") == 1
