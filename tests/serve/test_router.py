"""`pagoda router` in front of two real `pagoda serve` processes (a tiny random model) on loopback:
the OpenAI API passed through (streaming included), cache-aware routing (a prompt's prefix keeps
its backend, new prefixes spread over both, a workload without shared prefixes splits evenly), a
stopped backend ejected by the health checks within their interval, and re-admitted when it
returns. The routing units are in tests/engine/test_data_parallel.py."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

import httpx
import pytest

from serve_helpers import ServerProcess

pytestmark = pytest.mark.slow

HEALTH_INTERVAL = 1.0
HEALTH_TIMEOUT = 1.0


def _backend(model, port: int | None = None) -> ServerProcess:
    srv = ServerProcess([str(model), "--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override",
                         "300"])
    if port is not None:
        srv.port = port
        srv.env["PAGODA_PORT"] = str(port)
    return srv


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny_router")
    save_tiny_model("llama3", folder, max_position_embeddings=1024)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def cluster(tiny_model):
    backends = [_backend(tiny_model).start(), _backend(tiny_model).start()]
    router = None
    try:
        for b in backends:
            b.wait_ready()
        urls = [b.url for b in backends]
        router = ServerProcess(cmd=[sys.executable, "-m", "pagoda", "router", "--backend", urls[0], "--backend", urls[1],
                                    "--health-interval", str(HEALTH_INTERVAL), "--health-timeout", str(HEALTH_TIMEOUT)])
        router.start().wait_ready()
        yield router, backends
    finally:
        for p in ([router] if router else []) + backends:
            p.stop()


def _complete(http: httpx.Client, prompt: str, **kw) -> httpx.Response:
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r


def test_passes_the_api_through_streaming_included(cluster):
    router, backends = cluster
    with httpx.Client(base_url=router.url, timeout=60) as http, httpx.Client(base_url=backends[0].url, timeout=60) as b0:
        assert http.get("/v1/models").json()["data"][0]["id"] == b0.get("/v1/models").json()["data"][0]["id"]
        direct = _complete(b0, "w5 w6 w7").json()["choices"][0]["text"]
        whole = _complete(http, "w5 w6 w7")
        assert whole.json()["choices"][0]["text"] == direct
        assert whole.headers["x-pagoda-backend"] in {b.url for b in backends}
        body = {"prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        # Events as the backend sent them (deltas produced before the client reads are merged, so
        # their number varies); together they carry the whole completion.
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2
        assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == direct
        # The tiny tokenizer has no chat template: the backend's own 400, passed on as it is.
        chat_body = {"messages": [{"role": "user", "content": "w9 w10"}], "max_tokens": 3}
        chat, chat_direct = http.post("/v1/chat/completions", json=chat_body), b0.post("/v1/chat/completions",
                                                                                      json=chat_body)
        assert chat.status_code == chat_direct.status_code and chat.json() == chat_direct.json()
        bad = http.post("/v1/completions", json={"prompt": "w1", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the backend's own answer


def test_cache_aware_routing(cluster):
    router, backends = cluster
    systems = [" ".join(f"w{(7 * s + i) % 500 + 3}" for i in range(120)) for s in range(4)]
    with httpx.Client(base_url=router.url, timeout=60) as http:
        where: dict[int, set[str]] = {s: set() for s in range(4)}
        for turn in range(3):
            for s, system in enumerate(systems):
                r = _complete(http, f"{system} w{turn + 400} w{s + 450}")
                where[s].add(r.headers["x-pagoda-backend"])
        assert all(len(w) == 1 for w in where.values()), where  # a prefix keeps its backend
        assert Counter(next(iter(w)) for w in where.values()) == Counter({b.url: 2 for b in backends})
        # No shared prefixes: an even split.
        counts = Counter(_complete(http, f"w{i + 3} " * 40).headers["x-pagoda-backend"] for i in range(20))
        assert len(counts) == 2 and max(counts.values()) - min(counts.values()) <= 0.2 * max(counts.values()), counts


# Must stay last: it stops and restarts a backend.
def test_stopped_backend_is_ejected_within_its_interval_and_readmitted(cluster, tiny_model):
    router, backends = cluster
    with httpx.Client(base_url=router.url, timeout=60) as http:
        assert http.get("/ready").json()["backends_up"] == 2
        port = backends[1].port
        backends[1].stop()
        stopped = time.monotonic()
        while http.get("/ready").json()["backends"][1]["status"] == "up":
            assert time.monotonic() - stopped < 30, "never ejected"
            time.sleep(0.05)
        took = time.monotonic() - stopped
        assert took <= HEALTH_INTERVAL + HEALTH_TIMEOUT + 1.0, took  # + polling and a loaded machine
        assert http.get("/health").status_code == 200
        for i in range(4):  # all served by the other backend
            assert _complete(http, f"w{i + 20} w3").headers["x-pagoda-backend"] == backends[0].url
        backends[1] = _backend(tiny_model, port).start()
        backends[1].wait_ready()
        deadline = time.monotonic() + 10
        while http.get("/ready").json()["backends_up"] != 2:
            assert time.monotonic() < deadline, "not re-admitted"
            time.sleep(0.05)
        served = Counter(_complete(http, f"w{i + 60} " * 30).headers["x-pagoda-backend"] for i in range(6))
        assert served[backends[1].url] >= 2, served
        load = http.get("/load").json()
        assert load["backends_up"] == 2 and len(load["backends"]) == 2 and "num_requests_waiting" in load
