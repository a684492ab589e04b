"""`pagoda bench` flag checking: a bad flag is a one-line error (exit 2) before any work, never a traceback."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "64", "--seed", "0"]


def _one_line_error(capsys, *needles: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--num-prompts", "0"], "num_prompts must be >= 1"),  # used to run the default 64 prompts
        (["--workload", "missing.jsonl"], "cannot read the workload file"),  # used to be a FileNotFoundError traceback
        (["--workload", "randm"], "workload must be 'random', 'prefix' or a .jsonl file"),
        (["--json", "."], "is a folder"),  # used to fail only after the run, with a traceback
        (["--compare", "hf", "--hf-batch-sizes", "x"], "expected comma-separated integers"),
    ],
)
def test_throughput_bad_flags(tiny_model, tmp_path, monkeypatch, capsys, extra, needle):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "throughput", "--model", tiny_model, "--num-prompts", "2", "--input-len-min", "4",
            "--input-len-max", "8", "--output-len", "2", *ENGINE, *extra]
    assert main(argv) == 2
    _one_line_error(capsys, needle)


def test_throughput_jsonl_num_prompts_zero(tiny_model, tmp_path, capsys):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": [5, 6, 7], "max_tokens": 2}\n' * 3)
    argv = ["bench", "throughput", "--model", tiny_model, "--workload", str(wl), "--num-prompts", "0", *ENGINE]
    assert main(argv) == 2  # used to run one request
    _one_line_error(capsys, "num_prompts must be >= 1")


def test_latency_json_into_a_folder(tiny_model, tmp_path, capsys):
    argv = ["bench", "latency", "--model", tiny_model, "--input-lens", "8", "--output-len", "2", "--runs", "1",
            "--json", str(tmp_path), *ENGINE]
    assert main(argv) == 2
    _one_line_error(capsys, "is a folder")


def test_output_that_cannot_be_written_after_the_run(tiny_model, tmp_path, monkeypatch, capsys):
    import pagoda.bench.throughput as tp

    def refuse(path, record):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tp, "write_json", refuse)
    argv = ["bench", "throughput", "--model", tiny_model, "--num-prompts", "2", "--input-len-min", "4",
            "--input-len-max", "8", "--output-len", "2", "--json", str(tmp_path / "x.json"), *ENGINE]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("pagoda bench: error: ") and "Permission denied" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--extra-body", "{bad"], "--extra-body is not valid JSON"),
        (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
        (["--request-timeout", "0"], "--request-timeout must be > 0"),
        (["--ready-timeout", "-1"], "--ready-timeout must be >= 0"),
        (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be > 0"),
        (["--vocab-size", "0"], "--vocab-size must be >= 1"),
        (["--json", "."], "is a folder"),
        (["--plot", "."], "is a folder"),
    ],
)
def test_serve_bad_flags_before_any_request(fake_server, tmp_path, monkeypatch, capsys, extra, needle):
    monkeypatch.chdir(tmp_path)
    srv = fake_server()
    argv = ["bench", "serve", "--base-url", srv.url, "--vocab-size", "512", "--num-prompts", "2", "--output-len", "2",
            "--model", "m", *extra]
    assert main(argv) == 2
    _one_line_error(capsys, needle)
    assert srv.bodies == []  # nothing was sent
