"""`pagoda router --backend URL --backend URL ...`: the standalone router in front of several
`pagoda serve` processes (`pagoda.serve.router_app`), its flags and the uvicorn around it."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from pagoda.engine.routing import ROUTING_POLICIES
from pagoda.entrypoints.engine_args import HelpFormatter


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="route OpenAI API requests over several `pagoda serve` backends",
        description="One OpenAI-compatible endpoint in front of several `pagoda serve` processes: prefix-cache-aware "
                    "routing, health checks, ejection and re-admission of backends.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--backend", action="append", default=[], help="a backend's base URL, e.g. http://10.0.0.5:8000 "
                   "(repeatable)")
    p.add_argument("--backends-file", default=None, help="a file of backend URLs, one a line (# comments)")
    p.add_argument("--host", default=os.environ.get("PAGODA_HOST", "0.0.0.0"), help="address to listen on")
    p.add_argument("--port", type=int, default=int(os.environ.get("PAGODA_PORT", "8000")), help="port to listen on")
    p.add_argument("--routing-policy", default="cache_aware", choices=ROUTING_POLICIES,
                   help="which backend serves a request (see `pagoda serve --routing-policy`)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health checks; a failed check ejects a backend")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds a health check may take")
    p.add_argument("--readmit-after", type=int, default=1,
                   help="health checks an ejected backend must pass in a row to be routed to again")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the least severe log lines shown")
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one JSON object per line")
    p.set_defaults(func=cmd_router)
    return p


def cmd_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from pagoda.ops.logs import configure_logging
    from pagoda.serve.router_app import build_router_app
    from pagoda.serve.router_backends import BackendPool, read_backends_file

    urls = list(ns.backend)
    if ns.backends_file:
        try:
            urls += read_backends_file(ns.backends_file)
        except OSError as exc:
            raise ValueError(f"cannot read --backends-file: {exc}") from None
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    pool = BackendPool(urls, ns.health_interval, ns.health_timeout, ns.readmit_after)
    configure_logging(ns.log_level, ns.log_format, "router")
    logging.getLogger("pagoda.serve").info("routing (%s) over %s on http://%s:%d", ns.routing_policy,
                                           ", ".join(b.url for b in pool.backends), ns.host, ns.port)
    app = build_router_app(pool, ns.routing_policy)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, log_config=None, timeout_keep_alive=5)
    return 0
