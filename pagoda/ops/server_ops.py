"""Puts the ops layer onto a server built by `pagoda.serve.app.build_app`: /metrics, /ready, /load,
request timelines, the request tracker with its sinks (metrics, request log, tracer) and the
periodic status line."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.ops.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.ops.request_events import RequestLogger, RequestTracker
from pagoda.ops.status import StatusLine, log_status_forever
from pagoda.serve.state import ServerState, get_state
from pagoda.serve.errors import APIError, unavailable

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 8192  # only sets the token-count histogram buckets when unknown


@dataclass
class OpsConfig:
    log_requests: bool = False  # one INFO line per finished request (else DEBUG)
    log_stats_interval: float = 10.0  # seconds between status lines; 0 turns them off
    otlp_traces_endpoint: str | None = None


class Ops:
    """The ops layer of one server: its metrics and the tasks and sinks that feed them."""

    def __init__(self, state: ServerState, config: OpsConfig) -> None:
        self.state = state
        self.config = config
        engine = state.engine
        max_len = engine.args.max_model_len or _DEFAULT_MAX_MODEL_LEN
        self.metrics = ServerMetrics(state.config.model_name, max_len, lambda: engine.latest_stats,
                                     lambda: getattr(engine, "weight_version", ""))
        sinks: list = [self.metrics, RequestLogger(config.log_requests)]
        self.tracer = None
        if config.otlp_traces_endpoint:
            from pagoda.ops.tracing import RequestTracer

            self.tracer = RequestTracer(state.config.model_name, endpoint=config.otlp_traces_endpoint)
            sinks.append(self.tracer)
        self.tracker = RequestTracker(sinks)
        self.tracker.attach(engine)
        self._status_task: asyncio.Task | None = None
        state.on_ready.append(self._on_ready)
        state.on_shutdown.append(self._on_shutdown)

    def _on_ready(self) -> None:
        if self.config.log_stats_interval > 0:
            line = StatusLine(self.metrics, lambda: self.state.engine.latest_stats)
            self._status_task = asyncio.get_running_loop().create_task(
                log_status_forever(line, self.config.log_stats_interval), name="pagoda-status-line"
            )

    def _on_shutdown(self) -> None:
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
    if state.status == "ready" and not state.engine.is_dead:
        return JSONResponse({"status": "ready"})
    retry = 1 if state.status == "starting" else None
    return unavailable(f"not ready: {state.status}", retry_after_s=retry).response()


@router.get("/load")
async def load(request: Request) -> dict:
    """In-flight work, for autoscalers: requests the server holds, and the engine's latest counts."""
    state = get_state(request)
    engine = state.engine
    s = engine.latest_stats
    return {
        "server_load": engine.num_inflight_requests(),
        "num_requests_running": s.num_running if s else 0,
        "num_requests_waiting": s.num_waiting if s else 0,
        "kv_cache_usage_perc": s.kv_usage if s else 0.0,
        "status": state.status,
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
    app.include_router(router)
    return ops
