"""Mixtures of experts over two ranks, in real worker processes: a slice of every expert (tensor
parallel inside the experts) and whole experts (--enable-expert-parallel) both give TP=1's logits
(fp32, within 1e-4) and, through the engine with chunked prefill, prefix caching and preemption
happening, TP=1's greedy tokens."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import time

import pytest
import torch

from pagoda import LLM
from pagoda.exec.executor import check_parallel_config
from pagoda.model.moe import check_expert_split
from pagoda.model.tensor_parallel import TPGroup
from parallel_helpers import WORKLOAD_ENGINE_ARGS, end_rank, prompt_and_decode_logits, workload
from tests.tiny_models import save_tiny_model, tiny_config

# name -> (arch, config overrides)
MODELS = {
    "mixtral": ("mixtral", {}),
    "mixtral_5": ("mixtral", {"num_local_experts": 5}),  # 3 experts on rank 0, 2 on rank 1
    "qwen2_moe": ("qwen2_moe", {}),  # the shared expert splits like a dense MLP
    "qwen3_moe": ("qwen3_moe", {}),  # a dense layer between the sparse ones
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, (arch, overrides) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        save_tiny_model(arch, folder, **overrides)
        out[name] = str(folder)
    # Qwen2-MoE as a GGUF, whose conversion one load caches: the ranks read their shards from the
    # cache's stacked experts (the spawned ranks inherit PAGODA_CACHE_DIR).
    from pagoda.model.loader import load_model
    from tests.model.test_moe_gguf import write_moe_gguf

    path = tmp_path_factory.mktemp("gguf") / "qwen2_moe.gguf"
    write_moe_gguf(save_tiny_model("qwen2_moe", path.parent / "hf"), path, "qwen2moe")
    previous = os.environ.get("PAGODA_CACHE_DIR")
    os.environ["PAGODA_CACHE_DIR"] = str(path.parent / "cache")
    load_model(str(path), "float32")
    out["qwen2_moe_gguf"] = str(path)
    yield out
    if previous is None:
        os.environ.pop("PAGODA_CACHE_DIR")
    else:
        os.environ["PAGODA_CACHE_DIR"] = previous


def test_expert_splits_refused_in_one_line():
    two_experts = tiny_config("mixtral")
    two_experts.num_local_experts = 2
    cases = [
        (lambda: check_expert_split(tiny_config("mixtral"), 8, True), "needs at least 8 experts; the model has 4"),
        (lambda: check_expert_split(tiny_config("qwen3_moe"), 64, False),
         "tensor_parallel_size 64 exceeds the experts' intermediate size 32"),
        (lambda: check_parallel_config(4, 1, "mp", torch.device("cpu"), two_experts, True),
         "expert parallelism over 4 ranks needs at least 4 experts; the model has 2"),
    ]
    for fn, text in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert text in str(info.value) and "\n" not in str(info.value)
    check_expert_split(tiny_config("llama3"), 2, True)  # a dense model: nothing to split
    check_parallel_config(4, 1, "mp", torch.device("cpu"), two_experts, False)  # slices of 32 rows: fine


def _rank_logits(rank: int, world: int, port: int, folders: dict, queue) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pagoda.model.shard_loader import load_model_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for name, folder in folders.items():
        for ep in (False, True):
            model = load_model_shard(folder, "float32", "cpu", TPGroup(rank, world, expert_parallel=ep)).model
            if ep:  # whole experts: this rank's share of them, every row of each
                held = model.model.layers[1].mlp.w13_weight.shape
                assert held[0] == (2 if name != "mixtral_5" else (2, 3)[rank]) and held[1] == 64, held
            out[(name, ep)] = prompt_and_decode_logits(model).numpy()  # numpy: a tensor would die with this process
    end_rank(rank, queue, out)


@pytest.mark.slow
def test_tp2_and_expert_parallel_logits_equal_tp1_within_1e4(folders):
    from pagoda.exec.mp_executor import free_port
    from pagoda.model.loader import load_model

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_logits, args=(r, 2, port, folders, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got, deadline = None, time.monotonic() + 240
    while got is None:  # a rank that fails ends the wait at once
        assert time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in procs), "a rank failed"
        try:
            got = queue.get(timeout=1)
        except queue_module.Empty:
            pass
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for name, folder in folders.items():
        want = prompt_and_decode_logits(load_model(folder, "float32").model)
        for ep in (False, True):
            ours = torch.from_numpy(got[(name, ep)])
            assert ours.shape == want.shape == (9, 512)
            assert torch.allclose(ours, want, atol=1e-4, rtol=0), (name, ep, (ours - want).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("name,ep", [("mixtral", False), ("mixtral", True), ("qwen2_moe", True)])
def test_tp2_greedy_tokens_equal_tp1_under_chunking_caching_and_preemption(folders, name, ep):
    want, _ = workload(LLM(folders[name], **WORKLOAD_ENGINE_ARGS))
    llm = LLM(folders[name], tensor_parallel_size=2, enable_expert_parallel=ep, **WORKLOAD_ENGINE_ARGS)
    try:
        got, preemptions = workload(llm)
    finally:
        llm.engine.core.shutdown()
    assert preemptions > 0
    assert got == want


def test_the_flag_reaches_the_ranks_init(monkeypatch):
    """Unit check of the plumbing (the greedy test above runs it for real): EngineArgs ->
    WorkerInit, which each rank turns into its TPGroup."""
    from pagoda.config import EngineArgs
    from pagoda.exec import mp_executor
    from pagoda.exec.executor import make_distributed_executor

    seen = []
    monkeypatch.setattr(mp_executor, "MultiprocExecutor", lambda init, threads: seen.append(init))
    for flag in (False, True):
        make_distributed_executor(EngineArgs(model="unused", tensor_parallel_size=2, enable_expert_parallel=flag),
                                  "mp", 8, 64, "float32")
    assert [init.enable_expert_parallel for init in seen] == [False, True]
