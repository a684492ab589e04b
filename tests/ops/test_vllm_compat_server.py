"""vLLM compatibility of the server's operational surface: `--metrics-prefix vllm` gives vLLM's metric
names and labels exactly (checked against vLLM's own list), /ping answers as /health, and the CORS
flags (`--allowed-origins` and friends) shape the preflight and the response headers. Units on
`ServerMetrics`, then one real `pagoda serve` process on a tiny random model."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.contracts.messages import EngineCoreOutputs, EngineCoreStats
from pagoda.ops.metrics import ServerMetrics
from pagoda.ops.request_events import RequestTracker
from tests.ops.test_ops_units import EXPECTED_NAMES, _delta
from tests.serve.serve_helpers import ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

# Every metric family vLLM's V1 engine exports (vllm/v1/metrics/loggers.py, PrometheusStatLogger and
# SpecDecodingProm, v0.11), by family name (counters without their `_total` suffix). A name of ours
# that is not here is one a vLLM dashboard would not know.
VLLM_METRIC_NAMES = frozenset({
    # gauges
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:engine_sleep_state", "vllm:lora_requests_info", "vllm:cache_config_info",
    # counters
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits", "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
    "vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:request_success", "vllm:corrupted_requests",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    # histograms
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_prefill_kv_computed_tokens",
})
# vLLM's labels: every series has these; request_success adds finished_reason, the per-position
# acceptance counter adds position.
VLLM_LABELS = {"model_name", "engine"}
VLLM_EXTRA_LABELS = {"vllm:request_success": {"finished_reason"},
                     "vllm:spec_decode_num_accepted_tokens_per_pos": {"position"}}


# Series vLLM has no counterpart of: they keep pagoda: under either prefix.
PAGODA_ONLY = frozenset({
    "pagoda:kv_offload_queries", "pagoda:kv_offload_hits", "pagoda:kv_offload_bytes_saved",
    "pagoda:kv_offload_bytes_loaded", "pagoda:num_swaps_out", "pagoda:num_swaps_in", "pagoda:tenant_requests",
    "pagoda:tenant_prompt_tokens", "pagoda:tenant_generation_tokens", "pagoda:weight_version_info",
    "pagoda:request_success_by_weight_version",
})


def _check_vllm_names(text: str) -> set[str]:
    """The vllm: families in a /metrics body, after checking each name and label set against vLLM's
    (and that every other family is one of Pagoda's own)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created"):
            continue  # prometheus_client's creation timestamp of a counter or histogram, vLLM's too
        if not fam.name.startswith("vllm:"):
            assert fam.name in PAGODA_ONLY, f"{fam.name} is neither vLLM's nor one of Pagoda's own"
            continue
        assert fam.name in VLLM_METRIC_NAMES, f"{fam.name} is not one of vLLM's metrics"
        names.add(fam.name)
        for s in fam.samples:
            labels = set(s.labels) - {"le"}
            assert labels == VLLM_LABELS | VLLM_EXTRA_LABELS.get(fam.name, set()), (s.name, s.labels)
            assert s.labels["engine"] == "0"
    return names


def test_vllm_prefix_gives_vllms_names_and_labels_exactly():
    stats = EngineCoreStats(num_running=1, num_waiting=2, kv_usage=0.25, prefix_cache_queries=10,
                            prefix_cache_hits=5, spec_num_accepted_tokens_per_pos=[3, 1])
    m = ServerMetrics("tiny", 512, lambda: stats, prefix="vllm")
    tracker = RequestTracker([m])
    tracker.on_output(EngineCoreOutputs(iteration_tokens=[4]), [_delta("r0", [1])])
    tracker.on_output(EngineCoreOutputs(iteration_tokens=[1]), [_delta("r0", [2, 3], finished=True, reason="stop")])
    names = _check_vllm_names(m.render().decode())
    # Everything pagoda measures is there, under vLLM's name: the same names as under pagoda:.
    assert names == {n.replace("pagoda:", "vllm:") for n in EXPECTED_NAMES} | {
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:request_time_per_output_token_seconds",
        "vllm:request_inference_time_seconds", "vllm:request_params_max_tokens", "vllm:request_params_n",
        "vllm:request_max_num_generation_tokens", "vllm:time_per_output_token_seconds",
    }
    # What vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana) reads.
    assert {"vllm:e2e_request_latency_seconds", "vllm:generation_tokens", "vllm:prompt_tokens",
            "vllm:time_per_output_token_seconds", "vllm:time_to_first_token_seconds", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
            "vllm:request_success", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"} <= names
    text = m.render().decode()
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0' in text
    assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:request_max_num_generation_tokens_sum{engine="0",model_name="tiny"} 3.0' in text
    assert 'vllm:request_params_n_sum{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:time_per_output_token_seconds_count{engine="0",model_name="tiny"} 1.0' in text


def test_default_prefix_is_pagoda_with_the_engine_label_and_others_are_refused():
    m = ServerMetrics("tiny", 512, lambda: None)
    fams = list(text_string_to_metric_families(m.render().decode()))
    assert fams and all(f.name.startswith("pagoda:") for f in fams)
    assert all(s.labels.get("engine") == "0" for f in fams for s in f.samples)
    with pytest.raises(ValueError, match="metrics prefix must be one of pagoda, vllm"):
        ServerMetrics("tiny", 512, lambda: None, prefix="sglang")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_vllm_compat")
    save_tiny_model("llama3", folder)
    save_tiny_tokenizer(folder)
    srv = ServerProcess([
        str(folder), "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "32",
        "--metrics-prefix", "vllm", "--api-key", "sk-test",
        "--allowed-origins", '["http://app.example"]', "--allowed-methods", "GET", "POST",
        "--allowed-headers", "Authorization", "Content-Type", "--allow-credentials",
    ]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_server_metrics_are_vllms_after_requests(server):
    auth = {"Authorization": "Bearer sk-test"}
    r = httpx.post(f"{server.base_url}/completions", headers=auth, timeout=60,
                   json={"prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    text = httpx.get(f"{server.url}/metrics").text
    names = _check_vllm_names(text)
    assert {"vllm:prompt_tokens", "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc"} <= names


def test_ping_answers_as_health_without_a_key(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200 and r.json() == {"status": "ready"}, (method, r.text)


def test_cors_preflight_and_headers_follow_the_flags(server):
    pre = httpx.options(f"{server.base_url}/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization, Content-Type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert set(pre.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    # An origin not listed gets no grant, and a method not allowed fails its preflight.
    other = httpx.options(f"{server.base_url}/models", headers={"Origin": "http://evil.example",
                                                                "Access-Control-Request-Method": "GET"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    put = httpx.options(f"{server.base_url}/models", headers={"Origin": "http://app.example",
                                                              "Access-Control-Request-Method": "PUT"})
    assert put.status_code == 400
    # A real request, and a 401 too, carry the grant, so a browser can read the error.
    ok = httpx.get(f"{server.base_url}/models", headers={"Origin": "http://app.example",
                                                         "Authorization": "Bearer sk-test"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    denied = httpx.get(f"{server.base_url}/models", headers={"Origin": "http://app.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://app.example"
