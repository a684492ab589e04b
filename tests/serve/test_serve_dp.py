"""`pagoda serve --data-parallel-size 2` on a tiny random model: two engine-core processes behind one
server. Under load one replica's core is killed: requests it had not started streaming move to the
other replica and succeed, those mid-stream end with an error event, every request on the other
replica succeeds, /health stays 200, /ready shows the replica down and then up again within 30 s,
and it serves again. /load and /metrics carry each replica (vLLM's `engine` label)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time

import httpx
import pytest

from serve_helpers import ServerProcess

pytestmark = pytest.mark.slow

MAX_TOKENS = 1800


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny_dp")
    save_tiny_model("llama3", folder, max_position_embeddings=2048)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess([str(tiny_model), "-dp", "2", "--routing-policy", "round_robin", "--dtype", "float32",
                         "--max-model-len", "2048", "--num-gpu-blocks-override", "600", "--max-num-seqs", "2"]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server did not stop cleanly (exit {code}):\n{srv.log_tail()}"


class Run:
    """One streamed completion: its id, the chunks it got, how it ended."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.chunks = 0
        self.tokens = 0  # completion tokens, from the usage chunk
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.done = False


async def _stream(http: httpx.AsyncClient, prompt: str, run: Run) -> None:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        run.request_id = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                run.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                run.error = event["error"]["message"]
                continue
            if event.get("usage"):
                run.tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                run.chunks += 1
                run.finish_reason = choice["finish_reason"] or run.finish_reason


async def _replica_of(http: httpx.AsyncClient, request_id: str) -> int | None:
    r = await http.get(f"/v1/requests/{request_id}/timeline")
    if r.status_code != 200:
        return None
    first = r.json()["sequences"][0]["events"][0]
    assert first["event"] == "routed", first
    return first["replica"]


def test_replica_killed_under_load(server):
    asyncio.run(_killed_under_load(server))


async def _killed_under_load(server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        load = (await http.get("/load")).json()
        assert [r["engine"] for r in load["replicas"]] == ["0", "1"]
        assert all(r["status"] == "up" for r in load["replicas"])
        pids = {int(r["engine"]): r["pid"] for r in load["replicas"]}
        assert len(set(pids.values())) == 2
        runs = [Run() for _ in range(10)]
        # Both cores are frozen while the requests arrive and then run in short bursts, one replica after
        # the other, until each has streamed its two running requests: so the streams that started are
        # known by replica without asking the (frozen) replicas, and replica 1's are surely mid-stream when
        # it is killed, however far behind this client or the server falls on a loaded machine.
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        tasks = [asyncio.create_task(_stream(http, f"w{10 + i} w{20 + i} w{30 + i}", run)) for i, run in enumerate(runs)]
        # Round robin: five on each replica, two running there and three waiting (--max-num-seqs 2). A
        # stream's headers (its request id) come with its first token, so the waiting ones have none yet.
        try:
            on_0 = await _run_in_bursts(pids[0], runs, 2)
            on_1 = [r for r in await _run_in_bursts(pids[1], runs, 4) if r not in on_0]
            os.kill(pids[1], signal.SIGKILL)
        finally:
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):  # replica 1 is gone once reaped
                    os.kill(pid, signal.SIGCONT)
        killed_at = time.monotonic()
        started = on_0 + on_1
        replica = {r.request_id: 0 for r in on_0} | {r.request_id: 1 for r in on_1}
        assert len(on_0) == 2 and len(on_1) == 2
        # Still healthy: the other replica serves.
        health = await http.get("/health")
        assert health.status_code == 200, health.text
        ready = await wait_ready_replicas(http, lambda n: n == 1, 10)
        assert ready["replicas"][1]["status"] in ("restarting", "starting")
        await asyncio.gather(*tasks)
        ready = await wait_ready_replicas(http, lambda n: n == 2, 30 - (time.monotonic() - killed_at))
        assert time.monotonic() - killed_at < 30
        assert ready["replicas"][1]["restarts"] == 0 and ready["replicas"][1]["pid"] != pids[1]

        for r in started:
            if replica[r.request_id] == 0:  # the other replica's requests never noticed
                assert await _replica_of(http, r.request_id) == 0
                assert r.error is None and r.finish_reason == "length" and r.tokens == MAX_TOKENS and r.done
            else:  # mid-stream on the killed replica: an error event, then [DONE]
                assert r.error and "engine" in r.error and r.finish_reason is None and r.done, vars(r)
        waiting = [r for r in runs if r not in started]
        for r in waiting:  # the killed replica's moved to replica 0; all ran in full there
            assert r.error is None and r.finish_reason == "length" and r.tokens == MAX_TOKENS, vars(r)
            assert await _replica_of(http, r.request_id) == 0

        # The restarted replica serves again.
        again = [Run() for _ in range(2)]
        for i, run in enumerate(again):
            await _stream_short(http, f"w{40 + i}", run)
        assert sorted([await _replica_of(http, r.request_id) for r in again]) == [0, 1]
        metrics = (await http.get("/metrics")).text
        for engine in ("0", "1"):
            assert re.search(r'^pagoda:num_requests_running\{[^}]*engine="%s"' % engine, metrics, re.M), metrics
    log = server.log_tail(1_000_000)
    assert "replica 1 died" in log and "replica 1 serves again" in log
    assert re.search(r"routed to replica 1 \(round_robin, round_robin\)", log)
    # The killed replica's three waiting requests were among those moved.
    assert log.count("replica 1 died before the request streamed anything; retried on replica 0") == 3


async def _run_in_bursts(pid: int, runs: list[Run], want: int) -> list[Run]:
    """Let a frozen engine core run for 30 ms at a time until `want` streams have started; it is frozen
    again on return. A burst decodes a few dozen tokens at most, far from a request's MAX_TOKENS."""
    deadline = time.monotonic() + 120
    while len(started := [r for r in runs if r.chunks]) < want:
        assert time.monotonic() < deadline, f"only {len(started)} of {want} requests started streaming"
        os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.03)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(0.1)  # the server and this client take in what the burst produced
    return started


async def _stream_short(http: httpx.AsyncClient, prompt: str, run: Run) -> None:
    r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    run.request_id = r.headers["x-request-id"]
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def wait_ready_replicas(http: httpx.AsyncClient, want, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        r = await http.get("/ready")
        last = r.json()
        up = sum(1 for x in last["replicas"] if x["status"] == "up")
        if want(up):
            assert r.status_code == 200  # one replica up is enough to be ready
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"/ready did not reach the replica count in {timeout:.0f} s: {last}")
