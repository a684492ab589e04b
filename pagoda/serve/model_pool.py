"""Several models behind one server: `pagoda serve --model A --model B --max-loaded-models K`.

Each model is served by its own `pagoda serve` process (an API process and its engine core) on a
loopback port; this front routes each request by its `model` field and relays the answer (streams
included) untouched, so every model gets the whole single-model server: its errors, limits,
versions and admin endpoints. A model that is not loaded is started on its first request, which
waits (up to the load timeout, then 503 with Retry-After); when K models are loaded, the least
recently used one without requests in flight is stopped first. `/v1/models` lists every model with
its state (unloaded, loading, loaded) and, for loaded ones, their cards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PoolMember:
    name: str
    model: str
    state: str = "unloaded"  # unloaded, loading, loaded
    port: int = 0
    proc: subprocess.Popen | None = None
    last_used: float = 0.0
    inflight: int = 0
    loads: int = 0
    last_load_s: float | None = None
    _starting: asyncio.Task | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class PoolError(Exception):
    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class ModelPool:
    """The models, which of them run, and starting and stopping them (on the event loop)."""

    def __init__(self, models: dict[str, str], max_loaded: int, member_args: list[str],
                 load_timeout: float = 300.0) -> None:
        if max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {max_loaded}")
        if not models:
            raise ValueError("no models to serve")
        self.members = {name: PoolMember(name, model) for name, model in models.items()}
        self.default = next(iter(models))
        self.max_loaded = max_loaded
        self.member_args = member_args
        self.load_timeout = load_timeout
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()

    def member(self, name: str | None) -> PoolMember:
        if not name:
            return self.members[self.default]
        found = self.members.get(name)
        if found is None:
            raise PoolError(404, f"The model `{name}` does not exist. Served: {', '.join(self.members)}")
        return found

    async def acquire(self, name: str | None) -> PoolMember:
        """The member, loaded and counted as in use (call release() when its request ends).

        The request counts from the start, while it waits for the load: counted only once the load
        had finished, another model's request waiting for room could take the freshly loaded member
        for idle in between and stop it under this request (which then got 503 "aborted")."""
        m = self.member(name)
        m.last_used = time.monotonic()
        m.inflight += 1
        try:
            while m.state != "loaded":
                async with self._lock:
                    if m._starting is None and m.state != "loaded":
                        await self._make_room(m)
                        # Counted at once: the task runs later, and another request taking the lock
                        # first would otherwise find room for one more.
                        m.state = "loading"
                        m._starting = asyncio.ensure_future(self._start(m))
                    task = m._starting
                if task is not None:
                    await asyncio.shield(task)
        except BaseException:
            await self.release(m)
            raise
        return m

    async def release(self, m: PoolMember) -> None:
        m.inflight -= 1
        m.last_used = time.monotonic()
        async with self._changed:
            self._changed.notify_all()

    async def _make_room(self, wanted: PoolMember) -> None:
        """Stop least recently used members until one more fits (waiting for one to be idle)."""
        deadline = time.monotonic() + self.load_timeout
        while sum(1 for m in self.members.values() if m.state != "unloaded") >= self.max_loaded:
            idle = [m for m in self.members.values() if m.state == "loaded" and m.inflight == 0 and m is not wanted]
            if idle:
                # Unloaded at once, on the event loop, so that no request takes it from here on; its
                # process exits off the loop, where other models' requests keep flowing meanwhile.
                victim = min(idle, key=lambda m: m.last_used)
                await asyncio.to_thread(self._stop_process, victim.name, self._detach(victim))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolError(503, f"cannot load {wanted.name}: every loaded model is busy", retry_after=1)
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass

    def _member_env(self) -> dict[str, str]:
        """Several loaded members' engine cores would each bind their threads to the same CPUs
        (pagoda.exec.cpu_threads), where two busy ones should rather be left to the OS: unless the
        user chose a binding, members leave theirs unbound when more than one can be loaded."""
        env = dict(os.environ)
        if self.max_loaded > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return env

    async def _start(self, m: PoolMember) -> None:
        t0 = time.monotonic()
        m.port = _free_port()  # acquire() has marked it loading
        cmd = [sys.executable, "-m", "pagoda", "serve", m.model, "--served-model-name", m.name,
               "--host", "127.0.0.1", "--port", str(m.port), *self.member_args]
        logger.info("loading model %s (%s) on port %d", m.name, m.model, m.port)
        # In this process's group: whatever stops the whole server (a terminal's Ctrl-C, a supervisor
        # killing the group) stops the members too.
        m.proc = subprocess.Popen(cmd, env=self._member_env())
        try:
            await self._wait_healthy(m)
        except BaseException as exc:
            await asyncio.to_thread(self._stop, m)
            m._starting = None
            if isinstance(exc, PoolError):
                raise
            raise PoolError(503, f"model {m.name} failed to start: {exc}", retry_after=1) from None
        m.state, m._starting = "loaded", None
        m.loads += 1
        m.last_load_s = time.monotonic() - t0
        logger.info("model %s loaded in %.2f s", m.name, m.last_load_s)
        async with self._changed:
            self._changed.notify_all()

    async def _wait_healthy(self, m: PoolMember) -> None:
        deadline = time.monotonic() + self.load_timeout
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline:
                if m.proc.poll() is not None:
                    raise PoolError(503, f"model {m.name} exited with code {m.proc.returncode} while loading")
                try:
                    if (await client.get(f"{m.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.05)
        raise PoolError(503, f"model {m.name} did not load within {self.load_timeout:g} s", retry_after=5)

    def _stop(self, m: PoolMember) -> None:
        self._stop_process(m.name, self._detach(m))

    @staticmethod
    def _detach(m: PoolMember) -> subprocess.Popen | None:
        """Mark the member unloaded; returns its process, for _stop_process."""
        proc, m.proc, m.state = m.proc, None, "unloaded"
        return proc

    @staticmethod
    def _stop_process(name: str, proc: subprocess.Popen | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        logger.info("unloading model %s", name)
        proc.send_signal(signal.SIGINT)  # stop at once: the member has no request in flight
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()  # its engine core exits by itself once its parent is gone
            proc.wait(5)

    def shutdown(self) -> None:
        for m in self.members.values():
            self._stop(m)

    def describe(self) -> list[dict]:
        return [{"id": m.name, "object": "model", "owned_by": "pagoda", "root": m.model, "state": m.state,
                 "loads": m.loads, "last_load_s": m.last_load_s} for m in self.members.values()]
