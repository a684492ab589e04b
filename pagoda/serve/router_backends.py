"""The standalone router's backends (`pagoda router`): `pagoda serve` processes anywhere on the
network, their health and their load.

Every `health_interval` seconds each backend's /health is asked (and, when healthy, its /load, for
autoscalers reading the router's /load). A backend that fails a check, or a connection while a
request is proxied, is ejected at once: no request goes to it until a check passes again
(`readmit_after` checks in a row), when it is re-admitted with an empty prefix index (it may have
restarted, its cache gone). Loads are the requests the router has in flight to each backend, known
here at once, as SGLang's router counts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

logger = logging.getLogger(__name__)


@dataclass
class Backend:
    index: int
    url: str
    healthy: bool = False  # until its first check passes
    in_flight: int = 0
    passes: int = 0  # checks passed in a row
    last_error: str | None = None
    last_check: float = 0.0
    requests: int = 0  # routed to it, ever
    load: dict = field(default_factory=dict)  # its /load, from the last check

    def to_dict(self) -> dict:
        return {"backend": self.index, "url": self.url, "status": "up" if self.healthy else "down",
                "in_flight": self.in_flight, "requests": self.requests, "last_error": self.last_error,
                "load": self.load}


def read_backends_file(path: str) -> list[str]:
    """One URL a line; blank lines and `#` comments skipped."""
    with open(path, encoding="utf-8") as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def check_urls(urls: list[str]) -> list[str]:
    out = []
    for url in urls:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"backend {url!r} is not an http(s) URL")
        out.append(url.rstrip("/"))
    if not out:
        raise ValueError("no backend given: use --backend URL (repeatable) or --backends-file")
    if len(set(out)) != len(out):
        raise ValueError("a backend is given twice")
    return out


class BackendPool:
    """The backends, their health checks and their in-flight counts."""

    def __init__(self, urls: list[str], health_interval: float = 2.0, health_timeout: float = 2.0,
                 readmit_after: int = 1, on_readmit: Callable[[int], None] | None = None) -> None:
        if health_interval <= 0 or health_timeout <= 0 or readmit_after < 1:
            raise ValueError("health interval and timeout must be > 0, readmit_after >= 1")
        self.backends = [Backend(i, url) for i, url in enumerate(check_urls(urls))]
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.readmit_after = readmit_after
        self.on_readmit = on_readmit
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    def loads(self, exclude: set[int] = frozenset()) -> dict[int, int]:
        """In-flight requests of each healthy backend not excluded."""
        return {b.index: b.in_flight for b in self.backends if b.healthy and b.index not in exclude}

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def eject(self, b: Backend, why: str) -> None:
        b.passes = 0
        b.last_error = why
        if b.healthy:
            b.healthy = False
            logger.warning("backend %s ejected: %s", b.url, why)

    async def check(self, b: Backend) -> None:
        try:
            r = await self._client.get(f"{b.url}/health", timeout=self.health_timeout)
            ok = r.status_code == 200
            why = f"/health answered {r.status_code}"
            if ok:
                lr = await self._client.get(f"{b.url}/load", timeout=self.health_timeout)
                b.load = lr.json() if lr.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        b.last_check = time.time()
        if not ok:
            self.eject(b, why)
            return
        b.passes += 1
        if not b.healthy and b.passes >= self.readmit_after:
            b.healthy, b.last_error = True, None
            logger.info("backend %s admitted", b.url)
            if self.on_readmit is not None:
                self.on_readmit(b.index)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("health check round failed")

    async def start(self, client: httpx.AsyncClient) -> None:
        self._client = client
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="pagoda-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:
                pass
