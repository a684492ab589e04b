"""POST /update_weights on a real server: drain under 16 concurrent streams, abort, in_place, bad
checkpoints refused with a 400, and the version on every response, in /v1/models and in /metrics.

Two tiny random checkpoints of one architecture: A (seed 0) and B (seed 1). The references are the
greedy texts of fresh offline engines on each, so "entirely A's or entirely B's" is checked token
for token."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from tests.serve.serve_helpers import ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

PROMPTS = [" ".join(f"w{(7 * i + 3 * k) % 500 + 3}" for k in range(5 + i % 7)) for i in range(16)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    for name, seed in (("A", 0), ("B", 1)):
        save_tiny_model("llama3", root / name, seed=seed)
        save_tiny_tokenizer(root / name)
    return root


@pytest.fixture(scope="module")
def refs(ckpts):
    """Greedy texts per version on a fresh offline engine."""
    out = {}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("A", "B"):
        llm = LLM(str(ckpts / name), dtype="float32", num_gpu_blocks_override=256)
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert out["A"] != out["B"]
    return out


@pytest.fixture(scope="module")
def server(ckpts):
    srv = ServerProcess([str(ckpts / "A"), "--dtype", "float32", "--num-gpu-blocks-override", "256",
                         "--weight-version", "A", "--served-model-name", "tiny",
                         "--chat-template", "{% for m in messages %}{{ m['content'] }} {% endfor %}"]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _update(srv, path, version=None, mode="drain", timeout=300.0) -> httpx.Response:
    return httpx.post(f"{srv.url}/update_weights", json={"model_path": str(path), "version": version, "mode": mode},
                      timeout=timeout)


def _ensure(srv, ckpts, version: str) -> None:
    if httpx.get(f"{srv.url}/v1/models").json()["data"][0]["weight_version"] != version:
        assert _update(srv, ckpts / version, version).status_code == 200


def _complete(srv, i: int) -> tuple[str, str, str]:
    r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], r.headers["x-weight-version"], body["system_fingerprint"]


async def _stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int = MAX_TOKENS,
                  first_chunk: asyncio.Event | None = None) -> dict:
    """One streamed completion: its text, header version, every chunk's fingerprint, any error event."""
    out = {"i": i, "text": "", "fingerprints": [], "error": None, "status": None, "header": None}
    body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        out["status"], out["header"] = r.status_code, r.headers.get("x-weight-version")
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["error"] = data["error"]["message"]
                continue
            out["fingerprints"].append(data["system_fingerprint"])
            out["text"] += data["choices"][0]["text"]
            if first_chunk is not None:
                first_chunk.set()
    return out


def test_drain_update_under_16_streams_every_response_is_a_or_b(server, ckpts, refs):
    _ensure(server, ckpts, "A")

    async def run() -> tuple[list[dict], httpx.Response]:
        results: list[dict] = []
        update_done = asyncio.Event()
        async with httpx.AsyncClient(timeout=300) as client:
            async def worker(w: int) -> None:
                n = 0
                # Keep streaming until the update is done, then once more: streams run throughout.
                while not update_done.is_set() or n < 2:
                    results.append(await _stream(client, server.url, (w + n) % 16))
                    n += 1
                    if update_done.is_set():
                        results.append(await _stream(client, server.url, (w + n) % 16))
                        return

            workers = [asyncio.create_task(worker(w)) for w in range(16)]
            await asyncio.sleep(0)
            while len(results) < 16:  # every worker has finished a stream on A: all are busy
                await asyncio.sleep(0.01)
            resp = await client.post(f"{server.url}/update_weights",
                                     json={"model_path": str(ckpts / "B"), "version": "B", "mode": "drain"})
            update_done.set()
            await asyncio.gather(*workers)
        return results, resp

    results, resp = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    report = resp.json()
    assert report["weight_version"] == "B" and report["previous_version"] == "A" and report["mode"] == "drain"
    seen = {"A": 0, "B": 0}
    for r in results:
        assert r["status"] == 200 and r["error"] is None, r
        version = r["header"]
        assert version in ("A", "B"), r
        assert set(r["fingerprints"]) == {version}, r  # every chunk says the same version as the header
        assert r["text"] == refs[version][r["i"]], r  # token for token that version's greedy output
        seen[version] += 1
    assert seen["A"] >= 16 and seen["B"] >= 16, seen
    # After the swap: a fresh engine on B's output, and the version in the body and header.
    for i in range(4):
        assert _complete(server, i) == (refs["B"][i], "B", "B")
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["weight_version"] == "B" and card["weights_loaded_at"] > 0 and card["state"] == "ready"


def _bad_copy(ckpts, name, change):
    folder = ckpts / name
    if not folder.exists():
        shutil.copytree(ckpts / "B", folder)
        changed = change(load_file(str(folder / "model.safetensors")))
        if isinstance(changed, bytes):
            (folder / "model.safetensors").write_bytes(changed)
        else:
            save_file(changed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _drop(t):
    t.pop("model.layers.0.mlp.up_proj.weight")
    return t


def _misshape(t):
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:, :32].contiguous()
    return t


def test_bad_checkpoints_get_400_and_a_keeps_serving(server, ckpts, refs):
    _ensure(server, ckpts, "A")
    save_tiny_model("qwen3", ckpts / "qwen3", seed=3)
    cases = {
        "missing tensor": (_bad_copy(ckpts, "missing", _drop), ["up_proj", "missing"]),
        "mis-shaped tensor": (_bad_copy(ckpts, "misshaped", _misshape), ["k_proj", "shape"]),
        "unreadable file": (_bad_copy(ckpts, "garbage", lambda t: b"\x01garbage" * 64), ["safetensors"]),
        "other architecture": (ckpts / "qwen3", ["Qwen3ForCausalLM", "LlamaForCausalLM"]),
        "no such path": (ckpts / "nowhere", ["no such file or folder"]),
    }
    for case, (path, words) in cases.items():
        r = _update(server, path, "bad")
        assert r.status_code == 400, (case, r.text)
        message = r.json()["error"]["message"]
        assert all(w in message for w in words) and "\n" not in message, (case, message)
        assert r.json()["error"]["param"] == "model_path"
        assert _complete(server, 0) == (refs["A"][0], "A", "A"), case
    r = _update(server, ckpts / "B", "B", mode="sideways")
    assert r.status_code == 400 and "mode must be one of drain, abort, in_place" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/update_weights", json={"version": "x"})
    assert r.status_code == 400  # no model_path
    for i in range(16):
        assert _complete(server, i) == (refs["A"][i], "A", "A")
    # SGLang's path and field name do the same.
    r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=300,
                   json={"model_path": str(ckpts / "A"), "weight_version": "A-again"})
    assert r.status_code == 200 and r.json()["weight_version"] == "A-again"
    assert _complete(server, 0) == (refs["A"][0], "A-again", "A-again")
    assert _update(server, ckpts / "A", "A").status_code == 200


def test_a_second_update_while_one_runs_is_a_409(server, ckpts, refs):
    _ensure(server, ckpts, "A")

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            started = asyncio.Event()
            # A drain update waits for this request, so it stays in progress meanwhile.
            long = asyncio.create_task(_stream(client, server.url, 5, max_tokens=300, first_chunk=started))
            await asyncio.wait_for(started.wait(), 120)
            first = asyncio.create_task(client.post(f"{server.url}/update_weights",
                                                    json={"model_path": str(ckpts / "B"), "version": "B"}))

            async def card_state() -> str:
                return (await client.get(f"{server.url}/v1/models")).json()["data"][0]["state"]

            while await card_state() != "updating":
                await asyncio.sleep(0.01)
            second = await client.post(f"{server.url}/update_weights",
                                       json={"model_path": str(ckpts / "A"), "version": "A2"})
            return second, await first, await long

    second, first, long = asyncio.run(run())
    assert second.status_code == 409 and "an update to version 'B' is in progress" in second.json()["error"]["message"]
    assert first.status_code == 200 and first.json()["weight_version"] == "B"
    assert long["error"] is None and set(long["fingerprints"]) == {"A"}  # drained: wholly on A


def test_abort_mode_ends_running_requests_with_a_clear_error(server, ckpts, refs):
    _ensure(server, ckpts, "A")

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            started = asyncio.Event()
            long = asyncio.create_task(_stream(client, server.url, 0, max_tokens=400, first_chunk=started))
            await asyncio.wait_for(started.wait(), 120)
            resp = await client.post(f"{server.url}/update_weights",
                                     json={"model_path": str(ckpts / "B"), "version": "B", "mode": "abort"})
            return await long, resp

    long, resp = asyncio.run(run())
    assert resp.status_code == 200 and resp.json()["mode"] == "abort"
    assert long["error"] is not None and "the weights were updated to version 'B' (mode abort)" in long["error"]
    assert set(long["fingerprints"]) == {"A"}
    assert _complete(server, 1) == (refs["B"][1], "B", "B")


def test_in_place_mode_continues_running_requests_marked_with_both_versions(server, ckpts, refs):
    _ensure(server, ckpts, "B")

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            started = asyncio.Event()
            long = asyncio.create_task(_stream(client, server.url, 2, max_tokens=400, first_chunk=started))
            await asyncio.wait_for(started.wait(), 120)
            resp = await client.post(f"{server.url}/update_weights",
                                     json={"model_path": str(ckpts / "A"), "version": "A", "mode": "in_place"})
            return await long, resp

    long, resp = asyncio.run(run())
    assert resp.status_code == 200 and resp.json()["mode"] == "in_place"
    assert long["error"] is None and long["header"] == "B"
    assert long["fingerprints"][0] == "B" and long["fingerprints"][-1] == "B+A"  # marked: ran on both
    assert long["text"].startswith(refs["B"][2][:8])
    assert _complete(server, 3) == (refs["A"][3], "A", "A")  # the prefix cache held nothing of B's


def test_weight_version_in_metrics_and_chat(server, ckpts):
    _ensure(server, ckpts, "B")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json=chat)
    assert r.status_code == 200, r.text
    assert r.headers["x-weight-version"] == "B" and r.json()["system_fingerprint"] == "B"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={**chat, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-weight-version"] == "B"
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2 and {c["system_fingerprint"] for c in chunks} == {"B"}
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'pagoda:weight_version_info{model_name="tiny",weight_version="B"} 1.0' in metrics
    assert 'pagoda:request_success_by_weight_version_total{model_name="tiny",weight_version="A"}' in metrics
