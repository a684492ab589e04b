"""A server started with flags (issue 5): vLLM's engine flags, several served model names, API keys
(401), a per-key requests-per-second and tokens-per-minute limit (429 with Retry-After), a bound on
the waiting queue (429), tenant priorities reaching the scheduler, the per-request timeout (504,
blocks freed), and, last, the death of its engine core (503, in-flight error, exit code 1).

The server runs one sequence at a time (--max-num-seqs 1) with priority scheduling, so that a
long request makes later ones wait in a known order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from serve_helpers import SMALL_ENGINE_ARGS, ServerProcess, wait_for

pytestmark = pytest.mark.slow

KEYS_FILE = """\
# key           requests/s  tokens/min  priority
sk-open
sk-limited      2
sk-tokens       -           8
sk-low          -           -           5
sk-high         rps=-       priority=0
"""
TIMEOUT_S = 8
LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS_FILE)
    srv = ServerProcess([
        *SMALL_ENGINE_ARGS, "--served-model-name", "smol", "pagoda-small",
        "--api-keys-file", str(keys), "--api-key", "sk-flag",
        "--scheduling-policy", "priority", "--max-num-seqs", "1",
        "--max-waiting-requests", "2", "--request-timeout", str(TIMEOUT_S),
    ]).start()
    try:
        srv.wait_ready(probe_headers=auth("sk-open"))
        yield srv
    finally:
        already_exited = srv.proc.poll() is not None  # the engine-core test ends it
        code = srv.stop()
        if not already_exited:
            assert code == 0, f"server did not stop cleanly (exit {code}):\n{srv.log_tail()}"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=auth("sk-open")) as c:
        yield c


def stats(http: httpx.Client) -> dict:
    r = http.get("/v1/engine/stats")
    assert r.status_code == 200, r.text
    return r.json()


def idle_and_free(http: httpx.Client):
    s = stats(http)
    ok = s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_usable_blocks"]
    return s if ok else None


def assert_error(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == type_
    return err


def test_api_keys(server, http):
    body = {"prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        assert_error(anon.post("/v1/completions", json=body), 401, "authentication_error")
        assert_error(anon.get("/v1/models"), 401, "authentication_error")
        r = anon.post("/v1/completions", json=body, headers=auth("sk-wrong"))
        err = assert_error(r, 401, "authentication_error")
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert_error(anon.post("/tokenize", json={"prompt": "x"}), 401, "authentication_error")
        # Health and version stay public (for load balancers and probes).
        assert anon.get("/health").status_code == 200
        assert anon.get("/version").status_code == 200
    # Keys from the flag and from the file work, with the openai client too.
    for key in ("sk-flag", "sk-open"):
        c = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        assert c.completions.create(model="smol", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="sk-nope", max_retries=0).models.list()


def test_requests_per_second_limit(server, http):
    async def burst() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=auth("sk-limited")) as ac:
            t0 = time.monotonic()
            rs = await asyncio.gather(*(ac.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                                        for _ in range(10)))
            return rs, time.monotonic() - t0

    responses, spread = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(limited) == 10
    # The bucket holds 2 and refills 2 per second: 2 pass at once, the rest are refused unless the
    # burst itself took long enough for the bucket to refill.
    assert 2 <= len(ok) <= 2 + int(2 * spread)
    assert len(limited) >= 1
    for r in limited:
        err = assert_error(r, 429, "rate_limit_error")
        assert err["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
    # A client that obeys Retry-After gets through.
    time.sleep(int(limited[0].headers["retry-after"]))
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers=auth("sk-limited"), timeout=60)
    assert r.status_code == 200, r.text
    # Other tenants are not limited by it.
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_tokens_per_minute_limit(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=auth("sk-tokens")) as c:
        first = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True})
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["total_tokens"]
        assert used > 8  # the bucket (8 per minute) is now in debt
        r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 1})
        err = assert_error(r, 429, "rate_limit_error")
        assert "tokens per minute" in err["message"]
        # It refills at 8 per minute: the debt plus the next prompt takes well over a few seconds.
        assert int(r.headers["retry-after"]) >= 3


def test_queue_bound_and_tenant_priority(server, http):
    assert idle_and_free(http)
    order: list[str] = []

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            async def short(name: str, key: str, extra: dict) -> None:
                body = {"prompt": f"Tenant {name} says", "max_tokens": 3, "ignore_eos": True, "stream": True, **extra}
                async with ac.stream("POST", "/v1/completions", json=body, headers=auth(key)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            assert "error" not in json.loads(line[6:])
                order.append(name)

            async with ac.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                                 headers=auth("sk-open")) as blocker:
                lines = blocker.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # the long request is running; the single slot is taken
                # A arrives first but its tenant's priority (5) is worse than B's (0); asking for
                # a more urgent priority than its tenant's does not help it.
                a = asyncio.create_task(short("A", "sk-low", {"priority": -10}))
                await asyncio.sleep(0)
                while stats(http)["num_waiting"] < 1:
                    await asyncio.sleep(0.02)
                b = asyncio.create_task(short("B", "sk-high", {}))
                while stats(http)["num_waiting"] < 2:
                    await asyncio.sleep(0.02)
                # Two are waiting: the bound is reached.
                full = await ac.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                                     headers=auth("sk-open"))
                # Leaving this block disconnects the long request, freeing the slot.
            await asyncio.gather(a, b)
            return full

    full = asyncio.run(run())
    err = assert_error(full, 429, "rate_limit_error")
    assert err["code"] == "queue_full" and int(full.headers["retry-after"]) >= 1
    assert order == ["B", "A"]
    wait_for(lambda: idle_and_free(http), 30, what="idle engine")


def test_request_timeout_aborts_and_frees_blocks(server, http):
    before = stats(http)

    async def run() -> tuple[httpx.Response, tuple[int, str, list[str]], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=auth("sk-open")) as ac:
            async def streamed() -> tuple[int, str, list[str]]:
                async with ac.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as s:
                    if s.status_code != 200:
                        return s.status_code, (await s.aread()).decode(), []
                    return 200, "", [line async for line in s.aiter_lines() if line.startswith("data: ")]

            t0 = time.monotonic()
            whole, events = await asyncio.gather(ac.post("/v1/completions", json=LONG), streamed())
            return whole, events, time.monotonic() - t0

    # Both time out (one while running, the other while waiting for the single slot).
    whole, (status, body, events), elapsed = asyncio.run(run())
    err = assert_error(whole, 504, "timeout_error")
    assert err["code"] == "request_timeout"
    assert elapsed >= TIMEOUT_S - 0.5
    if status == 200:  # the streamed one ran first: an error event, then [DONE]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
    else:  # it waited for the slot: a stream's headers wait for its first token, so the 504 is HTTP's
        assert status == 504 and json.loads(body)["error"]["code"] == "request_timeout", body
    after = wait_for(lambda: idle_and_free(http), 30, what="blocks freed after the timeouts")
    assert after["num_aborted_requests"] == before["num_aborted_requests"] + 2
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_served_model_names_and_engine_flags(server, http):
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["smol", "pagoda-small"]
    assert all(m["max_model_len"] == 2048 for m in models)  # --max-model-len
    for name in ("smol", "pagoda-small"):
        r = http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == name
    assert stats(http)["num_usable_blocks"] == 399  # --num-gpu-blocks-override 400 (one is the null block)


# Must stay last: it kills this module's server.
def test_dead_engine_core_fails_requests_and_exits_nonzero(server, http):
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-open", max_retries=0, timeout=60)
    core_pid = stats(http)["pid"]
    assert core_pid and core_pid != server.proc.pid
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices
    os.kill(core_pid, signal.SIGKILL)
    t0 = time.monotonic()
    # The in-flight stream ends with an error at once, not a hang.
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "engine" in err.value.message
    # /health answers 503 until the server exits (it lingers briefly so that probes can see it),
    # and new work is refused with 503.
    seen: list[int] = []
    while time.monotonic() - t0 < 15 and server.proc.poll() is None:
        try:
            seen.append(http.get("/health").status_code)
        except httpx.TransportError:
            break
        if seen[-1] == 503:
            r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert_error(r, 503, "service_unavailable_error")
            break
        time.sleep(0.05)
    assert 503 in seen, seen
    code = server.wait_exit(15 - (time.monotonic() - t0) + 1)
    assert code == 1, f"exit code {code}:\n{server.log_tail()}"
    assert time.monotonic() - t0 < 15
