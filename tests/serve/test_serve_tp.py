"""`pagoda serve --tensor-parallel-size 2`: the default model over two worker processes through the
OpenAI client, streaming included; then one worker killed: the request in flight ends with an
error, /health answers 503 and the server exits 1, within 10 s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_helpers import SMALL_ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess([*SMALL_ENGINE_ARGS, "--tensor-parallel-size", "2"]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        already_exited = srv.proc.poll() is not None  # the kill test ends it
        code = srv.stop()
        if not already_exited:
            assert code == 0, f"server did not stop cleanly (exit {code}):\n{srv.log_tail()}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _workers(core_pid: int) -> list[int]:
    """The engine core's worker processes (pagoda.exec.worker), from /proc."""
    children = Path(f"/proc/{core_pid}/task/{core_pid}/children").read_text().split()
    return [int(pid) for pid in children if b"pagoda.exec.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_completions_and_chat_with_and_without_streaming(server, client):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert len(_workers(http.get("/v1/engine/stats").json()["pid"])) == 2
    model = client.models.list().data[0].id
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert whole and streamed == whole
    assert "Paris" in whole
    messages = [{"role": "user", "content": "What is the capital of Germany?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chat.choices[0].message.content and streamed == chat.choices[0].message.content


# Must stay last: it kills this module's server.
def test_killed_worker_fails_requests_turns_health_503_and_exits_nonzero(server, client):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        workers = _workers(http.get("/v1/engine/stats").json()["pid"])
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="Once upon a time",
                                           max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        assert "worker rank 1" in err.value.message, err.value.message
        seen = []
        while time.monotonic() - t0 < 10 and server.proc.poll() is None:
            try:
                seen.append(http.get("/health").status_code)
            except httpx.TransportError:
                break
            if seen[-1] == 503:
                break
            time.sleep(0.05)
        assert 503 in seen, seen
    code = server.wait_exit(10 - (time.monotonic() - t0))
    assert code == 1, f"exit code {code} after {time.monotonic() - t0:.1f} s:\n{server.log_tail()}"
    assert time.monotonic() - t0 < 10
    for pid in workers:  # no worker outlives the server
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
