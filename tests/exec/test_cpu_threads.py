"""The engine core's thread binding (pagoda/exec/cpu_threads.py, csrc/thread_binding.cpp): how
`VLLM_CPU_OMP_THREADS_BIND` is read, and the binding itself, done in a child process (a bound
thread of the test process would pass its one CPU on to every process the suite starts later)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagoda.exec.cpu_threads import binding_plan, check_threads_bind, parse_cpu_list

ALLOWED = sorted(os.sched_getaffinity(0))


def test_a_cpu_list_reads_as_linux_writes_it():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list(" 5 , 1-2") == [5, 1, 2]


@pytest.mark.parametrize("value, message", [
    ("all", "must be auto, nobind or a CPU list"),
    ("0-", "must be auto, nobind or a CPU list"),
    ("1,,2", "must be auto, nobind or a CPU list"),
    ("0-3|4-7", "must be auto, nobind or a CPU list"),
    ("3-1", "is empty"),
    ("0,1,0", "listed twice"),
])
def test_a_bad_value_is_refused_in_one_line(value, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(value)


def test_auto_binds_only_a_thread_per_cpu_the_process_may_use():
    assert binding_plan("auto", [3, 1], 2) == [1, 3]
    assert binding_plan("", [0, 1], 2) == [0, 1]
    assert binding_plan("auto", [0, 1, 2, 3], 2) is None  # replicas sharing the cores, or threads the user set
    assert binding_plan("auto", [0], 1) is None
    assert binding_plan("NoBind", [0, 1], 2) is None


def test_a_list_binds_in_its_order_and_only_cpus_the_process_has():
    assert binding_plan("1,0", [0, 1, 2], 2) == [1, 0]
    assert binding_plan("2", [0, 1, 2], 2) == [2]
    with pytest.raises(ValueError, match="CPU 4 is not one this process may run on"):
        binding_plan("0,4", [0, 1, 2], 2)


def test_a_list_needs_one_rank_of_one_replica():
    check_threads_bind(False, {"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    check_threads_bind(False, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    check_threads_bind(True, {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    with pytest.raises(ValueError, match="with data, tensor or pipeline parallelism use auto or nobind"):
        check_threads_bind(False, {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    with pytest.raises(ValueError, match="must be auto, nobind"):
        check_threads_bind(True, {"VLLM_CPU_OMP_THREADS_BIND": "yes"})


_CHILD = """
import json, os, sys, torch
from pagoda.exec.cpu_kernels import load_thread_binding
from pagoda.exec.cpu_threads import bind_engine_threads
module = load_thread_binding()
if module is None:
    print(json.dumps(None)); sys.exit()
torch.manual_seed(0)
a, b = torch.randn(300, 200, dtype=torch.float64), torch.randn(200, 100, dtype=torch.float64)
before = a @ b
plan = bind_engine_threads()
tids = module.bind_threads(plan) if plan else []
status = {t: open(f"/proc/self/task/{t}/status").read() for t in tids}
allowed = {t: s.split("Cpus_allowed_list:")[1].split()[0] for t, s in status.items()}
print(json.dumps({"plan": plan, "threads": torch.get_num_threads(), "tids": tids, "allowed": [allowed[t] for t in tids],
                  "main_is_thread_0": bool(tids) and tids[0] == os.getpid(),
                  "runs_on": [module.thread_cpus() for _ in range(20)],
                  "main_mask": sorted(os.sched_getaffinity(0)),
                  "same_product": bool(torch.equal(a @ b, before))}))
"""


def _bind_in_child(env: dict[str, str]) -> dict | None:
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(ALLOWED) < 2, reason="binding two threads needs two CPUs")
def test_each_thread_of_torchs_pool_runs_on_its_cpu_only():
    # Reversed, so that thread i's CPU is not the one it would be given by chance.
    cpus = list(reversed(ALLOWED[:2]))
    result = _bind_in_child({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))})
    assert result is not None, "the thread binding kernel did not build"
    assert result["plan"] == cpus and result["threads"] == 2
    assert result["main_is_thread_0"] and result["main_mask"] == [cpus[0]]
    assert result["allowed"] == [str(c) for c in cpus]
    # The threads torch's own parallel regions run on are the bound ones, every time.
    assert all(r == cpus for r in result["runs_on"]), result["runs_on"]
    assert result["same_product"]


@pytest.mark.skipif(len(ALLOWED) < 2, reason="binding two threads needs two CPUs")
def test_auto_in_a_process_with_a_thread_per_cpu_binds_them_in_order():
    result = _bind_in_child({"VLLM_CPU_OMP_THREADS_BIND": "auto", "OMP_NUM_THREADS": str(len(ALLOWED))})
    assert result is not None, "the thread binding kernel did not build"
    assert result["plan"] == ALLOWED
    assert result["allowed"] == [str(c) for c in ALLOWED]
    assert all(r == ALLOWED for r in result["runs_on"])


def test_nobind_leaves_every_thread_its_cpus():
    result = _bind_in_child({"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert result is not None, "the thread binding kernel did not build"
    assert result["plan"] is None and result["tids"] == []
    assert result["main_mask"] == ALLOWED


def test_a_binding_that_fails_leaves_the_engine_running_unbound(monkeypatch, caplog):
    """The kernel refusing (a thread that did not join the region, a CPU the kernel will not give)
    must not stop the engine core: a warning, and this thread keeps every CPU."""
    import types

    import torch

    from pagoda.exec import cpu_kernels, cpu_threads

    def refuse(cpus):
        os.sched_setaffinity(0, {cpus[0]})  # as if thread 0 had been bound before thread 1 failed
        raise RuntimeError("bind_threads: thread 1 of 2 did not run")

    monkeypatch.setattr(cpu_kernels, "load_thread_binding", lambda: types.SimpleNamespace(bind_threads=refuse))
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        with caplog.at_level("WARNING", logger="pagoda.exec.cpu_threads"):
            assert cpu_threads.bind_engine_threads({"VLLM_CPU_OMP_THREADS_BIND": str(ALLOWED[0])}) is None
        assert "engine threads left unbound: bind_threads: thread 1 of 2 did not run" in caplog.text
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
