"""`pagoda chat` under a pseudo-terminal, against a tiny local model and against a server: each answer
streams what the same conversation gets without streaming, the history carries into the next turn,
the system prompt opens it, /reset forgets it and /exit leaves. `pagoda generate`'s sampling flags,
--stop and --stream."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.engine.llm import LLM
from pagoda.entrypoints.cli import main
from pagoda.sampling_params import SamplingParams
from tests.serve.serve_helpers import REPO, ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

# The tiny tokenizer knows the words w0..w511 only: roles are words of it too.
TEMPLATE = ("{% for m in messages %}{{ {'system': 'w3', 'user': 'w4', 'assistant': 'w5'}[m['role']] }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}")
SYSTEM = "w9 w9"
MAX_TOKENS = 6
ENGINE = ["--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "256"]
START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_chat")
    save_tiny_model("llama3", folder)
    save_tiny_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


class PtyProcess:
    """A command whose stdin, stdout and stderr are a pseudo-terminal, as a person's shell gives it."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float) -> str:
        """Everything up to and including the next `marker`; fails on a deadline or an exit."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {marker!r} within {timeout} s; output so far:\n{self.seen[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # the other side closed: the process ended
                    data = b""
                if not data:
                    raise AssertionError(f"exited ({self.proc.poll()}) before {marker!r}:\n{self.seen[-3000:]}")
                self.seen += data.decode(errors="replace").replace("\r\n", "\n")
        head, _, self.seen = self.seen.partition(marker)
        return head + marker

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def ask(self, line: str) -> str:
        """Send a line at the prompt; the answer printed before the next prompt (the echo removed)."""
        self.send(line)
        out = self.read_until(">>> ", 120)[: -len(">>> ")]
        assert out.startswith(line + "\n"), out  # the terminal's echo of what was typed
        return out[len(line) + 1:].rstrip("\n")

    def close(self) -> int | None:
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)


def _converse(chat: PtyProcess) -> tuple[str, str, str, str]:
    """Two turns, /reset, the first turn again; then /exit."""
    chat.read_until(">>> ", START_TIMEOUT_S)
    first = chat.ask("w7 w8")
    second = chat.ask("w10")
    reset = chat.ask("/reset")
    again = chat.ask("w7 w8")
    chat.send("/exit")
    assert chat.close() == 0
    return first, second, reset, again


def _conversations(first: str) -> list[list[dict]]:
    sys_msg = {"role": "system", "content": SYSTEM}
    one = [sys_msg, {"role": "user", "content": "w7 w8"}]
    two = [*one, {"role": "assistant", "content": first}, {"role": "user", "content": "w10"}]
    return [one, two]


def test_chat_with_a_local_model_under_a_pty(chat_model):
    chat = PtyProcess([sys.executable, "-m", "pagoda", "chat", str(chat_model), "--system-prompt", SYSTEM,
                       "--max-tokens", str(MAX_TOKENS), *ENGINE])
    first, second, reset, again = _converse(chat)
    llm = LLM(str(chat_model), dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    one, two = _conversations(first)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want_first = llm.chat(one, greedy, use_tqdm=False)[0].outputs[0].text
    assert first == want_first and re.fullmatch(r"( ?w\d+)+", first)
    assert second == llm.chat(two, greedy, use_tqdm=False)[0].outputs[0].text  # the history was sent
    assert second != llm.chat([two[0], two[-1]], greedy, use_tqdm=False)[0].outputs[0].text
    assert reset == "(conversation reset)" and again == first


@pytest.fixture(scope="module")
def chat_server(chat_model):
    srv = ServerProcess([str(chat_model), "--served-model-name", "tiny-chat", *ENGINE]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_chat_with_a_server_under_a_pty(chat_server):
    chat = PtyProcess([sys.executable, "-m", "pagoda", "chat", "--url", chat_server.base_url, "--system-prompt",
                       SYSTEM, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"])
    first, second, reset, again = _converse(chat)
    for conv, got in zip(_conversations(first), (first, second)):
        r = httpx.post(f"{chat_server.base_url}/chat/completions", timeout=60,
                       json={"messages": conv, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200 and got == r.json()["choices"][0]["message"]["content"]
    assert reset == "(conversation reset)" and again == first


def test_chat_with_no_server_is_one_line(capsys):
    assert main(["chat", "--url", "http://127.0.0.1:9/v1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagoda: error: http://127.0.0.1:9/v1: cannot list")


def test_generate_stream_stop_and_sampling_flags(chat_model, capsys):
    base = ["generate", "w7 w8 w9", "--model", str(chat_model), "--max-tokens", "8", *ENGINE]
    assert main(base) == 0
    plain = capsys.readouterr().out.rstrip("\n")
    words = plain.split()
    assert len(words) == 8
    assert main([*base, "--stream"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == plain
    stop = words[3]
    assert main([*base, "--stop", stop]) == 0
    assert capsys.readouterr().out.rstrip("\n") == plain[: plain.index(stop)]
    # Sampling: top-k 1 is greedy whatever the temperature; a seeded top-p run repeats itself.
    assert main([*base, "--temperature", "1.5", "--top-k", "1"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == plain
    sampled = [*base, "--temperature", "1.0", "--top-p", "0.9", "--sampling-seed", "3"]
    assert main(sampled) == 0 and main(sampled) == 0
    a, b = capsys.readouterr().out.strip("\n").split("\n")
    assert a == b
