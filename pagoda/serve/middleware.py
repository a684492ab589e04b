"""The auth and rate-limit middleware: a Bearer API key on every path but the public ones, and the
tenant's requests-per-second bucket on the generation paths, both before the body is read."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pagoda.serve.errors import error_body, rate_limited
from pagoda.serve.state import ServerState
from pagoda.serve.tenants import ANONYMOUS


class AuthMiddleware:
    """Pure ASGI (so streaming and disconnects pass untouched): checks the Bearer key on every path
    but the public ones (401), and takes one request from the tenant's requests-per-second bucket on
    the generation paths (429 with Retry-After) before the body is even read."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        path = scope.get("path", "")
        tenant = ANONYMOUS
        if state.tenants.enabled and scope.get("method") != "OPTIONS" and path not in state.config.public_paths:
            key = _bearer(scope)
            found = state.tenants.lookup(key)
            if found is None:
                why = "Missing API key: send it as 'Authorization: Bearer <key>'" if not key else "Invalid API key"
                resp = JSONResponse(
                    error_body(why, "authentication_error", None, "invalid_api_key"),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await resp(scope, receive, send)
            tenant = found
        scope.setdefault("state", {})["tenant"] = tenant
        if scope.get("method") == "POST" and path in state.config.rate_limited_paths:
            wait = tenant.take_request()
            if wait > 0:
                err = rate_limited(
                    f"Rate limit reached for {tenant.name}: {tenant.requests_per_second:g} requests per second",
                    wait,
                )
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _bearer(scope: dict) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            v = value.decode("latin-1").strip()
            if v[:7].lower() == "bearer ":
                return v[7:].strip()
            return None
    return None
