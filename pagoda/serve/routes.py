"""The small endpoints: /health (and /ping, its alias for SageMaker-style checks), /version, /v1/models, /tokenize, /detokenize, /v1/engine/stats and
/reset_prefix_cache. The generation endpoints are in `pagoda.serve.openai_api`."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagoda.errors import InvalidRequestError
from pagoda.serve.errors import bad_request, unavailable
from pagoda.serve.protocol import DetokenizeRequest, TokenizeRequest
from pagoda.serve.state import ServerState, get_state
from pagoda.version import __version__

router = APIRouter()


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    if state.status in ("ready", "draining") and not state.engine.is_dead:
        return JSONResponse({"status": state.status})
    if state.status == "starting":
        return unavailable("the model is still loading", retry_after_s=1).response()
    return unavailable(f"the engine is not running: {state.engine.dead_reason or 'dead'}").response()


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


def _model_card(state: ServerState, name: str) -> dict:
    engine = state.engine
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pagoda",
        "root": engine.source.name,
        "parent": None,
        "max_model_len": engine.info.max_model_len if engine.info is not None else engine.args.max_model_len,
        "weight_version": engine.weight_version or None,
        "weights_loaded_at": engine.weights_loaded_at or None,
        "state": "sleeping" if state.sleeping else "updating" if engine.updating_weights else state.status,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = get_state(request)
    return {"object": "list", "data": [_model_card(state, n) for n in state.config.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    state = get_state(request)
    return _model_card(state, state.check_model(model_id))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = get_state(request)
    state.check_model(body.model)
    state.check_accepting()
    engine = state.engine
    try:
        if body.messages is not None:
            ids = await engine.apply_chat_template_async(
                [m.to_template_dict() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs,
            )
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await engine.tokenize_async(body.prompt, add_special_tokens=add_special)
    except InvalidRequestError as exc:  # names its field: prompt, messages or chat_template_kwargs
        raise bad_request(str(exc), param=exc.field) from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = get_state(request)
    state.check_model(body.model)
    state.check_accepting()
    try:
        return {"prompt": state.engine.detokenize(body.tokens)}
    except ValueError as exc:
        raise bad_request(str(exc), param="tokens") from None


@router.get("/v1/engine/stats")
async def engine_stats(request: Request) -> dict:
    """The core's scheduler and KV-cache counters, fresh (a round trip to the core), plus the API
    process's view of in-flight work."""
    state = get_state(request)
    state.check_accepting()
    engine = state.engine
    try:
        stats = await engine.engine_stats()
    except Exception as exc:
        raise unavailable(f"cannot reach the engine core: {exc}") from None
    out = msgspec.structs.asdict(stats)
    out["num_unfinished_sequences"] = engine.num_unfinished_sequences()
    return out


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    """Drop the prefix cache (for benchmarks that must not reuse earlier prompts); refused while
    requests hold blocks."""
    state = get_state(request)
    state.check_accepting()
    try:
        done = await state.engine.reset_prefix_cache()
    except Exception as exc:
        raise unavailable(f"cannot reach the engine core: {exc}") from None
    return {"reset": done}
