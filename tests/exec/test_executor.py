"""The executor's failure paths with real processes: ranks that cannot meet fail with one line
naming the rank and the backend within the timeout; a worker killed between steps is noticed by
the health check and fails the next step instead of hanging it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagoda import LLM
from pagoda.errors import WorkerDiedError
from pagoda.sampling_params import SamplingParams

_LONE_RANK = """
import sys, torch
from pagoda.errors import DistributedInitError
from pagoda.exec.distributed import init_distributed
try:
    init_distributed(0, 2, sys.argv[1], "mp", 3.0, torch.device("cpu"))
except DistributedInitError as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.slow
def test_ranks_that_cannot_meet_fail_with_one_line_within_the_timeout():
    from pagoda.exec.mp_executor import free_port

    t0 = time.monotonic()
    # Rank 0 of 2, and no rank 1 ever comes.
    proc = subprocess.run([sys.executable, "-c", _LONE_RANK, f"tcp://127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert "\n" not in line
    assert line.startswith("rank 0 of 2 (mp backend, torch.distributed gloo at tcp://127.0.0.1:")
    assert "did not meet within 3 s" in line
    assert elapsed < 3 + 15  # the limit, plus starting Python and importing torch


@pytest.mark.slow
def test_a_killed_worker_fails_the_health_check_and_the_next_step(tiny_llama3_fp32):
    folder = str(tiny_llama3_fp32.source.path)
    llm = LLM(folder, dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64)
    core = llm.engine.core
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        core.check_health()
        pid = core.executor.pids[0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"worker rank 0 \(mp backend, pid \d+\) exited with code -9"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the kill is asynchronous: it lands within moments
                core.check_health()
                time.sleep(0.01)
        with pytest.raises(WorkerDiedError, match="worker rank 0"):
            llm.generate([[4, 5, 6]], params, use_tqdm=False)
    finally:
        core.shutdown()
    assert all(p.poll() is not None for p in core.executor.procs)
