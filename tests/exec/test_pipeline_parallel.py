"""Pipeline parallelism: stages hold contiguous layers, a step goes out as two micro-batches, and
PP=2 and TP=2 x PP=2 (four worker processes) give TP=1's greedy tokens under chunked prefill,
prefix caching and preemption, on tiny 4-layer models with untied (Llama-3) and tied (Qwen2) heads."""

from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.contracts.step import ScheduledRequest, SchedulerOutput
from pagoda.exec.model_runner import ModelRunnerOutput
from pagoda.exec.mp_executor import merge_into, split_step
from pagoda.model.pipeline import layer_range
from parallel_helpers import WORKLOAD_ENGINE_ARGS, workload
from tests.tiny_models import save_tiny_model


def test_stages_hold_contiguous_layers():
    assert [layer_range(4, s, 2) for s in range(2)] == [(0, 2), (2, 4)]
    assert [layer_range(5, s, 3) for s in range(3)] == [(0, 1), (1, 3), (3, 5)]


def _req(rid: str, n: int) -> ScheduledRequest:
    return ScheduledRequest(rid, 0, n, list(range(n)), [], [], n)


def test_a_step_splits_into_two_micro_batches_of_about_equal_tokens():
    step = SchedulerOutput(scheduled=[_req("a", 1), _req("b", 1), _req("c", 30), _req("d", 2)],
                           num_scheduled_tokens={"a": 1, "b": 1, "c": 30, "d": 2}, total_num_scheduled_tokens=34,
                           preempted_request_ids=["x"], finished_request_ids=["y"])
    first, second = split_step(step)
    assert [s.request_id for s in first.scheduled] == ["a", "b", "c"]
    assert [s.request_id for s in second.scheduled] == ["d"]
    assert (first.total_num_scheduled_tokens, second.total_num_scheduled_tokens) == (32, 2)
    assert first.finished_request_ids == ["y"] and first.preempted_request_ids == ["x"]
    assert second.finished_request_ids == [] and second.preempted_request_ids == []
    assert split_step(SchedulerOutput(scheduled=[_req("a", 5)], total_num_scheduled_tokens=5))[0].scheduled[0].request_id == "a"
    out = ModelRunnerOutput(sampled_token_ids={"a": [1]})
    merge_into(out, ModelRunnerOutput(sampled_token_ids={"d": [2]}, logprobs={"d": ([2], [-0.5])}))
    assert out.sampled_token_ids == {"a": [1], "d": [2]} and out.logprobs == {"d": ([2], [-0.5])}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for arch in ("llama3", "qwen2"):
        folder = tmp_path_factory.mktemp(arch)
        save_tiny_model(arch, folder, num_hidden_layers=4)
        out[arch] = str(folder)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch, tp, pp", [("llama3", 1, 2), ("qwen2", 2, 2)])
def test_pipeline_greedy_tokens_equal_one_rank(folders, arch, tp, pp):
    want, _ = workload(LLM(folders[arch], **WORKLOAD_ENGINE_ARGS))
    llm = LLM(folders[arch], tensor_parallel_size=tp, pipeline_parallel_size=pp, **WORKLOAD_ENGINE_ARGS)
    try:
        assert len(llm.engine.core.executor.procs) == tp * pp
        got, preemptions = workload(llm)
    finally:
        llm.engine.core.shutdown()
    assert preemptions > 0
    assert got == want
