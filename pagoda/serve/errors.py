"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure path:
our own `APIError`s, FastAPI's validation errors (400, never 422), malformed JSON, unknown routes,
and anything unexpected (500, without leaking a traceback to the client)."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> APIError:
    # Retry-After is whole seconds (RFC 9110); round up so a client that obeys it succeeds.
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, message, code=code, headers={"Retry-After": str(seconds)})


def unavailable(message: str, retry_after_s: float | None = None) -> APIError:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s else None
    return APIError(503, message, code="service_unavailable", headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    msg = str(err.get("msg", "invalid value"))
    # Our model validators raise ValueError, which pydantic prefixes.
    msg = msg.removeprefix("Value error, ")
    param = loc[0] if loc else None
    # A model validator's error has no location; ours may still name the field (InvalidRequestError.field).
    param = param or getattr((err.get("ctx") or {}).get("error"), "field", None)
    where = ".".join(loc)
    if err.get("type") == "missing":
        return f"missing required field: {where}", param
    return (f"{where}: {msg}" if where else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 404:
            message = f"no such route: {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, _TYPES.get(status, "invalid_request_error")),
            status_code=status,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)
