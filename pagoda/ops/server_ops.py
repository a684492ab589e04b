"""Puts the ops layer onto a server built by `pagoda.serve.app.build_app`: /metrics, /ready, /load,
request timelines, the request tracker with its sinks (metrics, per-tenant usage, the recent
requests, request log, tracer), the periodic status line and the dashboard (`pagoda.ops.dashboard`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.ops.dashboard.routes import Dashboard, public_paths
from pagoda.ops.dashboard.routes import router as dashboard_router
from pagoda.ops.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.ops.recent_requests import RecentRequests
from pagoda.ops.request_events import RequestLogger, RequestTracker
from pagoda.ops.status import StatusLine, log_status_forever
from pagoda.ops.tenant_usage import TenantUsage
from pagoda.serve.state import ServerState, get_state
from pagoda.serve.errors import APIError, unavailable

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 8192  # only sets the token-count histogram buckets when unknown


@dataclass
class OpsConfig:
    log_requests: bool = False  # one INFO line per finished request (else DEBUG)
    log_stats_interval: float = 10.0  # seconds between status lines; 0 turns them off
    otlp_traces_endpoint: str | None = None
    metrics_prefix: str = "pagoda"  # or "vllm": vLLM's metric names, for its dashboards and alerts


class Ops:
    """The ops layer of one server: its metrics and the tasks and sinks that feed them."""

    def __init__(self, state: ServerState, config: OpsConfig) -> None:
        self.state = state
        self.config = config
        engine = state.engine
        max_len = engine.args.max_model_len or _DEFAULT_MAX_MODEL_LEN
        self.metrics = ServerMetrics(state.config.model_name, max_len, lambda: engine.latest_stats,
                                     getattr(engine, "stats_by_replica", None), prefix=config.metrics_prefix,
                                     weight_version=lambda: getattr(engine, "weight_version", ""))
        self.tenant_usage = TenantUsage(self.metrics.registry, state.config.model_name)
        self.recent = RecentRequests()
        for sink in (self.tenant_usage, self.recent):
            state.on_request_started.append(sink.on_request_started)
        sinks: list = [self.metrics, self.tenant_usage, self.recent, RequestLogger(config.log_requests)]
        self.tracer = None
        if config.otlp_traces_endpoint:
            from pagoda.ops.tracing import RequestTracer

            self.tracer = RequestTracer(state.config.model_name, endpoint=config.otlp_traces_endpoint)
            sinks.append(self.tracer)
        self.tracker = RequestTracker(sinks)
        self.tracker.attach(engine)
        self.dashboard = Dashboard(state, self.metrics.registry, self.recent)
        self._status_task: asyncio.Task | None = None
        state.on_ready.append(self._on_ready)
        state.on_shutdown.append(self._on_shutdown)

    def _on_ready(self) -> None:
        self.dashboard.start()
        if self.config.log_stats_interval > 0:
            line = StatusLine(self.metrics, lambda: self.state.engine.latest_stats)
            self._status_task = asyncio.get_running_loop().create_task(
                log_status_forever(line, self.config.log_stats_interval), name="pagoda-status-line"
            )

    def _on_shutdown(self) -> None:
        self.dashboard.stop()
        if self._status_task is not None:
            self._status_task.cancel()
        if self.tracer is not None:
            self.tracer.shutdown()


router = APIRouter()


def _ops(request: Request) -> Ops:
    return request.app.state.ops


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_ops(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once the model is loaded and the server accepts work; 503 while starting, draining or dead."""
    state = get_state(request)
    replicas = getattr(state.engine, "replica_status", None)
    if replicas is not None:  # data-parallel: which replicas serve
        listed = replicas()
        up = sum(1 for r in listed if r["status"] == "up")
        if state.status == "ready" and up:
            return JSONResponse({"status": "ready", "replicas_up": up, "replicas": listed})
        err = unavailable(f"not ready: {state.status}, {up} replica(s) up")
        return JSONResponse({**err.body(), "replicas": listed}, status_code=503)
    if state.status == "ready" and not state.engine.is_dead:
        return JSONResponse({"status": "ready"})
    retry = 1 if state.status == "starting" else None
    return unavailable(f"not ready: {state.status}", retry_after_s=retry).response()


@router.get("/load")
async def load(request: Request) -> dict:
    """In-flight work, for autoscalers: requests the server holds, and the engine's latest counts."""
    state = get_state(request)
    engine = state.engine
    out = {"server_load": engine.num_inflight_requests(), **_load_of(engine.latest_stats), "status": state.status}
    by_replica = getattr(engine, "stats_by_replica", None)
    if by_replica is not None:  # data-parallel: each replica's, by its `engine` label; the above is their sum
        loads = engine.replica_loads()
        stats = by_replica()
        out["replicas"] = [{**r, "server_load": loads.get(int(r["engine"]), 0), **_load_of(stats.get(r["engine"]))}
                           for r in engine.replica_status()]
    return out


def _load_of(s) -> dict:
    return {
        "num_requests_running": s.num_running if s else 0,
        "num_requests_waiting": s.num_waiting if s else 0,
        "kv_cache_usage_perc": s.kv_usage if s else 0.0,
    }


@router.get("/v1/requests/{request_id}/timeline")
async def timeline(request_id: str, request: Request) -> dict:
    """Arrival, admissions (with prefix-cache hits), prefill chunks, decode runs, preemptions and the
    finish of a live or recently finished request (one timeline per sequence when n > 1)."""
    state = get_state(request)
    engine = state.engine
    if engine.is_dead or not engine.ready:
        raise unavailable("the engine is not running")
    try:
        sequences = await engine.call_utility("timeline", request_id)
    except Exception as exc:
        raise unavailable(f"cannot reach the engine core: {exc}") from None
    if not sequences:
        raise APIError(
            404, f"no timeline for request `{request_id}` (unknown, or finished too long ago)",
            type="invalid_request_error", param="request_id", code="request_not_found",
        )
    return {"object": "request.timeline", "request_id": request_id, "sequences": sequences}


def install_ops(app: FastAPI, state: ServerState, config: OpsConfig | None = None) -> Ops:
    ops = Ops(state, config or OpsConfig())
    app.state.ops = ops
    app.state.dashboard = ops.dashboard
    app.include_router(router)
    app.include_router(dashboard_router)
    state.config.public_paths |= public_paths()
    return ops
