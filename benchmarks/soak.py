"""A soak of `pagoda serve`: sustained mixed traffic for minutes, and the server's memory over time.

Starts the server (API process plus engine core) on the default model, sends Poisson arrivals of
streamed completions with random 32-400-token prompts, cancels some mid-stream and mixes in malformed
requests, and samples the resident memory of the whole process tree. At the end it checks that
every KV block is free (`pagoda:kv_cache_usage_perc` 0 on /metrics) and that the server still answers.

    python benchmarks/soak.py --duration 300 --rate 1.5 --json benchmarks/results/soak.json
    python benchmarks/soak.py --server-cmd "python -m pagoda.cli serve"   # another build

RSS is the sum of VmRSS over the processes (shared pages counted in each: an upper bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

MALFORMED = [  # (body, what it gets wrong); each must be refused with a 4xx, never break the server
    (b"{not json", "invalid JSON"),
    (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": -1}).encode(), "max_tokens < 0"),
    (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": ""}).encode(), "empty prompt"),
    (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": [10**9]}).encode(), "token id out of range"),
    (json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": "hot"}).encode(), "a string temperature"),
]


def tree_rss_bytes(root: int) -> tuple[int, int]:
    """(VmRSS summed over `root` and its descendants, `root`'s own VmRSS) (Linux /proc): the server's
    whole footprint, and the API process's part of it (the rest is the engine core)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, own, stack = 0, 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                    total += rss
                    own = rss if pid == root else own
        except OSError:
            pass
    return total, own


async def one_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, counts: dict) -> None:
    if rng.random() < 0.05:
        body, _ = rng.choice(MALFORMED)
        r = await client.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
        counts["malformed_refused" if 400 <= r.status_code < 500 else "malformed_not_refused"] += 1
        return
    prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(32, 400))]
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(16, 128), "temperature": 0.8,
            "seed": rng.randrange(2**31), "stream": True, "ignore_eos": True}
    cancel_after = rng.randint(1, 8) if rng.random() < 0.1 else None
    events = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                counts["errors"] += 1
                return
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events += 1
                    if cancel_after is not None and events >= cancel_after:
                        counts["cancelled"] += 1
                        return  # leaving the block closes the connection mid-stream
        counts["completed"] += 1
    except httpx.HTTPError:
        counts["errors"] += 1


async def traffic(url: str, model: str, rate: float, duration: float, seed: int, root: int, sample_s: float) -> dict:
    rng = random.Random(seed)
    counts = {k: 0 for k in ("completed", "cancelled", "errors", "malformed_refused", "malformed_not_refused")}
    samples: list[tuple[float, int, int]] = []  # (seconds, tree RSS, API process RSS)
    load: list[tuple[float, float, float, float]] = []  # (seconds, running, waiting, KV usage)
    start = time.monotonic()

    async def sampler(client: httpx.AsyncClient) -> None:
        while True:
            now = time.monotonic() - start
            samples.append((now, *tree_rss_bytes(root)))
            try:
                gauges = read_gauges((await client.get(f"{url}/metrics")).text)
                load.append((now, gauges.get("num_requests_running", -1), gauges.get("num_requests_waiting", -1),
                             gauges.get("kv_cache_usage_perc", -1)))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(sample_s)

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sampling = asyncio.create_task(sampler(client))
        tasks = []
        next_at = 0.0
        while next_at < duration:
            await asyncio.sleep(max(0.0, start + next_at - time.monotonic()))
            tasks.append(asyncio.create_task(one_request(client, url, model, rng, counts)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        sampling.cancel()
        traffic_end = time.monotonic() - start
        samples.append((traffic_end, *tree_rss_bytes(root)))
        metrics = (await client.get(f"{url}/metrics")).text
        health = (await client.get(f"{url}/health")).status_code
    usage = read_gauges(metrics)["kv_cache_usage_perc"]
    return {"counts": counts, "samples": samples, "load": load, "kv_usage_end": usage, "health_end": health,
            "elapsed_s": traffic_end}


def read_gauges(metrics: str) -> dict[str, float]:
    """The engine gauges of a /metrics body, by name without the `pagoda:` prefix."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("pagoda:") and "{" in line:
            name = line[len("pagoda:"):line.index("{")]
            if name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                out[name] = float(line.split()[-1])
    return out


def rss_at(samples: list[tuple[float, int, int]], t: float) -> int:
    return min(samples, key=lambda s: abs(s[0] - t))[1]


def summarize(result: dict, duration: float) -> dict:
    samples = result["samples"]
    mib = 1024**2
    tail = [rss for t, rss, _ in samples if duration * 2 / 3 <= t <= duration]
    return {
        # Later than the arrivals' end: the server was behind (check it before reading any RSS figure).
        "last_answer_s": round(result["elapsed_s"], 1),
        **{f"rss_mib_at_{int(t)}s": round(rss_at(samples, t) / mib) for t in (duration / 3, duration * 2 / 3, duration)},
        "peak_rss_mib": round(max(r for _, r, _ in samples) / mib),
        "peak_api_rss_mib": round(max(a for _, _, a in samples) / mib),
        "max_running": max((r for _, r, _, _ in result["load"]), default=None),
        "max_waiting": max((w for _, _, w, _ in result["load"]), default=None),
        "peak_kv_usage": max((u for _, _, _, u in result["load"]), default=None),
        "steady_rss_mib": round(statistics.median(tail) / mib) if tail else None,  # median of the last third
        "kv_usage_end": result["kv_usage_end"],
        "health_end": result["health_end"],
        **result["counts"],
    }


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--server-cmd", default=f"{shlex.quote(sys.executable)} -m pagoda serve",
                   help="how to start the server (--port is appended)")
    p.add_argument("--json", help="write the summary and every RSS sample here")
    ns = p.parse_args()
    url = f"http://127.0.0.1:{ns.port}"
    cmd = shlex.split(ns.server_cmd) + ["--port", str(ns.port)]
    log = open(f"/tmp/soak-server-{ns.port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        result = asyncio.run(traffic(url, ns.model, ns.rate, ns.duration, ns.seed, proc.pid, ns.sample_s))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary = {"cmd": " ".join(cmd), "duration_s": ns.duration, "rate": ns.rate, **summarize(result, ns.duration)}
    print(json.dumps(summary, indent=1))
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps({**summary, "samples": result["samples"], "load": result["load"]}, indent=1))


if __name__ == "__main__":
    main()
