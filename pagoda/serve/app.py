"""The FastAPI application: `build_app` puts together the server state, the error handlers, the
auth / rate-limit middleware, CORS and the routers (`pagoda.serve.routes`: the small endpoints;
`pagoda.serve.openai_api`: the generation endpoints), and runs the engine's lifecycle.

Extending (the ops layer does this): `build_app()` returns a plain FastAPI app whose `app.state.server`
is the `ServerState`; add routers with `app.include_router`, public paths to
`ServerConfig.public_paths`, engine-output listeners to `state.engine.output_listeners`, listeners
told which tenant sent each engine request to `state.on_request_started`, and lifecycle hooks to
`state.on_ready` / `state.on_dead` / `state.on_shutdown`. The lifecycle itself is
described in `pagoda.serve.state`.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pagoda.serve.errors import install_error_handlers
from pagoda.serve.lifecycle_routes import router as lifecycle_router
from pagoda.serve.middleware import AuthMiddleware
from pagoda.serve.openai_api import router as openai_router
from pagoda.serve.routes import router as routes_router
from pagoda.serve.state import ServerConfig, ServerState
from pagoda.version import __version__

# ServerConfig and ServerState are part of this module's interface: the command line builds them here.
__all__ = ["ServerConfig", "ServerState", "build_app"]

logger = logging.getLogger(__name__)


def build_app(state: ServerState) -> FastAPI:
    """The app serving `state`; its lifespan starts the engine in the background and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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

    app = FastAPI(title="Pagoda", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(routes_router)
    app.include_router(openai_router)
    app.include_router(lifecycle_router)
    app.add_middleware(AuthMiddleware, state=state)
    # Added last, so outermost: preflights and 401s carry the CORS headers too.
    cfg = state.config
    app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=cfg.allowed_methods,
                       allow_headers=cfg.allowed_headers, allow_credentials=cfg.allow_credentials)
    return app
