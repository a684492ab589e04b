"""Progress of slow start-up work: a tqdm bar on a terminal, one log line otherwise; weight loading
and GGUF conversion report through it, and a kernel build only when it really compiles."""

from __future__ import annotations

import io
import logging
import os

import pytest

from pagoda import progress
from pagoda.model.loader import load_model
from tests.tiny_models import save_tiny_model


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_bar_is_drawn_and_nothing_is_logged(caplog):
    term = _Terminal()
    with caplog.at_level(logging.INFO, "pagoda.progress"):
        assert list(progress.iterate(range(5), 5, "loading x", "tensors", file=term)) == [0, 1, 2, 3, 4]
        with progress.activity("building y", expected_s=60, file=term):
            pass
    assert "loading x" in term.getvalue() and "0/5 [" in term.getvalue() and "building y" in term.getvalue()
    assert not caplog.records


def test_elsewhere_one_log_line_and_no_bar(caplog):
    plain = io.StringIO()
    with caplog.at_level(logging.INFO, "pagoda.progress"):
        assert list(progress.iterate(range(3), 3, "loading x", "tensors", file=plain)) == [0, 1, 2]
        with progress.activity("building y", file=plain):
            pass
    assert plain.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == ["loading x (3 tensors)", "building y"]


def test_pagoda_no_progress_turns_bars_off(monkeypatch):
    monkeypatch.setenv("PAGODA_NO_PROGRESS", "1")
    term = _Terminal()
    list(progress.iterate(range(3), 3, "loading x", file=term))
    assert term.getvalue() == ""


@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("gguf", marks=pytest.mark.slow)])
def test_loading_reports_its_tensors(tmp_path, caplog, fmt, smollm2_source):
    if fmt == "safetensors":
        save_tiny_model("llama3", tmp_path)
        model, expect = str(tmp_path), f"loading {tmp_path.name} ("
    else:
        model, expect = str(smollm2_source.path), f"converting {smollm2_source.path.name} (once; cached afterwards) ("
    with caplog.at_level(logging.INFO, "pagoda.progress"):
        load_model(model, dtype="float32")
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.progress"]
    assert len(lines) == 1 and lines[0].startswith(expect) and lines[0].endswith(" tensors)"), lines


def test_a_cached_kernel_build_says_nothing(caplog, tmp_path, monkeypatch):
    from pagoda.cpp_build import build_cpu_extension

    source = tmp_path / "tiny_ext.cpp"
    source.write_text("#include <torch/extension.h>\nint one() { return 1; }\n"
                      "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"one\", &one); }\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("PAGODA_NO_CPP", raising=False)
    with caplog.at_level(logging.INFO, "pagoda.progress"):
        first = build_cpu_extension("tiny_ext", source, "a test kernel")
        second = build_cpu_extension("tiny_ext", source, "a test kernel")
    assert first is not None and second.one() == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.progress"]
    assert lines == ["building a test kernel for this CPU (about 60 s, once)"], lines
    assert os.path.isdir(tmp_path / "ext")
