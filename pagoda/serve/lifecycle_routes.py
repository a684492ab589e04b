"""The admin endpoints of the served weights, behind the API key when keys are set: POST
/update_weights (a hot update from a checkpoint, SGLang's endpoint with vLLM-style modes), POST
/sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's sleep mode).

Refusals: a checkpoint that does not load or does not fit, or a bad argument, is a 400 naming the
problem (the served weights are unchanged); an update while another one runs, or while the engine
sleeps, is a 409. While the engine sleeps every engine-backed request gets 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from pagoda.serve.errors import APIError, bad_request, unavailable
from pagoda.serve.state import ServerState, get_state

logger = logging.getLogger(__name__)
router = APIRouter()

SLEEP_DRAIN_TIMEOUT_S = 30.0  # how long POST /sleep waits for requests in flight to finish


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    version: str | None = Field(default=None, min_length=1)
    weight_version: str | None = Field(default=None, min_length=1)  # SGLang's name for `version`
    mode: str = "drain"


def _refused(result: dict, param: str | None = None) -> APIError:
    if result.get("kind") == "conflict":
        return APIError(409, result["error"], type="invalid_request_error", code="conflict")
    return bad_request(result["error"], param=param)


def _check_running(state: ServerState) -> None:
    if state.status != "ready":
        state.check_accepting()  # 503: starting, draining or dead


async def _call(state: ServerState, coro) -> dict:
    try:
        return await coro
    except Exception as exc:  # the core died or did not answer
        raise unavailable(f"cannot reach the engine core: {exc}") from None


@router.post("/update_weights")
@router.post("/update_weights_from_disk")  # SGLang's path
async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict:
    state = get_state(request)
    _check_running(state)
    version = body.version or body.weight_version
    result = await _call(state, state.engine.update_weights(body.model_path, version, body.mode))
    if "error" in result:
        logger.warning("weight update refused: %s", result["error"])
        raise _refused(result, "mode" if result["error"].startswith("mode ") else "model_path")
    return {"success": True, **result}


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)) -> dict:
    state = get_state(request)
    _check_running(state)
    if level not in (1, 2):
        raise bad_request(f"level must be 1 or 2, got {level}", param="level")
    engine = state.engine
    was_sleeping = state.sleeping
    state.sleeping = True  # from now on new requests get 503; those in flight finish first
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SLEEP_DRAIN_TIMEOUT_S
    while engine.num_inflight_requests() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if engine.num_inflight_requests():
        state.sleeping = was_sleeping
        raise APIError(409, f"{engine.num_inflight_requests()} request(s) still in flight after "
                       f"{SLEEP_DRAIN_TIMEOUT_S:g} s; not sleeping", type="invalid_request_error", code="conflict")
    result = await _call(state, engine.sleep(level))
    if "error" in result:
        state.sleeping = was_sleeping
        raise _refused(result)
    return {"is_sleeping": True, **result}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    state = get_state(request)
    _check_running(state)
    result = await _call(state, state.engine.wake_up())
    state.sleeping = False
    return {"is_sleeping": False, **result}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": get_state(request).sleeping}
