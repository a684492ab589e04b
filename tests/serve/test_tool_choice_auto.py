"""`tool_choice: "auto"` and reasoning end to end: a real `pagoda serve` per tool-call parser, started
with `--enable-auto-tool-choice --tool-call-parser NAME` (and a reasoning parser for two of them), on
a tiny model scripted to start a call in its family's syntax (tests/serve/scripted_models.py). Once
the call starts only the grammar steers it: the name and the arguments come out of the masked
random logits, so that every call parsing and matching its tool's schema is the grammar's doing.
Streamed and whole answers are compared; reasoning goes to `reasoning_content`."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.serve.scripted_models import ASSISTANT, EOS, save_scripted_model
from tests.serve.serve_helpers import REPO, ServerProcess

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

# parser -> (reasoning parser, the script: each token's greedy successor). Each script thinks "hm"
# where a reasoning parser is set, then opens a call; after the call's last token it ends.
SERVERS = {
    "hermes": ("qwen3", {ASSISTANT: "<think>", "<think>": "h", "h": "m", "m": "</think>", "</think>": "<tool_call>",
                         "</tool_call>": EOS}),
    "mistral": ("deepseek_r1", {ASSISTANT: "h", "h": "m", "m": "</think>", "</think>": "[TOOL_CALLS]", "]": EOS}),
    "llama3_json": (None, {ASSISTANT: "{", "{": '"', '"': "n", "n": "a", "a": "m", "m": "e", "e": '"', "}": EOS}),
}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request, tmp_path_factory):
    name = request.param
    reasoning, script = SERVERS[name]
    folder = tmp_path_factory.mktemp(f"scripted_{name}")
    save_scripted_model(folder, script)
    args = [str(folder), "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "64",
            "--enable-auto-tool-choice", "--tool-call-parser", name]
    if reasoning:
        args += ["--reasoning-parser", reasoning]
    srv = ServerProcess(args).start()
    try:
        srv.wait_ready()
        srv.parser, srv.reasoning = name, reasoning
        yield srv
    finally:
        srv.stop()


def _chat(srv, **body) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0, **body})


def _stream(srv, **body) -> tuple[list[dict], str]:
    """The stream's choice deltas and its last finish reason."""
    deltas, reason = [], None
    with httpx.stream("POST", f"{srv.base_url}/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            (choice,) = event["choices"]
            deltas.append(choice["delta"])
            reason = choice["finish_reason"] or reason
    return deltas, reason


def _check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        schema = SCHEMAS[name]  # a known tool
        assert set(args) == set(schema["required"])
        for key, value in args.items():
            assert value in schema["properties"][key]["enum"]


def test_auto_tool_choice_returns_parsed_calls_whole_and_streamed(server):
    r = _chat(server, tools=TOOLS)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", message
    _check_calls(message["tool_calls"])
    assert not message["content"]
    deltas, reason = _stream(server, tools=TOOLS)
    assert reason == "tool_calls"
    streamed = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["index"] for c in streamed] == list(range(len(streamed)))
    assert [c["function"] for c in streamed] == [c["function"] for c in message["tool_calls"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    # The openai client reads the same calls.
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    got = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                         max_tokens=120, temperature=0).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in got.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_reasoning_goes_to_reasoning_content_whole_and_streamed(server):
    r = _chat(server, tools=TOOLS)
    message = r.json()["choices"][0]["message"]
    deltas, _ = _stream(server, tools=TOOLS)
    streamed_reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    if server.reasoning is None:
        assert "reasoning_content" not in message and not streamed_reasoning
        return
    assert message["reasoning_content"] == "hm" == streamed_reasoning
    # Without tools nothing is parsed as a call, and the thinking is still split off.
    plain = _chat(server, max_tokens=12).json()["choices"][0]
    assert plain["message"]["reasoning_content"] == "hm" and "tool_calls" not in plain["message"]


def test_a_call_cut_by_max_tokens_is_content(server):
    (choice,) = _chat(server, tools=TOOLS, max_tokens=20).json()["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"]


def test_tools_the_grammar_engine_cannot_compile_are_a_400(server):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}]
    r = _chat(server, tools=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    # The server still answers others.
    assert _chat(server, tools=TOOLS).status_code == 200


def test_auto_tool_choice_without_a_parser_exits_2_with_one_line(tmp_path):
    save_scripted_model(tmp_path, {ASSISTANT: EOS})
    for extra, message in ((["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
                           (["--tool-call-parser", "pythonic"], "invalid choice: 'pythonic'")):
        r = subprocess.run([sys.executable, "-m", "pagoda", "serve", str(tmp_path), *extra], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and message in lines[-1], r.stderr
        assert "Traceback" not in r.stderr
