"""The HTTP front of a model pool (`pagoda.serve.model_pool`): routes each request to its model's
own server by the body's `model` field (or `/v1/models/{id}`), relaying the answer as it comes.
OpenAI's error shape for what the front itself refuses (unknown model 404, a model that cannot be
loaded 503 with Retry-After, a body that is not JSON 400)."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.serve.errors import error_body
from pagoda.serve.model_pool import ModelPool, PoolError

# Relayed to the member as is; hop-by-hop and length headers are the relay's own business.
_DROPPED_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
ROUTED_POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def _error(exc: PoolError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    code = "model_not_found" if exc.status == 404 else "service_unavailable"
    return JSONResponse(error_body(str(exc), "invalid_request_error" if exc.status == 404 else "service_unavailable",
                                   "model" if exc.status == 404 else None, code),
                        status_code=exc.status, headers=headers)


def build_pool_app(pool: ModelPool) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()
            pool.shutdown()

    app = FastAPI(title="Pagoda model pool", lifespan=lifespan)
    app.state.pool = pool

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": pool.describe()}

    async def relay(request: Request, model: str | None, body: bytes) -> Response:
        try:
            member = await pool.acquire(model)
        except PoolError as exc:
            return _error(exc)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
        try:
            upstream = await client.send(
                client.build_request(request.method, f"{member.url}{request.url.path}", content=body,
                                     headers=headers, params=request.query_params),
                stream=True,
            )
        except httpx.TransportError as exc:
            await pool.release(member)
            return _error(PoolError(503, f"model {member.name} is not answering: {exc}", retry_after=1))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                await pool.release(member)

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS}
        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=out_headers)

    for path in ROUTED_POSTS:
        @app.post(path)
        async def routed(request: Request) -> Response:
            body = await request.body()
            try:
                model = json.loads(body or b"{}").get("model")
            except (ValueError, AttributeError):
                return JSONResponse(error_body("the body must be a JSON object", "invalid_request_error", None, None),
                                    status_code=400)
            return await relay(request, model if isinstance(model, str) else None, body)

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request) -> Response:
        return await relay(request, model_id, b"")

    return app
