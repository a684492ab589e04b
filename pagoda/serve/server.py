"""Runs the app under uvicorn and turns the server's fate into the process's exit code:
0 after a normal stop (SIGINT/SIGTERM), 1 when the engine core died or failed to start (so a
supervisor restarts it). A watchdog makes sure a dead-engine exit happens even if a connection
refuses to close."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

import uvicorn

from pagoda.config import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.serve.app import ServerConfig, ServerState, build_app
from pagoda.serve.tenants import TenantRegistry

logger = logging.getLogger(__name__)

_HARD_EXIT_AFTER_S = 10.0  # after an exit was requested, stop waiting for connections to close


def _note_signal(signum: int, frame: object) -> None:
    logger.info("stopped by signal %d", signum)


def make_state(
    engine_args: EngineArgs,
    config: ServerConfig,
    tenants: TenantRegistry | None = None,
    chat_template: str | None = None,
    log_level: str = "info",
) -> ServerState:
    engine = AsyncLLM(
        engine_args, chat_template=chat_template, request_timeout=config.request_timeout, log_level=log_level
    )
    return ServerState(config, engine, tenants)


def run_server(state: ServerState, host: str, port: int, log_level: str = "info", **uvicorn_kwargs) -> int:
    """Serve until stopped; returns the process exit code."""
    app = build_app(state)
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
    server = uvicorn.Server(config)

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
