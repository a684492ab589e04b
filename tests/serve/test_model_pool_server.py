"""Two models in one server with --max-loaded-models 1: requests alternate between them, each one
loading its model (and unloading the other), and every request succeeds with its own model's
greedy output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagoda import LLM, SamplingParams
from tests.serve.serve_helpers import ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

PROMPT = "w5 w9 w33 w70 w2 w8"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    refs = {}
    for name, seed in (("a", 0), ("b", 1)):
        save_tiny_model("llama3", root / name, seed=seed)
        save_tiny_tokenizer(root / name)
        llm = LLM(str(root / name), dtype="float32", num_gpu_blocks_override=64)
        refs[name] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
    assert refs["a"] != refs["b"]
    return root, refs


@pytest.fixture(scope="module")
def server(models):
    root, _ = models
    srv = ServerProcess(["--model", f"a={root / 'a'}", "--model", f"b={root / 'b'}", "--max-loaded-models", "1",
                         "--dtype", "float32", "--num-gpu-blocks-override", "64"]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _ask(srv, model: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=600, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def _states(srv) -> dict:
    return {m["id"]: (m["state"], m["loads"]) for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}


def test_alternating_requests_load_and_unload_with_k_1(server, models):
    _, refs = models
    assert _states(server) == {"a": ("unloaded", 0), "b": ("unloaded", 0)}
    for i, model in enumerate(["a", "b", "a", "b"]):
        r = _ask(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model and r.json()["choices"][0]["text"] == refs[model]
        other = "b" if model == "a" else "a"
        states = _states(server)
        assert states[model] == ("loaded", i // 2 + 1) and states[other][0] == "unloaded", states
    r = _ask(server, "c")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_concurrent_requests_for_both_models_all_succeed(server, models):
    _, refs = models
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda m: (m, _ask(server, m)), ["a", "b"]))
    for model, r in results:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == refs[model]
    assert sum(1 for s, _ in _states(server).values() if s == "loaded") == 1
