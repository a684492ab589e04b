"""The server's state: its configuration (`ServerConfig`), the engine it serves and the lifecycle
around it (`ServerState`), and how a handler finds them (`get_state`, `get_tenant`).

Lifecycle: the app starts serving at once with status "starting" (/health and every engine-backed
route answer 503) while the engine core loads; then "ready". "draining" (after SIGTERM, see
`graceful_stop`) refuses new work with 503 but keeps /health at 200 while in-flight requests finish.
If the engine core dies, status turns "dead": in-flight requests fail at once, /health answers 503,
and after a short grace period (so health checkers can see it) the server is asked to exit with code
1. If the engine core fails to start because of its arguments (the model does not load, the KV cache
is too small), the server exits at once with code 2, as for a usage error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Request

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.errors import EngineConfigError
from pagoda.serve.chat_output import ChatParsers
from pagoda.serve.errors import APIError, unavailable
from pagoda.serve.tenants import ANONYMOUS, Tenant, TenantRegistry

logger = logging.getLogger(__name__)

DEFAULT_PUBLIC_PATHS = frozenset({"/health", "/version", "/ping", "/metrics", "/ready", "/load"})
RATE_LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class ServerConfig:
    """How the server serves: its model names, limits, and which paths are public or rate-limited."""

    served_model_names: list[str]
    max_waiting_requests: int | None = None  # None: unbounded
    request_timeout: float | None = None  # seconds per request; None: none
    dead_engine_exit_delay: float = 2.0  # seconds /health shows 503 before a dead-engine exit
    public_paths: set[str] = field(default_factory=lambda: set(DEFAULT_PUBLIC_PATHS))
    rate_limited_paths: set[str] = field(default_factory=lambda: set(RATE_LIMITED_PATHS))
    # CORS, vLLM's defaults: any origin, method and header; no credentials.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    chat_parsers: ChatParsers = field(default_factory=ChatParsers)  # reasoning, tool_choice "auto"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ServerState:
    """The served engine, the tenants, the server's status and its lifecycle hooks."""

    def __init__(self, config: ServerConfig, engine: AsyncLLM, tenants: TenantRegistry | None = None) -> None:
        self.config = config
        self.engine = engine
        self.tenants = tenants or TenantRegistry()
        self.status = "starting"
        self.sleeping = False  # POST /sleep: engine-backed requests get 503 until POST /wake_up
        self.created = int(time.time())
        self.exit_code: int | None = None
        # Why the engine could not start with these arguments (EngineConfigError); exit code 2.
        self.startup_error: str | None = None
        # Set by the runner (uvicorn wrapper): ask the server to stop with this exit code.
        self.exit_callback: Callable[[int], None] | None = None
        self.on_ready: list[Callable[[], None]] = []
        self.on_dead: list[Callable[[str], None]] = []
        self.on_shutdown: list[Callable[[], None]] = []
        # Told of every engine request a route sends: (request id, tenant name, prompt tokens).
        self.on_request_started: list[Callable[[str, str, int], None]] = []
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
        if self.status == "ready" and not self.sleeping:
            return
        if self.status == "ready":
            raise unavailable("the engine is sleeping (POST /wake_up wakes it)", retry_after_s=1)
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
