"""Per-tenant load as Prometheus counters: requests sent to the engine, their prompt tokens and the
tokens generated for them, labelled with the tenant's name (its API key's name; `anonymous` when
the server has no keys).

The service layer says which tenant sent each engine request (`ServerState.on_request_started`);
the request tracker reports each request's generated tokens as they arrive, so an aborted request's
tokens count too.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from pagoda.ops.metrics import OWN_PREFIX as PREFIX
from pagoda.ops.request_events import FinishedRequest, RequestSink

TENANT_REQUESTS = PREFIX + "tenant_requests"
TENANT_PROMPT_TOKENS = PREFIX + "tenant_prompt_tokens"
TENANT_GENERATION_TOKENS = PREFIX + "tenant_generation_tokens"


class TenantUsage(RequestSink):
    """Counts each tenant's requests and tokens into `registry` (the one /metrics renders)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "tenant"]
        self.requests = Counter(TENANT_REQUESTS, "Engine requests sent, by tenant.", labels, registry=registry)
        self.prompt_tokens = Counter(TENANT_PROMPT_TOKENS, "Prompt tokens sent to the engine, by tenant.", labels,
                                     registry=registry)
        self.generation_tokens = Counter(TENANT_GENERATION_TOKENS, "Generated tokens, by tenant.", labels,
                                         registry=registry)
        # Live request id -> its tenant's generated-token counter (the labelled child, looked up
        # once a request rather than once a token).
        self._tenant_of: dict[str, Any] = {}

    def on_request_started(self, request_id: str, tenant: str, num_prompt_tokens: int) -> None:
        self._tenant_of[request_id] = self.generation_tokens.labels(self.model_name, tenant)
        self.requests.labels(self.model_name, tenant).inc()
        self.prompt_tokens.labels(self.model_name, tenant).inc(num_prompt_tokens)

    def on_request_tokens(self, request_id: str, num_tokens: int) -> None:
        counter = self._tenant_of.get(request_id)
        if counter is not None:
            counter.inc(num_tokens)

    def on_finished(self, r: FinishedRequest) -> None:
        self._tenant_of.pop(r.request_id, None)

    def on_aborted(self, request_id: str) -> None:
        self._tenant_of.pop(request_id, None)
