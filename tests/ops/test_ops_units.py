"""The ops layer's parts without a server: metrics from request events, the status line, log
formats, and tracing spans (in memory and over OTLP/HTTP to a local receiver)."""

from __future__ import annotations

import http.server
import io
import json
import logging
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.contracts.messages import EngineCoreOutputs, EngineCoreStats
from pagoda.ops.logs import JsonFormatter, RequestIdFilter, TextFormatter
from pagoda.ops.metrics import ServerMetrics, one_two_five_buckets
from pagoda.ops.request_events import FinishedRequest, RequestLogger, RequestTracker
from pagoda.ops.status import StatusLine
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.serve.request_context import request_id_var

EXPECTED_NAMES = [
    "pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
    "pagoda:prefix_cache_queries", "pagoda:prefix_cache_hits", "pagoda:num_preemptions",
    "pagoda:prompt_tokens", "pagoda:generation_tokens", "pagoda:request_success",
    "pagoda:time_to_first_token_seconds", "pagoda:inter_token_latency_seconds",
    "pagoda:e2e_request_latency_seconds", "pagoda:request_queue_time_seconds",
    "pagoda:request_prefill_time_seconds", "pagoda:request_decode_time_seconds",
    "pagoda:request_prompt_tokens", "pagoda:request_generation_tokens", "pagoda:iteration_tokens_total",
]


def _delta(rid, tokens, finished=False, reason=None, prompt_len=5, t0=1000.0):
    metrics = {"arrival_time": t0, "queued_time": t0 + 0.01, "scheduled_time": t0 + 0.02, "max_tokens": 16}
    out = CompletionOutput(0, "", list(tokens), finish_reason=reason)
    return RequestOutput(rid, None, list(range(prompt_len)), [out], finished, metrics=metrics)


def families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def sample(fams: dict, name: str, suffix: str = "", **labels) -> float:
    fam = fams[name]
    total = 0.0
    for s in fam.samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_counts_equal_requests_exactly_and_all_names_present():
    stats = EngineCoreStats(num_running=2, num_waiting=1, kv_usage=0.5, prefix_cache_queries=100,
                            prefix_cache_hits=40, num_preemptions=3)
    m = ServerMetrics("tiny", 512, lambda: stats)
    tracker = RequestTracker([m])
    n, gen = 7, [3, 1, 4, 1, 5, 9, 2]
    for i in range(n):
        rid = f"r{i}"
        for k in range(gen[i]):
            last = k == gen[i] - 1
            res = _delta(rid, [k], finished=last, reason="length" if i % 2 else "stop", prompt_len=10 + i)
            tracker.on_output(EngineCoreOutputs(iteration_tokens=[4, 1]), [res])
    tracker.on_abort("gone")
    fams = families(m)
    for name in EXPECTED_NAMES:
        assert name in fams, name
    for hist in ("pagoda:time_to_first_token_seconds", "pagoda:e2e_request_latency_seconds",
                 "pagoda:request_queue_time_seconds", "pagoda:request_prefill_time_seconds",
                 "pagoda:request_decode_time_seconds", "pagoda:request_prompt_tokens",
                 "pagoda:request_generation_tokens"):
        assert sample(fams, hist, "_count", model_name="tiny") == n, hist
    assert sample(fams, "pagoda:inter_token_latency_seconds", "_count") == sum(gen) - n
    assert sample(fams, "pagoda:prompt_tokens", "_total") == sum(10 + i for i in range(n))
    assert sample(fams, "pagoda:generation_tokens", "_total") == sum(gen)
    assert sample(fams, "pagoda:request_generation_tokens", "_sum") == sum(gen)
    assert sample(fams, "pagoda:request_success", "_total", finished_reason="stop") == 4
    assert sample(fams, "pagoda:request_success", "_total", finished_reason="length") == 3
    assert sample(fams, "pagoda:request_success", "_total", finished_reason="abort") == 1
    assert sample(fams, "pagoda:iteration_tokens_total", "_count") == 2 * sum(gen)
    assert sample(fams, "pagoda:num_requests_running") == 2
    assert sample(fams, "pagoda:kv_cache_usage_perc") == 0.5
    assert sample(fams, "pagoda:prefix_cache_hits", "_total") == 40
    assert sample(fams, "pagoda:num_preemptions", "_total") == 3
    # Queue time comes from the core's times: scheduled - queued.
    assert sample(fams, "pagoda:request_queue_time_seconds", "_sum") == pytest.approx(n * 0.01)
    assert not tracker._live  # nothing kept once requests end


def test_buckets():
    assert one_two_five_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_status_line_quiet_when_idle():
    stats = EngineCoreStats()
    m = ServerMetrics("tiny", 512, lambda: stats)
    line = StatusLine(m, lambda: stats)
    assert line.tick(now=line._last_time + 10) is None  # nothing happened
    m.on_first_token(0.1, 200)
    m.on_tokens(50, None)
    stats = EngineCoreStats(num_running=3, num_waiting=2, kv_usage=0.25, prefix_cache_queries=200,
                            prefix_cache_hits=50)
    text = line.tick(now=line._last_time + 10)
    assert text == ("prompt throughput: 20.0 tokens/s, generation throughput: 5.0 tokens/s, running: 3 reqs, "
                    "waiting: 2 reqs, KV cache usage: 25.0%, prefix cache hit rate: 25.0%")
    stats = EngineCoreStats(num_running=1, prefix_cache_queries=200, prefix_cache_hits=50)
    assert "running: 1 reqs" in line.tick(now=line._last_time + 10)  # still running: keeps reporting
    stats = EngineCoreStats(prefix_cache_queries=200, prefix_cache_hits=50)
    assert line.tick(now=line._last_time + 10) is None


def test_spec_decode_counters_and_acceptance_rate_in_the_status_line():
    stats = EngineCoreStats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=10,
                            spec_num_accepted_tokens_per_pos=[6, 3, 1, 0])
    m = ServerMetrics("tiny", 512, lambda: stats)
    fams = families(m)
    assert sample(fams, "pagoda:spec_decode_num_drafts", "_total") == 10
    assert sample(fams, "pagoda:spec_decode_num_draft_tokens", "_total") == 40
    assert sample(fams, "pagoda:spec_decode_num_accepted_tokens", "_total") == 10
    per_pos = "pagoda:spec_decode_num_accepted_tokens_per_pos"
    assert [sample(fams, per_pos, "_total", position=str(i)) for i in range(4)] == [6, 3, 1, 0]
    line = StatusLine(m, lambda: stats)
    m.on_tokens(50, None)
    # 40 more drafted, 30 more accepted in the interval: the line reports the interval's rate.
    stats = EngineCoreStats(num_running=1, spec_num_drafts=20, spec_num_draft_tokens=80, spec_num_accepted_tokens=40)
    assert line.tick(now=line._last_time + 10).endswith(", draft acceptance rate: 75.0%")
    stats = EngineCoreStats(num_running=1, spec_num_drafts=20, spec_num_draft_tokens=80, spec_num_accepted_tokens=40)
    assert "acceptance" not in line.tick(now=line._last_time + 10)  # nothing drafted since


def test_kv_offload_counters():
    stats = EngineCoreStats(kv_offload_queries=300, kv_offload_hits=96, kv_offload_bytes_saved=4096,
                            kv_offload_bytes_loaded=2048, num_swaps_out=3, num_swaps_in=2, num_preemptions=5)
    fams = families(ServerMetrics("tiny", 512, lambda: stats))
    got = {name: sample(fams, f"pagoda:{name}", "_total") for name in (
        "kv_offload_queries", "kv_offload_hits", "kv_offload_bytes_saved", "kv_offload_bytes_loaded",
        "num_swaps_out", "num_swaps_in")}
    assert got == {"kv_offload_queries": 300, "kv_offload_hits": 96, "kv_offload_bytes_saved": 4096,
                   "kv_offload_bytes_loaded": 2048, "num_swaps_out": 3, "num_swaps_in": 2}


def _logger_to(buf: io.StringIO, formatter: logging.Formatter) -> logging.Logger:
    lg = logging.getLogger(f"pagoda.test.{id(buf)}")
    lg.handlers.clear()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    lg.addHandler(handler)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    return lg


def test_json_lines_carry_request_ids():
    buf = io.StringIO()
    lg = _logger_to(buf, JsonFormatter("api"))
    lg.info("plain line")
    lg.info("about a request\nwith a newline", extra={"request_id": "cmpl-1", "tokens": 3})
    token = request_id_var.set("cmpl-2")
    try:
        lg.warning("inside a handler")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            lg.exception("failed")
    finally:
        request_id_var.reset(token)
    lines = buf.getvalue().splitlines()
    objs = [json.loads(line) for line in lines]  # every line is one JSON object
    assert len(objs) == 4
    assert "request_id" not in objs[0]
    assert objs[1]["request_id"] == "cmpl-1" and objs[1]["tokens"] == 3
    assert objs[1]["message"] == "about a request\nwith a newline"
    assert objs[2]["request_id"] == "cmpl-2" and objs[2]["level"] == "WARNING" and objs[2]["process"] == "api"
    assert objs[3]["request_id"] == "cmpl-2" and "RuntimeError: boom" in objs[3]["exception"]


def test_text_lines_carry_request_ids_and_request_logger():
    buf = io.StringIO()
    _logger_to(buf, TextFormatter("api"))
    req_logger = logging.getLogger("pagoda.requests")
    old = (req_logger.handlers[:], req_logger.level, req_logger.propagate)
    req_logger.handlers = _logger_to(buf, TextFormatter("api")).handlers
    req_logger.setLevel(logging.INFO)
    req_logger.propagate = False
    try:
        r = FinishedRequest("cmpl-9", "length", 1.0, 3.5, 12, 8, 0, 8, 1.0, 1.1, 1.5, 3.4)
        RequestLogger(enabled=True).on_finished(r)
        RequestLogger(enabled=False).on_finished(r)  # DEBUG: filtered at INFO
    finally:
        req_logger.handlers, req_logger.level, req_logger.propagate = old
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    assert "[request_id=cmpl-9] finished: reason=length prompt_tokens=12" in lines[0]
    assert "ttft=0.500s e2e=2.500s" in lines[0]


def _finished() -> FinishedRequest:
    return FinishedRequest("cmpl-t", "stop", 100.0, 104.0, 20, 10, 16, 32, 100.5, 101.0, 102.0, 103.9)


def test_tracing_spans_per_phase():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagoda.ops.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    tracer = RequestTracer("tiny", exporter=exporter)
    tracer.on_finished(_finished())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    root = spans["llm_request"]
    assert root.attributes["gen_ai.request.id"] == "cmpl-t"
    assert root.attributes["gen_ai.usage.completion_tokens"] == 10
    assert (root.start_time, root.end_time) == (100 * 10**9, 104 * 10**9)
    for name, (start, end) in {"queue": (100.5, 101.0), "prefill": (101.0, 102.0), "decode": (102.0, 103.9)}.items():
        span = spans[name]
        assert span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id
        assert (span.start_time, span.end_time) == (int(start * 1e9), int(end * 1e9))


def test_tracing_exports_over_otlp_http():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from pagoda.ops.tracing import RequestTracer

    received: list[bytes] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tracer = RequestTracer("tiny", endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces")
        tracer.on_finished(_finished())
        tracer.shutdown()  # flushes the batch
    finally:
        server.shutdown()
    names = []
    for body in received:
        req = ExportTraceServiceRequest.FromString(body)
        names += [s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(names) == ["decode", "llm_request", "prefill", "queue"]


def test_n_gt_1_latencies_are_per_sequence(monkeypatch):
    """n = 2, each sequence gets one token a second for 3 s: 1 s per output token and between tokens,
    whatever the number of sequences (not decode time / all sequences' tokens)."""
    import pagoda.ops.request_events as request_events

    m = ServerMetrics("tiny", 512, lambda: None)
    tracker = RequestTracker([m])
    meta = {"arrival_time": 100.0, "queued_time": 100.0, "scheduled_time": 100.0, "max_tokens": 3}
    for step in range(3):
        last = step == 2
        outs = [CompletionOutput(i, "", [7], finish_reason="length" if last else None) for i in range(2)]
        monkeypatch.setattr(request_events.time, "time", lambda t=101.0 + step: t)
        tracker.on_output(EngineCoreOutputs(), [RequestOutput("p", None, [1, 2], outs, last, metrics=meta)])
    # The second sequence starts a step late (it waited for the first one's prompt).
    for step, outs in enumerate([[CompletionOutput(0, "", [7]), CompletionOutput(1, "", [])],
                                 [CompletionOutput(0, "", [7]), CompletionOutput(1, "", [7])],
                                 [CompletionOutput(0, "", [7], finish_reason="length"), CompletionOutput(1, "", [7])],
                                 [CompletionOutput(0, "", []), CompletionOutput(1, "", [7], finish_reason="length")]]):
        monkeypatch.setattr(request_events.time, "time", lambda t=201.0 + step: t)
        tracker.on_output(EngineCoreOutputs(), [RequestOutput("q", None, [1, 2], outs, step == 3,
                                                              metrics={**meta, "arrival_time": 200.0})])
    fams = families(m)
    assert sample(fams, "pagoda:request_time_per_output_token_seconds", "_count") == 2
    assert sample(fams, "pagoda:request_time_per_output_token_seconds", "_sum") == pytest.approx(2.0)
    assert sample(fams, "pagoda:inter_token_latency_seconds", "_count") == 8  # 2 requests x 2 sequences x 2
    assert sample(fams, "pagoda:inter_token_latency_seconds", "_sum") == pytest.approx(8.0)
    assert sample(fams, "pagoda:generation_tokens", "_total") == 12
    assert sample(fams, "pagoda:request_generation_tokens", "_sum") == 12


def test_every_finish_reason_series_exists_from_the_start():
    """rate()/increase() miss a counter's first increment when that creates the series."""
    fams = families(ServerMetrics("tiny", 512, lambda: None))
    reasons = {s.labels["finished_reason"]: s.value for s in fams["pagoda:request_success"].samples
               if s.name == "pagoda:request_success_total"}
    assert reasons == {"stop": 0.0, "length": 0.0, "abort": 0.0}


class _TimelineEngine:
    """The engine as the timeline endpoint sees it, answering from a real TimelineStore."""

    def __init__(self, ids: list[str]) -> None:
        from pagoda.engine.timeline import TimelineStore

        self.store = TimelineStore()
        for i, rid in enumerate(ids):
            self.store.start(rid, float(i))
            self.store.end(rid, float(i) + 1, "length", 1)
        self.is_dead, self.ready = False, True
        self.args = type("Args", (), {"max_model_len": 64})()
        self.latest_stats = None
        self.output_listeners, self.abort_listeners = [], []

    async def call_utility(self, method: str, *args):
        assert method == "timeline"
        return self.store.lookup(*args)


def test_timeline_lists_only_the_requests_own_sequences():
    """A request's parts are `id-P`, `id#S` and `id-P#S` exactly: `cmpl` must not list every `cmpl-...` request."""
    from fastapi.testclient import TestClient

    from pagoda.ops.server_ops import install_ops
    from pagoda.serve.app import ServerConfig, ServerState, build_app

    batch = [f"cmpl-b-{i}" for i in range(12)]  # a completion with 12 prompts
    engine = _TimelineEngine(["cmpl-a", "cmpl-a2", "cmpl-n#1", "cmpl-n#0", "cmpl-nx", *batch, "chatcmpl-c"])
    state = ServerState(ServerConfig(served_model_names=["m"]), engine)
    app = build_app(state)
    install_ops(app, state)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: the engine is not started

    def ids(rid: str) -> list[str] | int:
        r = client.get(f"/v1/requests/{rid}/timeline")
        return [s["request_id"] for s in r.json()["sequences"]] if r.status_code == 200 else r.status_code

    assert ids("cmpl-a") == ["cmpl-a"]
    assert ids("cmpl-n") == ["cmpl-n#0", "cmpl-n#1"]
    assert ids("cmpl-b") == batch  # in prompt order: -2 before -10
    assert ids("cmpl") == 404
    assert ids("chatcmpl") == 404
    assert ids("cmpl-") == 404


@pytest.mark.parametrize("endpoint", ["collector:4318/v1/traces", "not-a-url", "ftp://collector/v1/traces", "http://"])
def test_tracing_refuses_an_endpoint_that_is_not_an_http_url(endpoint):
    """The exporter would accept it and fail at every export: the server would run, losing every trace."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from pagoda.ops.tracing import RequestTracer

    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        RequestTracer("tiny", endpoint=endpoint)


def test_per_replica_core_metrics_carry_the_engine_label():
    from pagoda.contracts.messages import EngineCoreStats
    from pagoda.ops.metrics import ServerMetrics

    stats = {"0": EngineCoreStats(num_running=2, prefix_cache_hits=16, spec_num_accepted_tokens_per_pos=[1]),
             "1": EngineCoreStats(num_running=5, prefix_cache_hits=32)}
    text = ServerMetrics("m", 512, lambda: None, lambda: stats).render().decode()
    assert 'pagoda:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'pagoda:num_requests_running{engine="1",model_name="m"} 5.0' in text
    assert 'pagoda:prefix_cache_hits_total{engine="1",model_name="m"} 32.0' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 1.0' in text
    assert text.count("# TYPE pagoda:num_requests_running gauge") == 1  # one family, a series per replica
    single = ServerMetrics("m", 512, lambda: EngineCoreStats(num_running=3)).render().decode()
    # One engine core: vLLM's engine label with its index, 0.
    assert 'pagoda:num_requests_running{engine="0",model_name="m"} 3.0' in single
