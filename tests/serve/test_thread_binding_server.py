"""`pagoda serve` binds its engine core's compute threads one to a CPU (VLLM_CPU_OMP_THREADS_BIND=auto,
pagoda/exec/cpu_threads.py), read from the core process's /proc; the greedy output is the offline
engine's (which never binds); a CPU list with several replicas is refused at start in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagoda import LLM, SamplingParams
from pagoda.exec.cpu_threads import binding_plan
from tests.serve.serve_helpers import ServerProcess
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

PROMPTS = ["hello world", "one two three four", "the quick brown fox"]
ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bound")
    save_tiny_model("llama3", folder, seed=7)
    save_tiny_tokenizer(folder)
    return folder


def _cpus_of(pid: int) -> dict[int, set[int]]:
    """Each thread of `pid`: the CPUs it may run on."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "status").read_text().split("Cpus_allowed_list:")[1].split()[0]
        cpus: set[int] = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out[int(task.name)] = cpus
    return out


def _torch_threads() -> int:
    """torch's thread count in a fresh process here, as the engine core starts with."""
    return int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                              capture_output=True, text=True, check=True).stdout)


def test_the_served_core_binds_a_thread_per_cpu_and_answers_as_offline(folder):
    expected = binding_plan("auto", ALLOWED, _torch_threads())
    args = [str(folder), "--dtype", "float32", "--num-gpu-blocks-override", "128", "--served-model-name", "bound"]
    srv = ServerProcess(args, env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}).start()
    try:
        srv.wait_ready()
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
                "model": "bound", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        core = httpx.get(f"{srv.url}/v1/engine/stats", timeout=30).json()["pid"]
        threads = _cpus_of(core)
    finally:
        srv.stop()
    if expected is None:  # one CPU, or torch not at a thread per CPU here: nothing is bound
        assert all(cpus == set(ALLOWED) for cpus in threads.values()), threads
    else:
        bound = sorted(next(iter(c)) for c in threads.values() if len(c) == 1)
        assert threads[core] == {expected[0]}  # the core's main thread is torch's thread 0
        assert bound == sorted(expected), threads  # and each other compute thread has its own CPU
        # Threads started before the binding (ZMQ's) keep every CPU.
        assert any(cpus == set(ALLOWED) for cpus in threads.values()), threads
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=128)
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert texts == [out.outputs[0].text for out in offline]


def test_a_cpu_list_with_two_replicas_is_refused_at_start(folder):
    srv = ServerProcess([str(folder), "--dtype", "float32", "--num-gpu-blocks-override", "64", "-dp", "2"],
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0"}).start()
    try:
        code = srv.wait_exit(120)
        log = srv.log_tail()
    finally:
        srv.stop()
    assert code == 2, log
    assert "pagoda: error: VLLM_CPU_OMP_THREADS_BIND lists CPUs for one engine core running one rank" in log
    assert "Traceback" not in log
