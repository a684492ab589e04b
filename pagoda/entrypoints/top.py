"""`pagoda top --url URL`: the operator dashboard's figures in the terminal (`pagoda.ops.top`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pagoda.entrypoints.engine_args import HelpFormatter


def add_top_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "top", help="watch a running server's load, latency and recent requests in the terminal",
        description="Watch a running pagoda server: requests running and waiting, KV usage, tokens/s, "
                    "prefix-cache hits, latency percentiles, tenants and recent requests, redrawn every interval.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--url", default=os.environ.get("PAGODA_URL", "http://127.0.0.1:8000"),
                   help="the server's base URL (default: $PAGODA_URL, else http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                   help="an API key of the server, when it has keys (default: $PAGODA_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=cmd_top)
    return p


def cmd_top(ns: argparse.Namespace) -> int:
    from pagoda.ops.top import TopError, run_top

    if ns.interval <= 0:
        raise ValueError("--interval must be > 0")
    try:
        return run_top(ns.url, ns.api_key, ns.interval, once=ns.once)
    except TopError as exc:
        raise ValueError(str(exc)) from None
