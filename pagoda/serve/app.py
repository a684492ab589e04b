"""The FastAPI application: server state and lifecycle, the auth / rate-limit middleware, and the
small endpoints (/health, /version, /v1/models, /tokenize, /detokenize, /v1/engine/stats). The
OpenAI generation endpoints are in `pagoda.serve.openai_api`.

Extending (the ops layer does this): `build_app()` returns a plain FastAPI app whose `app.state.server`
is the `ServerState`; add routers with `app.include_router`, public paths to
`ServerConfig.public_paths`, engine-output listeners to `state.engine.output_listeners`, and
lifecycle hooks to `state.on_ready` / `state.on_dead` / `state.on_shutdown`.

Lifecycle: the app starts serving at once with status "starting" (/health and every engine-backed
route answer 503) while the engine core loads; then "ready". "draining" (after SIGTERM, see
`graceful_stop`) refuses new work with 503 but keeps /health at 200 while in-flight requests finish. If the engine core dies, status
turns "dead": in-flight requests fail at once, /health answers 503, and after a short grace period
(so health checkers can see it) the server is asked to exit with code 1. If the engine core fails to
start because of its arguments (the model does not load, the KV cache is too small), the server
exits at once with code 2, as for a usage error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

import pagoda
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.errors import EngineConfigError
from pagoda.errors import InvalidRequestError
from pagoda.serve.errors import APIError, bad_request, error_body, install_error_handlers, rate_limited, unavailable
from pagoda.serve.protocol import DetokenizeRequest, TokenizeRequest
from pagoda.serve.tenants import ANONYMOUS, Tenant, TenantRegistry

logger = logging.getLogger(__name__)

DEFAULT_PUBLIC_PATHS = frozenset({"/health", "/version", "/ping", "/metrics", "/ready", "/load"})
RATE_LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class ServerConfig:
    served_model_names: list[str]
    max_waiting_requests: int | None = None  # None: unbounded
    request_timeout: float | None = None  # seconds per request; None: none
    dead_engine_exit_delay: float = 2.0  # seconds /health shows 503 before a dead-engine exit
    public_paths: set[str] = field(default_factory=lambda: set(DEFAULT_PUBLIC_PATHS))
    rate_limited_paths: set[str] = field(default_factory=lambda: set(RATE_LIMITED_PATHS))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ServerState:
    def __init__(self, config: ServerConfig, engine: AsyncLLM, tenants: TenantRegistry | None = None) -> None:
        self.config = config
        self.engine = engine
        self.tenants = tenants or TenantRegistry()
        self.status = "starting"
        self.created = int(time.time())
        self.exit_code: int | None = None
        # Why the engine could not start with these arguments (EngineConfigError); exit code 2.
        self.startup_error: str | None = None
        # Set by the runner (uvicorn wrapper): ask the server to stop with this exit code.
        self.exit_callback: Callable[[int], None] | None = None
        self.on_ready: list[Callable[[], None]] = []
        self.on_dead: list[Callable[[str], None]] = []
        self.on_shutdown: list[Callable[[], None]] = []
        self._start_task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start_engine(self) -> None:
        try:
            await self.engine.start()
        except EngineConfigError as exc:
            # These arguments can never work: a supervisor restarting us, or health checkers watching
            # a 503 for a grace period, gain nothing. Exit now with a usage error's code; the CLI
            # prints `startup_error` as its one line.
            self.startup_error = str(exc)
            self._set_dead(str(exc))
            self.request_exit(2)
            return
        except Exception as exc:
            logger.error("engine failed to start: %s", exc)
            self._engine_dead(f"the engine failed to start: {exc}")
            return
        # Only now: a death while starting is handled above, once, rather than also by this callback
        # (which would schedule a second, delayed exit with code 1). Called at once if already dead.
        self.engine.add_dead_callback(self._engine_dead)
        if self.status == "starting":
            self.status = "ready"
            for cb in self.on_ready:
                cb()
            logger.info("ready to serve %s", ", ".join(self.config.served_model_names))

    def _engine_dead(self, reason: str) -> None:
        if self.status == "dead":
            return
        self._set_dead(reason)
        delay = self.config.dead_engine_exit_delay
        logger.error("engine core is dead (%s); exiting in %.1f s", reason, delay)
        asyncio.get_running_loop().call_later(delay, self.request_exit, 1)

    def _set_dead(self, reason: str) -> None:
        self.status = "dead"
        for cb in self.on_dead:
            try:
                cb(reason)
            except Exception:
                logger.exception("on_dead hook failed")

    def request_exit(self, code: int) -> None:
        if self.exit_code is None or code > self.exit_code:
            self.exit_code = code
        if self.exit_callback is not None:
            self.exit_callback(code)

    def begin_drain(self) -> None:
        """Refuse new work (503) from now on; in-flight requests go on."""
        if self.status in ("starting", "ready"):
            self.status = "draining"

    def graceful_stop(self, timeout: float) -> None:
        """SIGTERM: refuse new requests (503), let in-flight ones finish for up to `timeout`
        seconds (then abort them), and exit with code 0. Runs on the event loop."""
        if self._drain_task is not None:
            return
        self.begin_drain()
        logger.info(
            "draining: %d request(s) in flight, waiting up to %.0f s before exiting",
            self.engine.num_inflight_requests(), timeout,
        )
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(timeout), name="pagoda-drain")

    async def _drain(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        engine = self.engine
        while engine.num_inflight_requests() and not engine.is_dead and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = engine.num_inflight_requests()
        if left and not engine.is_dead:
            logger.warning("drain timeout: aborting %d request(s) still in flight", left)
            engine.abort_all()
        else:
            logger.info("drained; exiting")
        self.request_exit(0)

    # -- per-request checks ----------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.status == "ready":
            return
        if self.status == "starting":
            raise unavailable("the server is starting: the model is still loading", retry_after_s=1)
        if self.status == "draining":
            raise unavailable("the server is shutting down and accepts no new requests")
        raise unavailable(f"the engine is not running: {self.engine.dead_reason or 'dead'}")

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (None: the default); 404 when unknown."""
        if name is None or name == "":
            return self.config.model_name
        if name in self.config.served_model_names:
            return name
        raise APIError(
            404,
            f"The model `{name}` does not exist. Served: {', '.join(self.config.served_model_names)}",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def get_tenant(request: Request) -> Tenant:
    return request.scope.get("state", {}).get("tenant", ANONYMOUS)


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


# -- small endpoints -------------------------------------------------------------------------------
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    if state.status in ("ready", "draining") and not state.engine.is_dead:
        return JSONResponse({"status": state.status})
    if state.status == "starting":
        return unavailable("the model is still loading", retry_after_s=1).response()
    return unavailable(f"the engine is not running: {state.engine.dead_reason or 'dead'}").response()


@router.get("/version")
async def version() -> dict:
    return {"version": pagoda.__version__}


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


# -- the app ---------------------------------------------------------------------------------------
def build_app(state: ServerState) -> FastAPI:
    from pagoda.serve.openai_api import router as openai_router

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Serve at once (health says 503 while loading); the engine starts in the background.
        state._start_task = asyncio.create_task(state.start_engine(), name="pagoda-engine-start")
        try:
            yield
        finally:
            if state._start_task is not None and not state._start_task.done():
                state._start_task.cancel()
                try:
                    await state._start_task
                except BaseException:
                    pass
            for cb in state.on_shutdown:
                try:
                    cb()
                except Exception:
                    logger.exception("on_shutdown hook failed")
            await state.engine.shutdown()

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(openai_router)
    app.add_middleware(AuthMiddleware, state=state)
    return app
