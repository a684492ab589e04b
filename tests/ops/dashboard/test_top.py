"""`pagoda top` under a pseudo-terminal against a live server: the screen (as a terminal emulator,
pyte, renders it) shows the running and waiting counts that /load reports, with requests waiting
behind a full batch and after they are gone; Ctrl-C ends it with code 0. And its one-line errors."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading

import httpx
import pyte

from tests.ops.dashboard.server_helpers import TENANT_KEYS, auth, load, wait_idle
from tests.serve.serve_helpers import REPO, wait_for

ROWS, COLS = 50, 160
COUNTS = re.compile(r"running (\d+)\s+waiting (\d+)")


class Terminal:
    """`pagoda top` on the slave side of a pty; a thread feeds what it writes to a pyte screen."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        self.master = master
        self.screen = pyte.Screen(COLS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "pagoda", "top", *args], cwd=REPO,
                                     env={**os.environ, **env}, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True)
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the slave side closed: top exited
                return
            if not data:
                return
            with self.lock:
                self.stream.feed(data)

    def text(self) -> str:
        with self.lock:
            return "\n".join(self.screen.display)

    def counts(self) -> tuple[int, int] | None:
        m = COUNTS.search(self.text())
        return (int(m.group(1)), int(m.group(2))) if m else None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(5)
            os.close(self.master)


def _matches_load(term: Terminal, srv, running: int, waiting: int):
    """The screen shows (running, waiting) and /load said the same just before and just after."""
    before = load(srv)
    shown = term.counts()
    after = load(srv)
    expect = (running, waiting)
    ok = all((b["num_requests_running"], b["num_requests_waiting"]) == expect for b in (before, after))
    return ok and shown == expect


def _has(term: Terminal, *texts: str) -> bool:
    screen = term.text()
    return all(t in screen for t in texts)


def test_top_shows_the_running_and_waiting_counts_of_load(dashboard_server):
    srv = dashboard_server
    wait_idle(srv)
    term = Terminal(["--url", srv.url, "--interval", "0.2"], {"PAGODA_API_KEY": TENANT_KEYS["team-a"]})
    release = threading.Event()
    started = []

    def long_stream(i: int) -> None:
        # The server allows two running requests: of four long ones, two wait. Closing the stream
        # aborts the request. 4,000 tokens hold the two-and-two state for ~2.5 s on the tiny model
        # (2,000 held it ~1.3 s, which a loaded machine's screen refresh and polls could miss); the
        # server's 600 blocks hold two such requests without preempting either.
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{srv.base_url}/completions", headers=auth("team-b"), json={
                "prompt": [40 + i] * 8, "max_tokens": 4000, "ignore_eos": True, "stream": True,
            }) as r:
                assert r.status_code == 200
                started.append(i)
                release.wait(120)

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(4)]
    try:
        # The reader thread may have fed pyte part of a redraw, so the whole screen is waited for
        # rather than read once after the counts appear.
        wait_for(lambda: term.counts() == (0, 0) and _has(term, "pagoda top", "recent requests", "TTFT"),
                 60, what="top to show an idle server on a whole screen")
        for t in threads:
            t.start()
        wait_for(lambda: _matches_load(term, srv, 2, 2) and _has(term, "team-b"), 60,
                 what="top to show 2 running and 2 waiting, as /load does, and the tenant")
        release.set()
        for t in threads:
            t.join(60)
        wait_for(lambda: _matches_load(term, srv, 0, 0), 60, what="top to show 0 and 0 again, as /load does")
    finally:
        release.set()
        code = term.stop()
    assert code == 0
    assert len(started) == 4


def test_top_refuses_a_wrong_key_and_a_dead_url_in_one_line(dashboard_server):
    def run(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"}
        return subprocess.run([sys.executable, "-m", "pagoda", "top", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)

    wrong = run("--url", dashboard_server.url, "--api-key", "sk-nope", "--once")
    assert wrong.returncode == 2 and wrong.stderr.strip().count("\n") == 0
    assert "refused the API key (401)" in wrong.stderr
    once = run("--url", dashboard_server.url, "--api-key", TENANT_KEYS["team-b"], "--once")
    assert once.returncode == 0 and COUNTS.search(once.stdout), once.stderr
    dead = run("--url", "http://127.0.0.1:9", "--once")
    assert dead.returncode == 2 and "cannot reach http://127.0.0.1:9" in dead.stderr
    assert "Traceback" not in wrong.stderr + dead.stderr
