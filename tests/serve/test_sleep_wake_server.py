"""POST /sleep?level=1|2 and POST /wake_up on a real server: the engine core's resident memory (read
from /proc) drops by the weights and the KV cache in use, requests meanwhile get 503 with
Retry-After, and waking up gives the same greedy outputs as before sleeping.

The model is a random Llama of ~90 MB in float32 (large enough that its weights dominate what the
core process holds besides torch itself)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.serve_helpers import ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

VOCAB = 8192
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 4, 64, 16
PROMPTS = [" ".join(f"w{(97 * i + 13 * k) % (VOCAB - 3) + 3}" for k in range(200 + 7 * i)) for i in range(8)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sleepy")
    save_tiny_model("llama3", folder, seed=4, max_position_embeddings=2048, hidden_size=512, intermediate_size=1536,
                    num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=KV_HEADS, vocab_size=VOCAB)
    save_tiny_tokenizer(folder, vocab_size=VOCAB)
    return folder


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess([str(folder), "--dtype", "float32", "--max-model-len", "1024",
                         "--num-gpu-blocks-override", "512", "--served-model-name", "sleepy"]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _greedy(srv) -> list[tuple[str, int]]:
    """Each prompt's greedy text and prompt length, the requests sent together."""

    def one(prompt: str) -> tuple[str, int]:
        r = httpx.post(f"{srv.url}/v1/completions", timeout=300, json={
            "model": "sleepy", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["text"], body["usage"]["prompt_tokens"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def _core_pid(srv) -> int:
    return httpx.get(f"{srv.url}/v1/engine/stats", timeout=30).json()["pid"]


def _core_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _kv_bytes_used(outputs: list[tuple[str, int]]) -> int:
    per_block = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
    return sum(math.ceil((n + MAX_TOKENS) / BLOCK) for _, n in outputs) * per_block


def _asleep_refuses(srv) -> None:
    r = httpx.post(f"{srv.url}/v1/completions", timeout=30, json={"model": "sleepy", "prompt": "w5", "max_tokens": 2})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1 and "sleeping" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/is_sleeping").json() == {"is_sleeping": True}
    assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["state"] == "sleeping"


def test_sleep_level_2_frees_weights_and_kv_and_wake_restores_outputs(server, folder):
    before_outputs = _greedy(server)
    weights = (folder / "model.safetensors").stat().st_size
    kv_used = _kv_bytes_used(before_outputs)
    assert weights > 60 * 2**20 and kv_used > 10 * 2**20
    pid = _core_pid(server)
    rss_before = _core_rss(pid)
    r = httpx.post(f"{server.url}/sleep", params={"level": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["is_sleeping"] is True and r.json()["level"] == 2
    rss_asleep = _core_rss(pid)
    dropped = rss_before - rss_asleep
    assert dropped >= 0.8 * (weights + kv_used), (rss_before, rss_asleep, weights, kv_used)
    _asleep_refuses(server)
    r = httpx.post(f"{server.url}/update_weights", json={"model_path": str(folder)}, timeout=60)
    assert r.status_code == 409 and "sleeping" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/wake_up", timeout=120)
    assert r.status_code == 200 and r.json()["was_level"] == 2
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
    assert _greedy(server) == before_outputs


def test_sleep_level_1_frees_kv_and_wake_restores_outputs(server):
    before_outputs = _greedy(server)
    kv_used = _kv_bytes_used(before_outputs)
    pid = _core_pid(server)
    rss_before = _core_rss(pid)
    r = httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=120)
    assert r.status_code == 200 and r.json()["level"] == 1 and r.json()["weight_bytes_parked"] == 0
    assert rss_before - _core_rss(pid) >= 0.8 * kv_used
    _asleep_refuses(server)
    assert httpx.post(f"{server.url}/wake_up", timeout=120).status_code == 200
    assert _greedy(server) == before_outputs


def test_bad_sleep_level_is_a_400(server):
    r = httpx.post(f"{server.url}/sleep", params={"level": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
