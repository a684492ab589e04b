"""Runs the app under uvicorn and turns the server's fate into the process's exit code:
0 after a normal stop (SIGINT/SIGTERM), 1 when the engine core died or crashed while starting (so a
supervisor restarts it), 2 when it could not start with these arguments (`ServerState.startup_error`:
a bad model, a KV cache too small; a restart would fail the same way). A watchdog makes sure a
dead-engine exit happens even if a connection refuses to close.

SIGTERM drains (`ServerState.graceful_stop`): new requests get 503, in-flight ones finish (up to
the drain timeout), then the process exits 0. SIGINT, or a second SIGTERM, stops at once:
requests in flight are aborted, each with its error response."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
from typing import Any, Callable

import uvicorn

from pagoda.config import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.replica_set import DataParallelLLM
from pagoda.serve.app import build_app
from pagoda.serve.state import ServerConfig, ServerState
from pagoda.serve.tenants import TenantRegistry

logger = logging.getLogger(__name__)

_HARD_EXIT_AFTER_S = 10.0  # after an exit was requested, stop waiting for connections to close


def _note_signal(signum: int, frame: object) -> None:
    logger.info("stopped by signal %d", signum)


def freeze_startup_heap() -> None:
    """Leave what the process holds once ready (torch, the tokenizer, the app and their objects)
    out of the garbage collector's oldest generation. A full collection walked all of it, ~0.1 s
    of the API's CPU on a 2-core machine in the middle of a streamed batch, every stream stalled
    meanwhile; now it walks what requests allocate. (vLLM's server does the same.)"""
    gc.collect()
    gc.freeze()


def make_state(
    engine_args: EngineArgs,
    config: ServerConfig,
    tenants: TenantRegistry | None = None,
    chat_template: str | None = None,
    log_level: str = "info",
    log_setup: Callable[[], None] | None = None,
    routing_policy: str = "cache_aware",
) -> ServerState:
    """The state serving one engine, or `data_parallel_size` replicas routed by `routing_policy`."""
    kwargs: dict[str, Any] = dict(chat_template=chat_template, request_timeout=config.request_timeout,
                                  log_level=log_level, log_setup=log_setup)
    if engine_args.data_parallel_size > 1:
        engine: Any = DataParallelLLM(engine_args, routing_policy=routing_policy, **kwargs)
    else:
        engine = AsyncLLM(engine_args, **kwargs)
    return ServerState(config, engine, tenants)


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM starts a drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self._draining and self.drain_timeout > 0 and self._loop is not None:
            # In a signal handler: hand the work to the event loop.
            self._draining = True
            self._loop.call_soon_threadsafe(self.state.graceful_stop, self.drain_timeout)
            return
        if self._loop is not None:
            # Stopping at once: end the requests in flight first, so that each gets its error response
            # (503, or an error event then [DONE]) rather than being cancelled by uvicorn's shutdown,
            # which answers a plain-text 500 and logs a traceback after waiting for them.
            self._loop.call_soon_threadsafe(self._abort_inflight)
        super().handle_exit(sig, frame)

    def _abort_inflight(self) -> None:
        engine = self.state.engine
        left = engine.num_inflight_requests()
        if left:
            logger.warning("stopping at once: aborting %d request(s) in flight", left)
            engine.abort_all()


def run_server(
    state: ServerState,
    host: str,
    port: int,
    log_level: str = "info",
    app: Any = None,
    drain_timeout: float = 30.0,
    own_logging: bool = False,
    **uvicorn_kwargs,
) -> int:
    """Serve until stopped; returns the process exit code. `own_logging`: logging is configured
    already (pagoda.ops.logs), so uvicorn must not install its own handlers."""
    if app is None:
        app = build_app(state)
    if own_logging:
        uvicorn_kwargs.setdefault("log_config", None)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        # A client that vanished mid-stream is noticed by its next write; keep-alive idles are cheap.
        timeout_keep_alive=5,
        **uvicorn_kwargs,
    )
    server = _DrainingServer(config, state, drain_timeout)
    state.on_ready.append(freeze_startup_heap)

    def request_exit(code: int) -> None:
        server.should_exit = True
        if code:
            # uvicorn waits for open connections; a dead engine must not wait on a stuck client.
            def hard_exit() -> None:
                logger.error("server did not stop in time; exiting with code %d", code)
                os._exit(code)

            timer = threading.Timer(_HARD_EXIT_AFTER_S, hard_exit)
            timer.daemon = True
            timer.start()

    state.exit_callback = request_exit
    # uvicorn handles SIGINT/SIGTERM with a graceful shutdown, then re-raises the signal with the
    # handler that was installed before it. Installing a quiet one makes a requested stop end with
    # exit code 0 (not death by signal, not a KeyboardInterrupt traceback).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _note_signal)
    asyncio.run(server.serve())
    if state.exit_code:
        return state.exit_code
    if not server.started:
        return 1  # e.g. the port was taken
    return 0
