"""Tensor parallelism: the shards of every weight, the configurations refused up front, and TP=2
in real worker processes against TP=1, in logits (fp32, 1e-4) and in greedy tokens through the
engine (chunked prefill, prefix caching and preemption on) on tiny Llama-3, Qwen2 and Qwen3 models,
one of them with fewer KV heads than ranks and a vocabulary the ranks do not divide."""

from __future__ import annotations

import importlib.util
import multiprocessing
import types

import pytest
import torch

from pagoda import LLM
from pagoda.exec.executor import check_parallel_config
from pagoda.model.tensor_parallel import TPGroup, check_tp_config, shard_tensor, split_for, unmerge_params
from pagoda.sampling_params import SamplingParams
from parallel_helpers import WORKLOAD_ENGINE_ARGS, end_rank, prompt_and_decode_logits, workload
from tests.tiny_models import save_tiny_model

# name -> (arch, config overrides)
MODELS = {
    "llama3": ("llama3", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # One KV head for two ranks (replicated), a vocabulary of 509 (the last rank's rows padded).
    "llama_kv1": ("llama3", {"num_key_value_heads": 1, "vocab_size": 509}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, (arch, overrides) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        save_tiny_model(arch, folder, **overrides)
        out[name] = str(folder)
    return out


def _cfg(heads=4, kv=2, inter=128, vocab=512, hidden=64):
    return types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                                 vocab_size=vocab, hidden_size=hidden, head_dim=None)


def test_splits_cover_every_head_once_and_replicate_few_kv_heads():
    smollm2 = _cfg(heads=9, kv=3, inter=1536, hidden=576)
    splits = [split_for(smollm2, TPGroup(r, 2)) for r in range(2)]
    assert [(s.kv_start, s.kv_count, s.q_start, s.q_count) for s in splits] == [(0, 1, 0, 3), (1, 2, 3, 6)]
    assert sum(s.inter_count for s in splits) == 1536
    few = _cfg(heads=4, kv=1)
    splits = [split_for(few, TPGroup(r, 4)) for r in range(4)]
    assert [(s.kv_start, s.kv_count, s.q_start, s.q_count) for s in splits] == [(0, 1, r, 1) for r in range(4)]


def test_shards_put_back_together_are_the_tensor():
    cfg = _cfg(vocab=509)
    head_dim = 16
    q = torch.randn(4 * head_dim, 64)
    o = torch.randn(64, 4 * head_dim)
    embed = torch.randn(509, 64)
    parts = [TPGroup(r, 2) for r in range(2)]
    assert torch.equal(torch.cat([shard_tensor("x.q_proj.weight", q, cfg, t) for t in parts]), q)
    assert torch.equal(torch.cat([shard_tensor("x.o_proj.weight", o, cfg, t) for t in parts], dim=1), o)
    rows = torch.cat([shard_tensor("model.embed_tokens.weight", embed, cfg, t) for t in parts])
    assert rows.shape[0] == 510 and torch.equal(rows[:509], embed) and not rows[509].any()
    bias = torch.randn(64)
    assert [shard_tensor("x.o_proj.bias", bias, cfg, t).abs().sum() > 0 for t in parts] == [True, False]
    merged = torch.randn((4 + 2 + 2) * head_dim, 64)
    names = [n for n, _ in unmerge_params([("model.layers.0.self_attn.qkv_proj.weight", merged)], cfg)]
    assert names == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]


def test_bad_parallel_configs_are_refused_in_one_line(monkeypatch):
    cpu = torch.device("cpu")
    gpus = torch.cuda.device_count()
    cases = [
        (lambda: check_tp_config(_cfg(heads=6, kv=3), 4), "cannot split the model's 3 KV heads"),
        (lambda: check_parallel_config(gpus + 1, 1, "mp", torch.device("cuda")),
         f"{gpus + 1} ranks need {gpus + 1} GPUs; this machine has {gpus}"),
        (lambda: check_parallel_config(1, 3, "mp", cpu, types.SimpleNamespace(**vars(_cfg()), num_hidden_layers=2)),
         "pipeline_parallel_size 3 exceeds the model's 2 layers"),
        (lambda: check_parallel_config(2, 1, "uni", cpu), "the uni executor runs one rank"),
    ]
    cases.append((lambda: check_parallel_config(2, 1, "ray", cpu), "needs Ray: pip install 'pagoda[ray]'"))
    # As on a machine without Ray (make install installs it; test_ray_executor runs it).
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a))
    for fn, text in cases:
        with pytest.raises(ValueError) as info:
            fn()
        assert text in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="must be one of uni, mp, ray"):
        LLM("unused", distributed_executor_backend="threads")


def _rank_logits(rank: int, world: int, port: int, folders: dict, queue) -> None:
    """One rank: each model's logits over a prompt (prefill) and two decode steps, to rank 0's queue."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata
    from pagoda.model.shard_loader import load_model_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for name, folder in folders.items():
        # numpy: a queue passes a tensor by a handle that dies with this process
        shard = load_model_shard(folder, "float32", "cpu", TPGroup(rank, world)).model
        out[name] = prompt_and_decode_logits(shard).numpy()
    end_rank(rank, queue, out)


@pytest.mark.slow
def test_tp2_logits_equal_tp1_within_1e4(folders):
    from pagoda.exec.mp_executor import free_port
    from pagoda.model.loader import load_model

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_logits, args=(r, 2, port, folders, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = queue.get(timeout=120)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    got = {name: torch.from_numpy(array) for name, array in got.items()}
    for name, folder in folders.items():
        want = prompt_and_decode_logits(load_model(folder, "float32").model)
        assert got[name].shape == want.shape == (9, MODELS[name][1].get("vocab_size", 512))
        assert torch.allclose(got[name], want, atol=1e-4, rtol=0), (name, (got[name] - want).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_greedy_tokens_equal_tp1_under_chunking_caching_and_preemption(folders, name):
    # mp ranks all-reduce through shared memory; the Ray test runs gloo's all-reduce the same way.
    kwargs = WORKLOAD_ENGINE_ARGS
    want, _ = workload(LLM(folders[name], **kwargs))
    llm = LLM(folders[name], tensor_parallel_size=2, **kwargs)
    try:
        got, preemptions = workload(llm)
    finally:
        llm.engine.core.shutdown()
    assert preemptions > 0
    assert got == want


@pytest.mark.slow
def test_tp2_smollm2_greedy_tokens_equal_tp1(smollm2_fp32, smollm2_prompt_ids):
    """SmolLM2's 9 heads and 3 KV heads split 6 + 3 and 2 + 1 over two ranks."""
    from tests.conftest import make_engine

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in smollm2_prompt_ids]
    kwargs = dict(dtype="float32", num_gpu_blocks_override=512)
    want = [o.outputs[0].token_ids for o in make_engine(smollm2_fp32, **kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(None, tensor_parallel_size=2, distributed_executor_backend="mp", **kwargs)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.core.shutdown()
    assert got == want
