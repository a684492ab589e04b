"""The dashboard's routes and the state behind them.

`/dashboard` and its assets are public (a page holds no data); `/dashboard/snapshot` and
`/dashboard/requests/{id}/waterfall` are behind the API key when keys are set, and the page asks for
the key once (kept in the browser's localStorage) and sends it as a Bearer token.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from pagoda.ops.dashboard.figures import History, dashboard_registry, figures, read_samples
from pagoda.ops.dashboard.waterfall import waterfall
from pagoda.ops.recent_requests import RecentRequests
from pagoda.serve.errors import APIError, unavailable
from pagoda.serve.state import ServerState, get_state

STATIC = Path(__file__).parent / "static"
ASSET_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
NO_STORE = {"Cache-Control": "no-store"}
SAMPLE_INTERVAL_S = 1.0
RATE_WINDOW_S = 10.0  # tokens/s: over the last 10 s
WINDOW_S = 60.0  # latency percentiles, hit rate, preemptions: over the last minute
RECENT_ROWS = 30


def public_paths() -> set[str]:
    """The page and its assets: served without a key."""
    return {"/dashboard", *(f"/dashboard/static/{p.name}" for p in STATIC.iterdir() if p.suffix in ASSET_TYPES)}


class Dashboard:
    """The sampled history of the registry and the recent requests, turned into snapshots."""

    def __init__(self, state: ServerState, registry: Any, recent: RecentRequests) -> None:
        self.state = state
        self.recent = recent
        sampled = dashboard_registry(registry)
        self.history = History(lambda: read_samples(sampled), keep_s=WINDOW_S)
        self.spec_enabled = getattr(state.engine.args, "speculative_config", None) is not None
        self._task: asyncio.Task | None = None

    def snapshot(self) -> dict[str, Any]:
        out = figures(self.history, RATE_WINDOW_S, WINDOW_S, self.spec_enabled)
        rows = self.recent.rows()
        in_flight: dict[str, int] = {}
        for row in rows:
            if row["status"] in ("waiting", "running") and row["tenant"] is not None:
                in_flight[row["tenant"]] = in_flight.get(row["tenant"], 0) + 1
        for t in out["tenants"]:
            t["in_flight"] = in_flight.get(t["tenant"], 0)
        out.update(
            object="dashboard.snapshot", time=time.time(), model=self.state.config.model_name,
            status=self.state.status, recent_requests=rows[:RECENT_ROWS],
        )
        return out

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            self.history.sample()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample_forever(), name="pagoda-dashboard-history")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


router = APIRouter()


def _dashboard(request: Request) -> Dashboard:
    return request.app.state.dashboard


@router.get("/dashboard")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type=ASSET_TYPES[".html"], headers=NO_STORE)


@router.get("/dashboard/static/{name}")
async def asset(name: str) -> FileResponse:
    path = STATIC / name
    if "/" in name or path.suffix not in ASSET_TYPES or not path.is_file():
        raise APIError(404, f"no dashboard asset `{name}`", type="not_found_error", code="not_found")
    return FileResponse(path, media_type=ASSET_TYPES[path.suffix], headers=NO_STORE)


@router.get("/dashboard/snapshot")
async def snapshot(request: Request) -> JSONResponse:
    """Every figure of the page (and of `pagoda top`) at once."""
    return JSONResponse(_dashboard(request).snapshot(), headers=NO_STORE)


@router.get("/dashboard/requests/{request_id}/waterfall")
async def request_waterfall(request_id: str, request: Request) -> dict:
    """The request's timeline as waterfall segments (one list per sequence when n > 1)."""
    engine = get_state(request).engine
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
    return waterfall(request_id, sequences, time.time())
