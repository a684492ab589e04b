"""The ops layer in a real `pagoda serve` process on a tiny random model: /metrics counts, gauges
back to zero, prefix-cache and preemption counters, request timelines, JSON logs with request ids,
/ready and /load, and the graceful drain on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.test_ops_units import EXPECTED_NAMES
from tests.serve.serve_helpers import ServerProcess, wait_for
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

HIST_PER_REQUEST = (
    "pagoda:time_to_first_token_seconds", "pagoda:e2e_request_latency_seconds", "pagoda:request_queue_time_seconds",
    "pagoda:request_prefill_time_seconds", "pagoda:request_decode_time_seconds", "pagoda:request_prompt_tokens",
    "pagoda:request_generation_tokens",
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_ops_server")
    # The drain tests run 1,510-token requests with --max-model-len 2048, which the engine refuses
    # for a model whose context (max_position_embeddings) is shorter.
    save_tiny_model("llama3", folder, max_position_embeddings=4096)
    save_tiny_tokenizer(folder)  # streams then carry text for every token
    return folder


@pytest.fixture(scope="module")
def server(tiny_folder):
    # 23 usable blocks of 16 tokens: any three requests growing to ~10 blocks each must preempt.
    srv = ServerProcess([
        str(tiny_folder), "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "24",
        "--log-format", "json", "--enable-log-requests", "--log-stats-interval", "0.2", "--log-level", "debug",
    ]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def scrape(srv) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{srv.url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine", "le")))
            if "le" in s.labels:
                continue
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def idle(srv) -> dict:
    """Metrics once the engine reports nothing running or waiting and an empty KV cache."""

    def check():
        m = scrape(srv)
        done = (m[("pagoda:num_requests_running", ())] == 0 and m[("pagoda:num_requests_waiting", ())] == 0
                and m[("pagoda:kv_cache_usage_perc", ())] == 0)
        return m if done else None

    return wait_for(check, 30, what="running, waiting and KV usage back to 0")


def complete(srv, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(f"{srv.base_url}/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_body_parses_and_has_every_name(server):
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert set(EXPECTED_NAMES) <= names
    assert 'model_name="' in r.text


def test_counters_and_histograms_count_n_requests_exactly(server):
    before = idle(server)
    n, max_tokens = 6, 5
    prompts = [[7 + i] * (10 + i) for i in range(n)]
    results = []
    threads = [threading.Thread(target=lambda p=p: results.append(complete(server, p, max_tokens))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == n
    after = idle(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    for hist in HIST_PER_REQUEST:
        assert delta(hist + "_count") == n, hist
    assert delta("pagoda:request_success_total", finished_reason="length") == n
    assert delta("pagoda:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("pagoda:generation_tokens_total") == n * max_tokens
    assert delta("pagoda:request_generation_tokens_sum") == n * max_tokens
    assert delta("pagoda:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    # Every prompt token and every decode step is scheduled in some iteration.
    assert delta("pagoda:iteration_tokens_total_sum") == sum(len(p) for p in prompts) + n * (max_tokens - 1)


def test_gauges_return_to_zero_after_a_cancelled_stream(server):
    before = idle(server)
    core = int(re.findall(r"core pid (\d+)", server.log_tail(1_000_000))[-1])
    # The engine core runs in 5 ms bursts until the first token has reached this client, then stays
    # frozen while it hangs up: so the request is surely cancelled mid-way, however fast the engine
    # would have finished its 236 tokens.
    first_token = threading.Event()

    def bursts() -> None:
        while not first_token.is_set():
            os.kill(core, signal.SIGCONT)
            time.sleep(0.005)
            os.kill(core, signal.SIGSTOP)
            first_token.wait(0.05)

    os.kill(core, signal.SIGSTOP)
    pulse = threading.Thread(target=bursts)
    pulse.start()
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{server.base_url}/completions",
                               json={"prompt": [3] * 20, "max_tokens": 236, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_token.set()
                        pulse.join()
                        break  # one token arrived: the request is running; now hang up
    finally:
        first_token.set()
        pulse.join()
        os.kill(core, signal.SIGCONT)
    after = idle(server)
    key = ("pagoda:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0) == 1


def test_prefix_cache_hit_counter_rises_for_a_repeated_prompt(server):
    prompt = list(range(100, 148))  # 3 full blocks
    complete(server, prompt, 2)
    before = idle(server)
    complete(server, prompt, 2)
    after = idle(server)
    hits = after[("pagoda:prefix_cache_hits_total", ())] - before[("pagoda:prefix_cache_hits_total", ())]
    queries = after[("pagoda:prefix_cache_queries_total", ())] - before[("pagoda:prefix_cache_queries_total", ())]
    assert queries == 48 and hits == 32  # the last block is always recomputed (a prompt is never a full hit)


def test_forced_preemption_counts_and_shows_in_the_timeline(server):
    before = idle(server)
    # Each grows to 40 + 200 = 240 tokens (15 blocks); any two together need 30 blocks > 23 usable.
    # The four prompts come in one completion, so they are admitted together and must preempt, however
    # fast the engine runs a request (four separate requests arrived tens of milliseconds apart, and a
    # fast enough engine finished each before the next came).
    prompts = [[11 + i] * 40 for i in range(4)]
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"prompt": prompts, "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4
    after = idle(server)
    assert after[("pagoda:num_preemptions_total", ())] - before[("pagoda:num_preemptions_total", ())] >= 1
    r = httpx.get(f"{server.base_url}/requests/{rid}/timeline")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == rid and len(body["sequences"]) == 4  # one per prompt
    preempted = [t for t in body["sequences"] if t["num_preemptions"]]
    assert preempted
    events = [e["event"] for e in preempted[0]["events"]]
    i = events.index("preempted")
    assert "admitted" in events[:i] and "admitted" in events[i:]
    assert events[-1] == "finished" and preempted[0]["events"][-1]["output_tokens"] == 200
    missing = httpx.get(f"{server.base_url}/requests/cmpl-unknown/timeline")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_ready_load_and_health(server):
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}
    assert httpx.get(f"{server.url}/health").status_code == 200
    load = httpx.get(f"{server.url}/load").json()
    assert load["server_load"] == 0 and load["status"] == "ready"
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"} <= set(load)


def test_json_log_lines_carry_request_ids(server):
    rid = complete(server, [5] * 12, 3)["id"]
    idle(server)

    def finished_logged():
        lines = [json.loads(line) for line in server.log_tail(10**7).splitlines() if line.strip()]
        return lines if any(o.get("request_id") == rid and "finished" in o["message"] for o in lines) else None

    lines = wait_for(finished_logged, 10, what="the request's finish line")  # every line parsed as JSON
    about = [o for o in lines if rid in json.dumps(o)]
    assert len(about) >= 2  # received (DEBUG) and finished (INFO)
    assert all(o.get("request_id") == rid for o in about)
    processes = {o["process"] for o in lines}
    assert processes == {"api", "engine-core"}
    assert any("prompt throughput" in o["message"] for o in lines)  # the periodic status line


def test_sigterm_drains_inflight_streams_then_exits_0(tiny_folder):
    srv = ServerProcess([str(tiny_folder), "--dtype", "float32", "--max-model-len", "2048",
                         # A loaded 2-core machine runs these 1,500 steps at ~10 a second: leave the drain
                         # ample time (the test waits only as long as the work takes).
                         "--num-gpu-blocks-override", "1200", "--drain-timeout", "600"]).start()
    try:
        srv.wait_ready()
        n, max_tokens = 8, 1500
        first_chunk = [threading.Event() for _ in range(n)]
        results: list[tuple[int, int | None, bool]] = [(-1, None, False)] * n

        def stream(i: int) -> None:
            tokens, done, usage = 0, False, None
            with httpx.Client(timeout=300) as client:
                body = {"prompt": [20 + i] * 10, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                with client.stream("POST", f"{srv.base_url}/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            obj = json.loads(line[6:])
                            if obj.get("usage"):
                                usage = obj["usage"]["completion_tokens"]
                            tokens += sum(1 for _ in obj["choices"])
                            first_chunk[i].set()
            results[i] = (tokens, usage, done)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for ev in first_chunk:
            assert ev.wait(120)
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{srv.url}/ready").status_code == 503, 10, what="/ready 503 while draining")
        assert httpx.get(f"{srv.url}/health").status_code == 200  # alive, finishing its work
        refused = httpx.post(f"{srv.base_url}/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        for t in threads:
            t.join(600)
        assert all(r[2] for r in results), results  # every stream ended with [DONE]
        assert all(r[1] == max_tokens for r in results), results  # ... having generated everything
        assert srv.wait_exit(60) == 0, srv.log_tail()
        assert "drained" in srv.log_tail()
    finally:
        srv.stop()


def test_second_sigterm_stops_at_once_and_answers_every_request(tiny_folder):
    """A second SIGTERM during a drain stops at once: requests in flight are aborted with their
    error responses (503 in OpenAI's shape, or an error event then [DONE] on a stream), not
    cancelled by uvicorn's shutdown into a plain-text 500 and a logged traceback."""
    srv = ServerProcess([str(tiny_folder), "--dtype", "float32", "--max-model-len", "2048",
                         "--num-gpu-blocks-override", "400", "--drain-timeout", "600"]).start()
    try:
        srv.wait_ready()
        body = {"prompt": [7] * 10, "max_tokens": 1500, "ignore_eos": True}
        answers: dict[str, tuple[int, str]] = {}
        streamed = threading.Event()

        def whole(name: str) -> None:
            r = httpx.post(f"{srv.base_url}/completions", json=body, timeout=600)
            answers[name] = (r.status_code, r.text)

        def stream() -> None:
            lines = []
            with httpx.stream("POST", f"{srv.base_url}/completions", json={**body, "stream": True}, timeout=600) as r:
                for line in r.iter_lines():
                    streamed.set()
                    if line:
                        lines.append(line)
            answers["stream"] = (r.status_code, "\n".join(lines))

        threads = [threading.Thread(target=whole, args=(f"whole{i}",)) for i in range(2)]
        threads.append(threading.Thread(target=stream))
        for t in threads:
            t.start()
        assert streamed.wait(120)
        wait_for(lambda: httpx.get(f"{srv.url}/load").json()["server_load"] == 3, 60, what="3 requests in flight")
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{srv.url}/ready").status_code == 503, 10, what="/ready 503 while draining")
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert srv.wait_exit(60) == 0, srv.log_tail()
        for name in ("whole0", "whole1"):
            status, text = answers[name]
            assert status == 503 and json.loads(text)["error"]["code"] == "aborted", (name, status, text)
        status, text = answers["stream"]
        assert status == 200 and '"error"' in text and text.endswith("data: [DONE]"), text[-500:]
        log = srv.log_tail()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert "aborting 3 request(s)" in log
    finally:
        srv.stop()
