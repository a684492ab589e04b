"""The standalone router (`pagoda router`): one OpenAI-compatible endpoint in front of several
`pagoda serve` processes anywhere on the network, with the data-parallel policies
(`pagoda.engine.routing`).

The router cannot read its backends' caches, so it learns prefixes from the prompts it routes: a
prompt's text (a chat's roles and contents) is cut into blocks of `BLOCK_BYTES` UTF-8 bytes whose
chained hashes go into the prefix index of the backend that got it. Generation requests
(/v1/completions, /v1/chat/completions) are routed by policy; everything else under the OpenAI API
(/v1/models, /tokenize, ...) goes to the least loaded healthy backend. Bodies and responses pass
through unchanged (streams chunk by chunk); the response names its backend (`X-Pagoda-Backend`).

Failures: a backend that cannot be reached, or answers 503 (draining, its engine gone), is ejected
and the request goes to another one; a stream cut mid-way ends with an error event and `[DONE]`. The router's own /health
is 200 while a backend is up, /ready and /load list the backends (their own /load included).
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.engine.prefix_index import block_hashes
from pagoda.engine.routing import Router
from pagoda.serve.admission import SESSION_HEADER
from pagoda.serve.errors import error_body, install_error_handlers, unavailable
from pagoda.serve.router_backends import Backend, BackendPool
from pagoda.version import __version__

logger = logging.getLogger(__name__)

BLOCK_BYTES = 64  # prefix granularity: about 16 tokens of English text
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop headers (RFC 9110) and those httpx recomputes are not passed on.
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
        "proxy-authorization", "proxy-authenticate", "content-encoding"}


def prompt_units(path: str, body: Any) -> list[int]:
    """What a request's prefix is made of: a completion's prompt (its token ids, or its text's
    bytes), a chat's roles and message texts as bytes; [] when there is nothing to go by."""
    if not isinstance(body, dict):
        return []
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<|{m.get('role')}|>{content or ''}")
        return list("".join(parts).encode())
    prompt = body.get("prompt")
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    if isinstance(prompt, list) and prompt and not is_ids:
        prompt = prompt[0]  # several prompts go together: the first decides
    if isinstance(prompt, str):
        return list(prompt.encode())
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return []


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}


def _response_headers(resp: httpx.Response, backend: Backend) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
    out["x-pagoda-backend"] = backend.url
    return out


class _ClosingStreamingResponse(StreamingResponse):
    """Always closes the relay (client gone, server stopping), so that the upstream connection is
    closed and the backend aborts the request at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class RouterState:
    def __init__(self, pool: BackendPool, policy: str) -> None:
        self.pool = pool
        self.router = Router(policy)
        pool.on_readmit = self.router.forget_replica
        self.client: httpx.AsyncClient | None = None


async def _relay(resp: httpx.Response, backend: Backend, pool: BackendPool) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        pool.eject(backend, f"stream cut: {type(exc).__name__}")
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            err = error_body(f"the backend {backend.url} failed mid-stream: {type(exc).__name__}",
                             "service_unavailable_error", code="backend_failed")
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        backend.in_flight -= 1
        await resp.aclose()


async def _proxy(state: RouterState, request: Request, path: str, routed: bool) -> Response:
    raw = await request.body()
    body: Any = None
    if routed:
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # the backend answers the 400
    hashes = block_hashes(prompt_units(path, body), BLOCK_BYTES) if routed else []
    session = request.headers.get(SESSION_HEADER) or (body.get("user") if isinstance(body, dict) else None)
    url_path = path + (f"?{request.url.query}" if request.url.query else "")
    tried: set[int] = set()
    while True:
        loads = state.pool.loads(tried)
        if not loads:
            return unavailable("no backend is serving", retry_after_s=1).response()
        if routed:
            decision = state.router.choose(loads, hashes, session if isinstance(session, str) else None)
            index = decision.replica
        else:
            index, decision = min(loads, key=lambda i: (loads[i], i)), None
        backend = state.pool.backends[index]
        backend.in_flight += 1
        req = state.client.build_request(request.method, backend.url + url_path, content=raw,
                                         headers=_forward_headers(request))
        try:
            resp = await state.client.send(req, stream=True)
        except httpx.HTTPError as exc:  # nothing reached the client: another backend may serve it
            backend.in_flight -= 1
            state.pool.eject(backend, f"{type(exc).__name__}: {exc}")
            tried.add(index)
            continue
        if resp.status_code == 503 and state.pool.loads(tried | {index}):
            # Draining, or its engine is gone: another backend serves it.
            await resp.aclose()
            backend.in_flight -= 1
            state.pool.eject(backend, "answered 503")
            tried.add(index)
            continue
        backend.requests += 1
        if decision is not None:
            logger.info("routed %s to %s (%s, %s): %d/%d prompt blocks matched, in flight %s", path, backend.url,
                        decision.policy, decision.reason, decision.matched_blocks, decision.prompt_blocks,
                        decision.loads, extra={"request_id": resp.headers.get("x-request-id", "-")})
        return _ClosingStreamingResponse(_relay(resp, backend, state.pool), status_code=resp.status_code,
                                 headers=_response_headers(resp, backend))


def build_router_app(pool: BackendPool, policy: str = "cache_aware") -> FastAPI:
    state = RouterState(pool, policy)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            state.client = client
            await pool.start(client)
            try:
                yield
            finally:
                await pool.stop()

    app = FastAPI(title="Pagoda router", version=__version__, lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        up = len(pool.healthy())
        if up:
            return JSONResponse({"status": "ready", "backends_up": up})
        return unavailable("no backend is serving", retry_after_s=1).response()

    @app.get("/ready")
    async def ready() -> Response:
        listed = [b.to_dict() for b in pool.backends]
        up = len(pool.healthy())
        if up:
            return JSONResponse({"status": "ready", "backends_up": up, "backends": listed})
        return JSONResponse({**unavailable("no backend is serving").body(), "backends": listed}, status_code=503)

    @app.get("/load")
    async def load() -> dict:
        """The backends' /load (from the last health check) and their sums, for autoscalers."""
        healthy = pool.healthy()
        total = {k: sum(b.load.get(k, 0) for b in healthy)
                 for k in ("server_load", "num_requests_running", "num_requests_waiting")}
        return {**total, "router_in_flight": sum(b.in_flight for b in pool.backends),
                "backends_up": len(healthy), "backends": [b.to_dict() for b in pool.backends]}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def passthrough(path: str, request: Request) -> Response:
        full = "/" + path
        return await _proxy(state, request, full, routed=request.method == "POST" and full in GENERATION_PATHS)

    return app
