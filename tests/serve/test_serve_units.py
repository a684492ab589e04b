"""Fast tests of the service layer's parts that need no model: the API keys file, token buckets,
tenant priorities, request models and the error shape (over HTTP, with no engine behind the app),
delta merging, a request the engine client cannot send, the startup heap frozen once ready; and
`pagoda serve` failing cleanly: exit 2 with one line on stderr for bad arguments, a missing device
(before anything starts), and a model or KV cache size the engine core cannot start with."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.serve.tenants import ANONYMOUS, Tenant, TokenBucket, build_registry, parse_api_keys
from serve_helpers import REPO, ServerProcess, free_port


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# -- token buckets and tenants ------------------------------------------------------------------------
def test_token_bucket_burst_refill_and_wait():
    clock = FakeClock()
    b = TokenBucket(2.0, 2.0, clock)
    assert b.try_take() == 0.0 and b.try_take() == 0.0
    assert b.try_take() == pytest.approx(0.5)  # one token comes back in half a second
    clock.t += 0.5
    assert b.try_take() == 0.0
    clock.t += 100
    assert b.level == pytest.approx(2.0)  # never above capacity
    b.charge(5)
    assert b.level == pytest.approx(-3.0)
    assert b.try_take(1.0) == pytest.approx(2.0)  # from -3 to 1 at 2 per second


def test_tenant_limits_and_priority():
    clock = FakeClock()
    t = Tenant("t", requests_per_second=2, tokens_per_minute=60, priority=5, clock=clock)
    assert [t.take_request() == 0.0 for _ in range(3)] == [True, True, False]
    assert t.take_prompt_tokens(50) == 0.0
    t.charge_tokens(30)  # 60 - 50 - 30 = -20
    wait = t.take_prompt_tokens(10)
    assert wait == pytest.approx(30.0)  # to 10 tokens at 1 per second
    # A request larger than the whole bucket passes on a full bucket (else it never could).
    clock.t += 1000
    assert t.take_prompt_tokens(500) == 0.0
    assert t.effective_priority(None) == 5
    assert t.effective_priority(9) == 9
    assert t.effective_priority(-3) == 5  # no more urgent than the tenant allows
    assert ANONYMOUS.effective_priority(None) == 0 and ANONYMOUS.effective_priority(-3) == -3
    assert ANONYMOUS.take_request() == 0.0 and ANONYMOUS.take_prompt_tokens(10**9) == 0.0


def test_parse_api_keys_lines_and_json(tmp_path):
    lines = """
    # comment
    sk-a
    sk-b 2 1000 3      # positional
    sk-c - 500
    sk-d rps=0.5 priority=-1 name=team-d
    """
    parsed = dict(parse_api_keys(lines))
    assert set(parsed) == {"sk-a", "sk-b", "sk-c", "sk-d"}
    assert parsed["sk-a"].requests_per_second is None and parsed["sk-a"].priority is None
    b = parsed["sk-b"]
    assert (b.requests_per_second, b.tokens_per_minute, b.priority) == (2, 1000, 3)
    assert parsed["sk-c"].requests_per_second is None and parsed["sk-c"].tokens_per_minute == 500
    d = parsed["sk-d"]
    assert (d.name, d.requests_per_second, d.priority) == ("team-d", 0.5, -1)

    as_list = parse_api_keys('[{"key": "k1", "requests_per_second": 2, "priority": 1}, "k2"]')
    assert [k for k, _ in as_list] == ["k1", "k2"] and as_list[0][1].priority == 1
    as_map = dict(parse_api_keys('{"k1": {"tokens_per_minute": 100, "name": "x"}, "k2": null}'))
    assert as_map["k1"].tokens_per_minute == 100 and as_map["k1"].name == "x"

    f = tmp_path / "keys.json"
    f.write_text('[{"key": "from-file", "rps": 1}]')
    reg = build_registry(["from-flag"], str(f))
    assert len(reg) == 2 and reg.enabled
    assert reg.lookup("from-file").requests_per_second == 1
    assert reg.lookup("from-flag").requests_per_second is None
    assert reg.lookup("nope") is None and reg.lookup(None) is None and reg.lookup("") is None
    assert not build_registry(None, None).enabled


@pytest.mark.parametrize(
    "text",
    [
        "sk-a 0",  # rps must be > 0
        "sk-a x",
        "sk-a 1 2 3 4",  # too many fields
        "sk-a priority=high",
        "sk-a colour=blue",
        '[{"rps": 1}]',  # no key
        '[{"key": "k", "bogus": 1}]',
        '[{"key": "k", "priority": 1.5}]',
        "[1]",
    ],
)
def test_parse_api_keys_rejects_bad_entries(text):
    with pytest.raises(ValueError):
        parse_api_keys(text)


# -- request models -------------------------------------------------------------------------------------
def test_request_models_map_to_sampling_params():
    from pagoda.serve.protocol import ChatCompletionRequest, CompletionRequest

    c = CompletionRequest(prompt="hi", temperature=0, top_k=-1, stop="x", stop_token_ids=[5], min_tokens=1,
                          logprobs=2, seed=3, n=2, ignore_eos=True, repetition_penalty=1.1, min_p=0.1)
    p = c.to_sampling_params()
    assert (p.temperature, p.top_k, p.stop, p.stop_token_ids, p.logprobs, p.seed, p.n) == (0, 0, ["x"], [5], 2, 3, 2)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.repetition_penalty, p.min_p) == (16, 1, True, 1.1, 0.1)
    assert c.prompts() == ["hi"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2]]).prompts() == [[1], [2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                                 max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=3)
    p = chat.to_sampling_params()
    assert p.max_tokens == 7 and p.logprobs == 3 and p.temperature == 1.0
    assert chat.messages[0].to_template_dict() == {"role": "user", "content": "a\nb"}
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params().max_tokens is None
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True).to_sampling_params().logprobs == 0


def test_openai_nullable_fields_take_their_default():
    # OpenAI's API documents n, stream, echo and (chat) logprobs as nullable; null means the default.
    from pagoda.serve.protocol import ChatCompletionRequest, CompletionRequest

    c = CompletionRequest.model_validate({"prompt": "x", "n": None, "stream": None, "echo": None})
    assert (c.n, c.stream, c.echo) == (1, False, False)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "n": None, "stream": None, "logprobs": None}
    )
    assert (chat.n, chat.stream, chat.logprobs) == (1, False, False)
    assert chat.to_sampling_params().logprobs is None


# -- bad bodies over HTTP: a 400 in OpenAI's shape before anything reaches the engine -----------------
class _NoEngine:
    """Stands in for the engine: any use of it fails the request (with a 500), so a test that gets its
    400 shows that validation turned the body away first."""

    def __getattr__(self, name: str):
        raise AssertionError(f"a bad request reached the engine (.{name})")


@pytest.fixture
def api():
    from fastapi.testclient import TestClient

    from pagoda.serve.app import ServerConfig, ServerState, build_app

    state = ServerState(ServerConfig(served_model_names=["m"]), _NoEngine())
    state.status = "ready"
    # Not entered as a context manager: the lifespan, which would start the engine, does not run.
    return TestClient(build_app(state), raise_server_exceptions=False)


def _assert_400(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


CHAT = [{"role": "user", "content": "x"}]


def test_echo_with_max_tokens_0_and_min_tokens_is_400_naming_max_tokens_0(api):
    # The engine request of an echo with max_tokens=0 asks for one token: the error said "(1)".
    err = _assert_400(api.post("/v1/completions", json={"prompt": "x", "echo": True, "max_tokens": 0,
                                                        "min_tokens": 2}), "min_tokens")
    assert "max_tokens (0)" in err["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "top_k": 2**64}, "top_k"),
        ("/v1/completions", {"prompt": "x", "priority": -(2**64)}, "priority"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**30]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 2**64, "max_tokens": None}, "min_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "priority": 10**30}, "priority"),
    ],
)
def test_integers_beyond_64_bits_are_400(api, path, body, param):
    # Requests reach the engine core as msgpack, which holds 64-bit integers: a larger one was a 500
    # (OverflowError) that also left the request counted as in flight for good.
    _assert_400(api.post(path, json=body), param)


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
        ("/v1/completions", r'{"prompt": ["fine", "\udfff"]}', "prompt"),
        ("/v1/completions", r'{"prompt": "x", "stop": ["\ud800"]}', "stop"),
        ("/v1/completions", r'{"prompt": "x", "model": "\ud800"}', "model"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
        ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ],
)
def test_lone_surrogates_are_400(api, path, raw, param):
    # Valid JSON, invalid Unicode: the tokenizer (TypeError), the msgpack encoder and the 404 message
    # for such a model name (UnicodeEncodeError) all failed on it, with a 500.
    err = _assert_400(api.post(path, content=raw.encode(), headers={"content-type": "application/json"}), param)
    assert "Unicode" in err["message"]


@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
    ('{"prompt": "x", "top_p": NaN}', "top_p"),
])
def test_nan_and_infinity_are_400(api, raw, param):
    # Python's JSON parser accepts these non-standard numbers; no sampling knob means them.
    r = api.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = _assert_400(r, param)
    assert "finite" in err["message"]


def _stub_engine(tmp_path, send=None, tokenizer=None):
    """An AsyncLLM that never starts its core: `send` stands in for the client's, as if the core were
    ready (no tokenizer unless given)."""
    from pagoda.config import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.contracts.messages import EngineCoreReady

    (tmp_path / "config.json").write_text("{}")  # enough for the engine to accept the folder
    engine = AsyncLLM(EngineArgs.from_kwargs(model=str(tmp_path)), tokenizer=tokenizer)
    engine.client.send = send  # the client is never started: nothing else of it runs
    engine._on_ready(EngineCoreReady(max_model_len=64, vocab_size=100, num_blocks=10, num_usable_blocks=9,
                                     block_size=16, model_name="m"), tokenizer)
    return engine


def test_request_that_cannot_be_sent_leaves_nothing_in_flight(tmp_path):
    """A request that fails while being sent to the core (here: msgpack cannot encode it) must be
    forgotten, else it counts as in flight for good: the waiting-queue bound counts it and a drain
    waits for it until its timeout. Children already sent are aborted in the core."""
    from pagoda.contracts.messages import EngineCoreRequestType
    from pagoda.sampling_params import SamplingParams

    sent: list[bytes] = []

    def send(kind: bytes, payload: bytes = b"") -> None:
        if kind == EngineCoreRequestType.ADD and sent.count(kind) == 1:
            raise RuntimeError("the second child cannot be sent")
        sent.append(kind)

    engine = _stub_engine(tmp_path, send)

    with pytest.raises(OverflowError):  # nothing sent
        asyncio.run(engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[2**70]), "r1"))
    assert sent == []
    assert engine.num_inflight_requests() == 0 and engine.num_unfinished_sequences() == 0

    with pytest.raises(RuntimeError):  # the first of two children sent, then a failure
        asyncio.run(engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=4), "r2"))
    assert sent == [EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT]
    assert engine.num_inflight_requests() == 0 and engine.num_unfinished_sequences() == 0


def test_request_that_cannot_be_sent_refunds_its_tokens(tmp_path):
    """A tenant's tokens-per-minute budget pays for work the engine does: a request that fails while
    being sent (a 500, nothing generated) gives its prompt tokens back."""
    from fastapi.testclient import TestClient

    from pagoda.serve.app import ServerConfig, ServerState, build_app
    from pagoda.serve.tenants import TenantRegistry

    def send(kind: bytes, payload: bytes = b"") -> None:
        raise RuntimeError("the core is unreachable")

    tenant = Tenant("t", tokens_per_minute=60, clock=FakeClock())
    tenants = TenantRegistry()
    tenants.add("sk-t", tenant)
    state = ServerState(ServerConfig(served_model_names=["m"]), _stub_engine(tmp_path, send), tenants)
    state.status = "ready"
    api = TestClient(build_app(state), raise_server_exceptions=False)
    r = api.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2},
                 headers={"Authorization": "Bearer sk-t"})
    assert r.status_code == 500, r.text
    assert tenant._tokens.level == pytest.approx(60.0)  # was 55: charged for a request that never ran


def test_closing_a_stream_after_its_request_finished_aborts_nothing(tmp_path):
    """A request can finish in the core while its consumer has not read the final output yet (a
    client that goes away at that moment). Closing its stream then must neither send an abort nor
    report one: the request ended once, with its real reason, and metrics counted it so."""
    from pagoda.contracts.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequestType
    from pagoda.sampling_params import SamplingParams

    sent: list[bytes] = []
    engine = _stub_engine(tmp_path, lambda kind, payload=b"": sent.append(kind))
    aborted: list[str] = []
    engine.abort_listeners.append(aborted.append)
    params = SamplingParams(max_tokens=2)

    async def main() -> None:
        done = await engine.add_request([1, 2, 3], params, "done")
        live = await engine.add_request([1, 2, 3], params, "live")
        engine._handle_core_message(EngineCoreOutputs(outputs=[
            EngineCoreOutput("done", [5, 6], finish_reason="length"), EngineCoreOutput("live", [5]),
        ]))
        done.close()  # unread final output
        live.close()  # still running: a real abort
        assert sent == [EngineCoreRequestType.ADD] * 2 + [EngineCoreRequestType.ABORT]
        assert aborted == ["live"] and engine.num_inflight_requests() == 0

    asyncio.run(main())


def test_a_final_only_request_gets_its_whole_output_once(tmp_path):
    """A response that is not streamed reads its requests' outputs once, at their end: a final-only
    request's stream is handed one output, every step's delta folded into it, instead of a wake-up a
    step; the output listeners (metrics, the request log) still see each step's own delta, untouched
    by the folding."""
    from pagoda.contracts.messages import EngineCoreOutput, EngineCoreOutputs
    from pagoda.sampling_params import SamplingParams

    engine = _stub_engine(tmp_path, lambda kind, payload=b"": None)
    kept: list[list] = []
    engine.output_listeners.append(lambda msg, results: kept.append(results))
    params = SamplingParams(max_tokens=3)

    async def main() -> None:
        whole = await engine.add_request([1, 2, 3], params, "whole", final_only=True)
        steps = await engine.add_request([1, 2, 3], params, "steps")
        for new, reason in (([5], None), ([6], None), ([7], "length")):
            engine._handle_core_message(EngineCoreOutputs(outputs=[
                EngineCoreOutput(rid, new, finish_reason=reason) for rid in ("whole", "steps")]))
            assert whole._state.queue.qsize() == (1 if reason else 0)
        assert steps._state.queue.qsize() == 3
        outs = [out async for out in whole]
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].token_ids == [5, 6, 7] and outs[0].outputs[0].finish_reason == "length"
        assert [[r.outputs[0].token_ids for r in results] for results in kept] == [[[5], [5]], [[6], [6]], [[7], [7]]]
        steps.close()
        assert engine.num_inflight_requests() == 0

    asyncio.run(main())


def test_a_streamed_consumer_that_fell_behind_gets_one_delta_and_listeners_keep_theirs(tmp_path):
    """A stream read after several steps gets their deltas merged into one output; the merging works
    on a copy, so the outputs the listeners were handed (and may keep) still hold their own step."""
    from pagoda.contracts.messages import EngineCoreOutput, EngineCoreOutputs
    from pagoda.sampling_params import SamplingParams

    engine = _stub_engine(tmp_path, lambda kind, payload=b"": None)
    kept: list[list] = []
    engine.output_listeners.append(lambda msg, results: kept.append(results))

    async def main() -> None:
        stream = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3), "lagging")
        for new, reason in (([5], None), ([6], None), ([7], "length")):
            engine._handle_core_message(EngineCoreOutputs(outputs=[EngineCoreOutput("lagging", new, finish_reason=reason)]))
        outs = [out async for out in stream]
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].token_ids == [5, 6, 7] and outs[0].outputs[0].finish_reason == "length"
        assert [[r.outputs[0].token_ids for r in results] for results in kept] == [[[5]], [[6]], [[7]]]
        assert kept[0][0].outputs[0].finish_reason is None and not kept[0][0].finished

    asyncio.run(main())


def test_tokenization_runs_off_the_event_loop(tmp_path):
    """A long prompt takes seconds to tokenize: it must not stall the event loop, which streams every
    other request's tokens. The stand-in tokenizer blocks until the loop itself releases it, which
    it can only do if the encode runs elsewhere (inline, the encode would time out and return [])."""
    import threading

    started, release = threading.Event(), threading.Event()
    threads = []

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.get_ident())
        started.set()
        return [len(text), int(add_special_tokens)] if release.wait(10) else []

    engine = _stub_engine(tmp_path, tokenizer=SimpleNamespace(encode=encode))

    async def main() -> list[int]:
        task = asyncio.create_task(engine.tokenize_async("abc", add_special_tokens=False))
        await asyncio.to_thread(started.wait, 10)
        release.set()  # the loop runs this while the encode is still blocked
        return await task

    assert asyncio.run(main()) == [3, 0]
    assert threads and threads[0] != threading.get_ident()


def test_small_inputs_are_prepared_on_the_loop_and_large_ones_on_the_thread(tmp_path):
    """A short prompt is tokenized where it arrives (the hop to the tokenizer's thread would cost
    more than the encode, in every short request's first token); a prompt past QUICK_TEXT_CHARS, a
    structured request (its grammar is compiled) and a chat with tools still go to the thread. The
    results are the same either way."""
    import threading

    from pagoda.engine.input_processor import QUICK_TEXT_CHARS
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

    threads: list[int] = []

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.get_ident())
        return [len(text) % 90 + 1]

    engine = _stub_engine(tmp_path, tokenizer=SimpleNamespace(encode=encode))
    loop_thread = threading.get_ident()
    params = SamplingParams(max_tokens=2)
    structured = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    cases = [("hi", params, True), ("x" * QUICK_TEXT_CHARS, params, True), ("x" * (QUICK_TEXT_CHARS + 1), params, False),
             ("hi", structured, False)]
    for text, p, on_loop in cases:
        threads.clear()
        processed = asyncio.run(engine.process_inputs_async(text, p))
        assert processed.prompt_token_ids == [len(text) % 90 + 1]
        assert (threads == [loop_thread]) == on_loop, (len(text), p.structured_outputs)
        assert threads

    from pagoda.engine.input_processor import quick_to_render

    chat = [{"role": "user", "content": "hi"}]
    assert quick_to_render(chat) and not quick_to_render(chat, {"tools": [{"type": "function"}]})
    assert not quick_to_render([{"role": "user", "content": "x" * (QUICK_TEXT_CHARS + 1)}])
    assert not quick_to_render([{"role": "assistant", "content": "", "tool_calls": []}])


def test_merge_delta_concatenates():
    from pagoda.engine.request_stream import merge_delta

    def out(text, ids, reason=None, finished=False):
        lp = [{i: Logprob(-1.0, 1, str(i))} for i in ids]
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, list(ids), -1.0, lp, reason)], finished)

    acc = merge_delta(out("a", [1]), out("bc", [2, 3]))
    acc = merge_delta(acc, out("", [], "stop", True))
    c = acc.outputs[0]
    assert (c.text, c.token_ids, len(c.logprobs), c.finish_reason, acc.finished) == ("abc", [1, 2, 3], 3, "stop", True)


# -- pagoda serve failing cleanly ----------------------------------------------------------------------
def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_serve_takes_vllms_max_logprobs_flag():
    import argparse

    from pagoda.entrypoints.engine_args import engine_kwargs
    from pagoda.entrypoints.serve import add_serve_parser

    ns = add_serve_parser(argparse.ArgumentParser().add_subparsers()).parse_args(["--max-logprobs", "-1"])
    assert engine_kwargs(ns)["max_logprobs"] == -1  # the engine's cap, which requests are checked against


def test_bad_arguments_exit_2(tmp_path):
    r = _serve("/no/such/model", "--port", "1")
    assert r.returncode == 2 and "no such file" in r.stderr
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-a rps=0\n")
    r = _serve("--api-keys-file", str(keys), "--port", "1")
    assert r.returncode == 2 and "API keys" in r.stderr
    r = _serve("--port", "70000")
    assert r.returncode == 2 and "--port must be in [0, 65535]" in r.stderr
    r = _serve("--chat-template", str(tmp_path / "missing.jinja"), "--port", "1")
    assert r.returncode == 2 and "no such file, and not a Jinja template" in r.stderr


def _assert_usage_error(r: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2, no traceback, stderr ending with one `pagoda: error:` line that says `message`, and the
    server never reported ready."""
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 2, r.stderr
    assert last.startswith("pagoda: error: ") and message in last, r.stderr
    assert "Traceback" not in r.stderr and "ready to serve" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny_serve_units")
    save_tiny_model("llama3", folder)
    save_tiny_tokenizer(folder)
    return folder


def test_engine_core_that_cannot_load_its_model_exits_2(tmp_path):
    # resolve_model accepts the file (a .gguf that exists); only the core, parsing it, finds it broken.
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    started = time.monotonic()
    r = _serve(str(bad), "--host", "127.0.0.1", "--port", str(free_port()))
    _assert_usage_error(r, "not a readable GGUF file")
    assert time.monotonic() - started < 60  # used to linger 2 s in a dead state, then exit 1


def test_kv_cache_too_small_exits_2_at_once(tiny_model):
    # Found in the engine-core process, after uvicorn is up: the server still ends as for a usage
    # error, at once (not after the dead-engine grace period), with the core's reason as its line.
    started = time.monotonic()
    r = _serve(str(tiny_model), "--num-gpu-blocks-override", "1", "--dtype", "float32", "--max-model-len", "256",
               "--host", "127.0.0.1", "--port", str(free_port()))
    _assert_usage_error(r, "KV cache too small")
    assert time.monotonic() - started < 60


def test_max_model_len_beyond_the_models_context_exits_2(tiny_model):
    r = _serve(str(tiny_model), "--max-model-len", "999999", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(free_port()))
    _assert_usage_error(r, "User-specified max_model_len (999999) is greater than the derived max_model_len "
                           "(max_position_embeddings=512 in the model's config)")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_exits_2_before_starting(tiny_model):
    started = time.monotonic()
    r = _serve(str(tiny_model), "--device", "cuda", "--host", "127.0.0.1", "--port", str(free_port()))
    _assert_usage_error(r, "device 'cuda' was asked for but torch sees no CUDA device")
    # Checked in the API process before the core is spawned or uvicorn starts: that line is all.
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert time.monotonic() - started < 60


def test_device_check_names_a_missing_cuda_ordinal(monkeypatch):
    import torch

    from pagoda.engine.devices import check_device_available

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        check_device_available(device)
    with pytest.raises(ValueError, match=r"'cuda:2' was asked for but torch sees 2 CUDA device\(s\): cuda:0 to cuda:1"):
        check_device_available("cuda:2")


def test_config_failure_sent_just_before_the_core_exited_is_not_lost(tiny_model):
    """The core sends why it failed, then exits; if the API process notices the exit (process
    sentinel) before it reads that message, the reason and its exit code 2 must survive the race."""
    from pagoda.config import EngineArgs
    from pagoda.contracts.messages import EngineCoreOutputs
    from pagoda.engine.core_client import CoreClient
    from pagoda.engine.errors import EngineConfigError

    async def late_recv() -> EngineCoreOutputs:  # the failure message arrives only after the death was noticed
        await asyncio.sleep(0.05)
        return EngineCoreOutputs(failed="ValueError: KV cache too small", config_error="KV cache too small")

    client = CoreClient(EngineArgs(model=str(tiny_model)))  # never started: no process, no sockets
    client.recv = late_recv

    async def main() -> None:
        client._loop = asyncio.get_running_loop()
        client.mark_dead("the engine core process exited (exit code 1)")
        with pytest.raises(EngineConfigError, match="^KV cache too small$"):
            await client.wait_ready()

    asyncio.run(main())


def test_tool_call_output_parsing():
    from pagoda.serve.tool_calls import parse_tool_calls, tool_call_schema

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    named = {"type": "function", "function": {"name": "g"}}
    assert tool_call_schema(tools, named) == ("named", {"type": "object"})  # no parameters: any object
    mode, schema = tool_call_schema(tools, "required")
    assert mode == "required" and [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert tool_call_schema(tools, "none") is None and tool_call_schema(None, None) is None
    for bad in ({"type": "function", "function": "g"}, {"type": "function"}, "sometimes"):
        with pytest.raises(ValueError, match="tool_choice must be"):  # a 400, not an AttributeError's 500
            tool_call_schema(tools, bad)
    (call,) = parse_tool_calls("named", named, '{"x": 1}')
    assert call["function"] == {"name": "g", "arguments": '{"x": 1}'} and call["id"].startswith("chatcmpl-tool-")
    calls = parse_tool_calls("required", "required", '[{"name": "f", "parameters": {"a": "é"}}, {"name": "g", "parameters": {}}]')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"a": "é"}'), ("g", "{}")]
    # Cut short (max_tokens) before the JSON closed: no calls, the caller returns the text as content.
    assert parse_tool_calls("named", named, '{"x": ') is None


def test_a_ready_server_leaves_its_startup_heap_out_of_full_collections(monkeypatch):
    """`run_server` freezes the heap once the engine is ready: a full collection in the middle of a
    streamed batch walked all of torch's and the tokenizer's objects (~0.1 s, every stream stalled)."""
    import gc
    import signal

    from pagoda.serve import server as server_mod

    async def no_serving(self, sockets=None) -> None:
        return None

    monkeypatch.setattr(server_mod._DrainingServer, "serve", no_serving)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's own handlers
    state = SimpleNamespace(on_ready=[], exit_code=0)
    assert server_mod.run_server(state, "127.0.0.1", free_port(), app=object()) == 1  # never started
    assert server_mod.freeze_startup_heap in state.on_ready
    before = gc.get_freeze_count()
    try:
        for cb in state.on_ready:
            cb()  # as ServerState does once the engine is up
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
