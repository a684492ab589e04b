"""Fast tests of the service layer's parts that need no model: the API keys file, token buckets,
tenant priorities, request models and the error shape, delta merging; and `pagoda serve` failing
cleanly (exit 2 for bad arguments, exit 1 when the engine core cannot start)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.serve.tenants import ANONYMOUS, Tenant, TokenBucket, build_registry, parse_api_keys
from serve_helpers import REPO, ServerProcess


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


def test_merge_delta_concatenates():
    from pagoda.engine.async_llm import merge_delta

    def out(text, ids, reason=None, finished=False):
        lp = [{i: Logprob(-1.0, 1, str(i))} for i in ids]
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, list(ids), -1.0, lp, reason)], finished)

    acc = merge_delta(out("a", [1]), out("bc", [2, 3]))
    acc = merge_delta(acc, out("", [], "stop", True))
    c = acc.outputs[0]
    assert (c.text, c.token_ids, len(c.logprobs), c.finish_reason, acc.finished) == ("abc", [1, 2, 3], 3, "stop", True)


# -- pagoda serve failing cleanly ----------------------------------------------------------------------
def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_bad_arguments_exit_2(tmp_path):
    r = _serve("/no/such/model", "--port", "1")
    assert r.returncode == 2 and "no such file" in r.stderr
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-a rps=0\n")
    r = _serve("--api-keys-file", str(keys), "--port", "1")
    assert r.returncode == 2 and "API keys" in r.stderr


def test_engine_that_cannot_start_exits_1(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    srv = ServerProcess([str(bad)]).start()
    try:
        code = srv.wait_exit(120)
        assert code == 1, srv.log_tail()
        assert "failed to start" in srv.log_tail()
    finally:
        srv.stop()
