"""The Ray backend on a local Ray cluster (`ray.init(num_cpus=2)`): TP=2 gives the mp backend's
tokens under chunked prefill, prefix caching and preemption; more ranks than the cluster's CPUs are
refused up front; a placement group that cannot be placed (its CPUs held by someone else) fails
with one line within the timeout instead of hanging; a lost actor ends the engine."""

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


def test_more_ranks_than_the_cluster_has_cpus_are_refused_up_front(local_ray, folder):
    with pytest.raises(ValueError) as info:
        LLM(folder, dtype="float32", tensor_parallel_size=4, distributed_executor_backend="ray")
    assert str(info.value) == "ray backend: 4 ranks need 4 CPU (1 per rank); the Ray cluster has 2"


def test_a_placement_group_that_cannot_be_placed_fails_in_one_line_within_the_timeout(local_ray, folder, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"CPU": 1}])  # one of the cluster's two CPUs taken by someone else
    ray.get(held.ready(), timeout=30)
    monkeypatch.setenv("PAGODA_DIST_INIT_TIMEOUT_S", "2")
    t0 = time.monotonic()
    try:
        with pytest.raises(DistributedInitError) as info:
            LLM(folder, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        remove_placement_group(held)
    message = str(info.value)
    assert message.startswith("ray backend: a placement group of 2 bundles of {'CPU': 1} was not placed within 2 s")
    assert "\n" not in message
    assert time.monotonic() - t0 < 2 + 10
    pgs = ray.util.placement_group_table().values()
    assert all(pg["state"] == "REMOVED" for pg in pgs)  # ours, and the one the test held
