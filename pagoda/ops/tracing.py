"""Optional OpenTelemetry tracing: one span per finished request with child spans for its queue,
prefill and decode phases, exported over OTLP/HTTP to `--otlp-traces-endpoint`.

Off by default: without an endpoint nothing here is imported and no sink is registered, so tracing
costs nothing. Spans are built when a request finishes, from the times the request tracker
recorded, so nothing is done per token.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pagoda.ops.request_events import FinishedRequest, RequestSink

_INSTALL_HINT = "pip install 'pagoda[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


def _ns(t: float) -> int:
    return int(t * 1e9)


class RequestTracer(RequestSink):
    def __init__(self, model_name: str, endpoint: str | None = None, exporter: Any = None) -> None:
        """Export to `endpoint` (an OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces),
        or to `exporter` (any OpenTelemetry SpanExporter; spans then go out one by one)."""
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: {_INSTALL_HINT}") from None
        self.model_name = model_name
        self._trace = trace
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pagoda"}))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            if not endpoint:
                raise ValueError("an OTLP endpoint or an exporter is needed")
            url = urlsplit(endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                # The exporter would take it and fail on every export: traces lost while all looks well.
                raise ValueError(
                    f"--otlp-traces-endpoint must be an http:// or https:// URL "
                    f"(e.g. http://collector:4318/v1/traces), not {endpoint!r}"
                )
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise ValueError(f"--otlp-traces-endpoint needs the OTLP exporter: {_INSTALL_HINT}") from None
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("pagoda")

    def on_finished(self, r: FinishedRequest) -> None:
        attrs = {
            "gen_ai.request.id": r.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.finish_reasons": [r.finish_reason],
            "gen_ai.usage.prompt_tokens": r.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": r.num_generation_tokens,
            "pagoda.cached_tokens": r.num_cached_tokens,
        }
        if r.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = r.max_tokens
        if r.ttft is not None:
            attrs["gen_ai.latency.time_to_first_token"] = r.ttft
        root = self.tracer.start_span("llm_request", start_time=_ns(r.arrival_time), attributes=attrs)
        ctx = self._trace.set_span_in_context(root)
        phases = (
            ("queue", r.queued_time, r.scheduled_time),
            ("prefill", r.scheduled_time, r.first_token_time),
            ("decode", r.first_token_time, r.last_token_time),
        )
        for name, start, end in phases:
            if start is not None and end is not None:
                span = self.tracer.start_span(name, context=ctx, start_time=_ns(start))
                span.end(end_time=_ns(max(start, end)))
        root.end(end_time=_ns(r.finished_time))

    def shutdown(self) -> None:
        """Flush what is buffered (called when the server stops)."""
        self.provider.shutdown()
