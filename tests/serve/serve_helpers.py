"""Start and stop a real `pagoda serve` process for the service-layer tests.

The server runs in its own session so that it and its engine-core child can be stopped together;
its output goes to a file (a pipe could fill up and block it) that failures print.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
# Small and exact: float32 (the reference dtype), a 2048-token context, a pool that holds a few
# full-context requests (399 usable blocks of 16 tokens).
SMALL_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", "400"]
READY_TIMEOUT_S = 300.0  # a loaded 2-core machine can take a while to load the model twice over


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str] | None = None, cmd: list[str] | None = None, env: dict | None = None) -> None:
        self.port = free_port()
        self.args = list(args or [])
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PAGODA_HOST"] = "127.0.0.1"
        full_env["PAGODA_PORT"] = str(self.port)
        self.env = full_env
        self.cmd = cmd or [sys.executable, "-m", "pagoda", "serve", *self.args]
        self.log_path = Path(tempfile.mkstemp(prefix="pagoda-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.health_seen: list[int] = []
        self.startup_probes: list[tuple[int, int]] = []  # (completion status, health status right after)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, probe_headers: dict | None = None) -> "ServerProcess":
        """Poll /health until 200. While it says 503, also probe a completion, to check that the
        server refuses work (503) while the model loads."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                self.health_seen.append(status)
                if status == 200:
                    return self
                if len(self.startup_probes) < 3:
                    r = client.post(
                        f"{self.url}/v1/completions",
                        json={"prompt": "hi", "max_tokens": 1},
                        headers=probe_headers or {},
                    )
                    after = client.get(f"{self.url}/health").status_code
                    self.startup_probes.append((r.status_code, after))
                time.sleep(0.1)
        raise RuntimeError(f"server not ready within {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, group: bool = False) -> int | None:
        """SIGTERM the server (`group`: its whole process group, as systemd or a terminal would),
        then, if needed, SIGKILL the session we started it in; returns its exit code."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            if group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
            code = self.wait_exit(30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session we created: server, core, make
        except (ProcessLookupError, PermissionError):
            pass
        if code is None:
            code = self.wait_exit(10)
        self._log.close()
        return code


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
