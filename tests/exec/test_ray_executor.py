"""The Ray backend on a local Ray cluster (`ray.init(num_cpus=2)`): TP=2 gives the mp backend's
tokens under chunked prefill, prefix caching and preemption; a placement group the cluster cannot
place fails with one line within the timeout instead of hanging; a lost actor ends the engine."""

from __future__ import annotations

import time

import pytest

from pagoda import LLM
from pagoda.errors import DistributedInitError, WorkerDiedError
from parallel_helpers import WORKLOAD_ENGINE_ARGS, workload

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tiny_llama3_fp32):
    return str(tiny_llama3_fp32.source.path)


def test_ray_tp2_gives_the_mp_backends_tokens_and_a_lost_actor_ends_it(local_ray, folder):
    mp = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="mp", **WORKLOAD_ENGINE_ARGS)
    try:
        want, _ = workload(mp)
    finally:
        mp.engine.core.shutdown()
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", **WORKLOAD_ENGINE_ARGS)
    core = llm.engine.core
    try:
        got, preemptions = workload(llm)
        assert preemptions > 0 and got == want
        core.check_health()
        ray.kill(core.executor.actors[1])
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(ray backend\) was lost"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # ray.kill is asynchronous: a ping may still be answered
                core.check_health()
                time.sleep(0.05)
        with pytest.raises(WorkerDiedError, match=r"\(ray backend\)"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
    finally:
        core.shutdown()


def test_a_placement_group_the_cluster_cannot_place_fails_in_one_line(local_ray, folder, monkeypatch):
    monkeypatch.setenv("PAGODA_DIST_INIT_TIMEOUT_S", "2")
    t0 = time.monotonic()
    with pytest.raises(DistributedInitError) as info:
        LLM(folder, dtype="float32", tensor_parallel_size=4, distributed_executor_backend="ray")  # 4 CPUs of 2
    message = str(info.value)
    assert message.startswith("ray backend: a placement group of 4 bundles of {'CPU': 1} was not placed within 2 s")
    assert "\n" not in message
    assert time.monotonic() - t0 < 2 + 10
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )
