"""Units of the standalone router (`pagoda.serve.router_app`, `router_backends`): what a request's
prefix is made of, and the backend pool's ejection and re-admission over a mocked transport. The
real thing, over two `pagoda serve` processes, is tests/serve/test_router.py."""

from __future__ import annotations

import asyncio

import httpx

from pagoda.serve.router_app import BLOCK_BYTES, prompt_units
from pagoda.serve.router_backends import BackendPool


def test_prompt_units():
    assert prompt_units("/v1/completions", {"prompt": "ab"}) == [97, 98]
    assert prompt_units("/v1/completions", {"prompt": ["ab", "zz"]}) == [97, 98]  # the first prompt decides
    assert prompt_units("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_units("/v1/completions", {"prompt": [[5, 6], [7]]}) == [5, 6]
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert bytes(prompt_units("/v1/chat/completions", chat)) == b"<|system|>S<|user|>U"
    # Two chats with the same system message share their first blocks' units.
    long = {"messages": [{"role": "system", "content": "x" * (3 * BLOCK_BYTES)}, {"role": "user", "content": "a"}]}
    other = {"messages": [{"role": "system", "content": "x" * (3 * BLOCK_BYTES)}, {"role": "user", "content": "b"}]}
    a, b = prompt_units("/v1/chat/completions", long), prompt_units("/v1/chat/completions", other)
    assert a[:3 * BLOCK_BYTES] == b[:3 * BLOCK_BYTES] and a != b
    assert prompt_units("/v1/completions", None) == [] and prompt_units("/v1/completions", {"prompt": 3}) == []


def test_pool_ejects_on_a_failed_check_and_readmits_after_enough_passes():
    answers = {"http://a:1": 200, "http://b:1": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if answers[base] is None:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/load":
            return httpx.Response(200, json={"num_requests_waiting": 3})
        return httpx.Response(answers[base])

    readmitted: list[int] = []

    async def main() -> None:
        pool = BackendPool(["http://a:1", "http://b:1/"], health_interval=60, readmit_after=2,
                           on_readmit=readmitted.append)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            pool._client = client
            await pool.check_all()  # a first pass is not enough with readmit_after=2
            assert pool.loads() == {}
            await pool.check_all()
            assert pool.loads() == {0: 0, 1: 0} and readmitted == [0, 1]
            assert pool.backends[1].url == "http://b:1" and pool.backends[0].load == {"num_requests_waiting": 3}
            answers["http://b:1"] = None
            await pool.check_all()
            assert pool.loads() == {0: 0} and "ConnectError" in pool.backends[1].last_error
            answers["http://b:1"] = 503
            await pool.check_all()
            assert pool.backends[1].last_error == "/health answered 503"
            answers["http://b:1"] = 200
            await pool.check_all()
            assert 1 not in pool.loads()  # one pass of two
            await pool.check_all()
            assert pool.loads() == {0: 0, 1: 0} and readmitted == [0, 1, 1]

    asyncio.run(main())
