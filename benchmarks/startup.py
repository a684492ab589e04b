"""Startup time of `pagoda serve`: seconds from launch to the first answered /v1/completions, and the
peak resident memory of the server's process tree (API process + engine core) until then.

    .venv/bin/python benchmarks/startup.py                 # 3 runs with the normal (warm) load cache
    .venv/bin/python benchmarks/startup.py --cold --runs 1 # PAGODA_CACHE_DIR = a fresh temporary folder
    .venv/bin/python benchmarks/startup.py -- --dtype float32   # flags after -- go to `pagoda serve`

Each run starts a fresh server on a free port, polls (every 50 ms) until a one-token completion
answers, then stops it. Peak RSS sums VmRSS over the server and all its descendants, sampled every
20 ms from /proc, so a short spike between samples can be missed and pages shared between the two
processes are counted twice (an upper bound on what the tree really holds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_bytes(root_pid: int, field: str = "VmRSS") -> int:
    """`field` (VmRSS: resident now; VmHWM: the kernel's peak of it) summed over root_pid and every
    descendant, from /proc (Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name may hold spaces and parens
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


class RssSampler(threading.Thread):
    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s, self.peak = pid, period_s, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._done.wait(self.period_s)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def _post(url: str, body: dict, timeout: float) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status


def first_answer(base: str, proc: subprocess.Popen, deadline: float) -> bool:
    """Poll until a one-token completion succeeds (/v1/models may answer while the model loads)."""
    body = {"model": None, "prompt": "Hello", "max_tokens": 1}
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if body["model"] is None:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as resp:
                    body["model"] = json.load(resp)["data"][0]["id"]
            if _post(f"{base}/v1/completions", body, timeout=30) == 200:
                return True
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.05)
    return False


# Log lines that mark startup phases (the server's log lines start with a timestamp).
_MILESTONES = {
    "API process imported (it spawns the core next)": "pagoda.serve: serving",
    "engine core: model loaded, KV cache allocating": "KV cache:",
    "engine core ready": "engine ready",
    "first completion answered": "POST /v1/completions HTTP/1.1\" 200",
}


def timeline(log: Path, launched_at: float) -> list[tuple[str, float]]:
    """(milestone, seconds after launch) for each milestone found in the server log."""
    from datetime import datetime

    found: list[tuple[str, float]] = []
    lines = log.read_text(errors="replace").splitlines()
    for name, needle in _MILESTONES.items():
        for line in lines:
            if needle in line:
                try:
                    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                found.append((name, stamp - launched_at))
                break
    return found


def one_run(pagoda: str, serve_args: list[str], env: dict[str, str], timeout_s: float, log: Path) -> tuple[float, int]:
    port = free_port()
    cmd = [pagoda, "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with open(log, "w") as out:
        launched_at = time.time()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        try:
            ok = first_answer(f"http://127.0.0.1:{port}", proc, start + timeout_s)
            elapsed = time.monotonic() - start
        finally:
            peak = sampler.stop()
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if not ok:
        raise RuntimeError(f"no answer within {timeout_s:.0f} s; see {log}")
    for name, at in timeline(log, launched_at):
        print(f"    {at:6.2f} s  {name}")
    return elapsed, peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="each run gets a fresh, empty PAGODA_CACHE_DIR")
    p.add_argument("--pagoda", default=str(ROOT / ".venv" / "bin" / "pagoda"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the first answer")
    p.add_argument("--log-dir", default=None, help="where the server logs go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    p.add_argument("serve_args", nargs="*", help="after --: extra `pagoda serve` flags")
    ns = p.parse_args(argv)
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="pagoda-startup-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    times, peaks = [], []
    for i in range(ns.runs):
        env = dict(os.environ)
        cache = None
        if ns.cold:
            cache = tempfile.TemporaryDirectory(prefix="pagoda-cold-cache-")
            env["PAGODA_CACHE_DIR"] = cache.name
        try:
            elapsed, peak = one_run(ns.pagoda, ns.serve_args, env, ns.timeout, log_dir / f"server-{i}.log")
        finally:
            if cache is not None:
                cache.cleanup()
        times.append(elapsed)
        peaks.append(peak)
        print(f"run {i + 1}/{ns.runs}: first answer {elapsed:.2f} s, peak RSS {peak / 2**20:.0f} MiB", flush=True)
    kind = "cold cache" if ns.cold else "warm cache"
    print(
        f"pagoda serve ({kind}), median of {ns.runs}: first answer {statistics.median(times):.2f} s, "
        f"peak RSS of the process tree {statistics.median(peaks) / 2**20:.0f} MiB (logs in {log_dir})"
    )
    if ns.json:
        record = {"cold": ns.cold, "first_answer_s": times, "peak_rss_bytes": peaks}
        Path(ns.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
