"""Engine behaviours on a tiny random Llama: n > 1, seeds across batches, logprobs, aborts, no leaks."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.engine.messages import EngineCoreOutput, EngineCoreRequest, decoder, encode
from pagoda.model.loader import load_model
from tests.conftest import make_engine
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama3")
    hf = save_tiny_model("llama3", folder)
    return load_model(str(folder), dtype="float32"), hf


def test_n4_outputs_share_prompt_blocks(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64, block_size=16)
    eng = llm.engine
    prompt = list(range(10, 50))  # 40 tokens: two full blocks and a partial one
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), request_id="r")
    kv = eng.core.kv_manager
    seen_shared = False
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
        tables = [kv.get_block_ids(f"r#{i}") for i in range(4)]
        if all(tables):
            first_two = {tuple(t[:2]) for t in tables}
            assert len(first_two) == 1  # the same two prompt blocks in every child
            blocks = kv.block_pool.blocks
            assert all(blocks[b].ref_cnt == 4 for b in tables[0][:2])
            seen_shared = True
    assert seen_shared
    assert final.finished and len(final.outputs) == 4
    assert [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in final.outputs)
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1  # distinct samples
    assert kv.usage == 0.0


def test_seed_reproducible_inside_different_batches(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=128)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[1, 2, 3, 4]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([[9, 9, 9], [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]], [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([[7] * 20, [1, 2, 3, 4]], [other, seeded], use_tqdm=False)
    assert again[1].outputs[0].token_ids == alone
    different = llm.generate([[1, 2, 3, 4]], seeded.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_logprobs_equal_reference_log_softmax(tiny):
    loaded, hf = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64)
    prompt = [3, 14, 15, 92, 65]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top = torch.topk(ref, 3)
    (entry,) = out.logprobs
    sampled = out.token_ids[0]
    assert sampled == int(top.indices[0])
    assert abs(entry[sampled].logprob - ref[sampled].item()) < 1e-4
    for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert entry[tid].rank == rank
        assert abs(entry[tid].logprob - lp) < 1e-4
    assert abs(out.cumulative_logprob - ref[sampled].item()) < 1e-4


def test_top_k_1_equals_greedy(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64)
    prompts = [[1, 2, 3], [40, 41, 42, 43]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_abort_frees_blocks_and_many_requests_leave_nothing(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=40, max_num_seqs=8)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(30):
        eng.add_request({"prompt_token_ids": [i % 50 + 1] * (5 + i)}, params, request_id=f"q{i}")
    finished = set()
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finished  # answered exactly once
                finished.add(out.request_id)
        step += 1
        if step == 3:
            for i in range(0, 30, 3):
                eng.abort_request(f"q{i}")
    assert finished == {f"q{i}" for i in range(30) if i % 3}
    core = eng.core
    assert core.kv_manager.usage == 0.0
    assert not core.scheduler.requests and core.scheduler.num_running == 0 and core.scheduler.num_waiting == 0
    assert not eng.processor.has_unfinished()
    assert not core.runner.block_tables.row_of


def test_messages_round_trip():
    req = EngineCoreRequest("a", [1, 2, 3], SamplingParams(temperature=0.7, stop=["x"], seed=3, logprobs=2), eos_token_id=2, priority=-1, cache_salt="s")
    assert decoder(EngineCoreRequest).decode(encode(req)) == req
    out = EngineCoreOutput("a", [5], new_logprobs=[([5, 6], [-0.1, -2.0])], finish_reason="stop", stop_reason=5)
    assert decoder(EngineCoreOutput).decode(encode(out)) == out


def test_bad_prompts_rejected_without_disturbing_others(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 100000]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_cache_dtype_sizes_and_stores_the_cache(tiny):
    loaded, _ = tiny
    budget = 4 * 1024 * 1024
    full = make_engine(loaded, kv_cache_memory=budget).engine.core
    half = make_engine(loaded, kv_cache_memory=budget, kv_cache_dtype="float16").engine.core
    assert full.kv_cache.tensor.dtype == torch.float32 and half.kv_cache.tensor.dtype == torch.float16
    assert half.kv_cache.num_blocks == 2 * full.kv_cache.num_blocks  # the same bytes hold twice the tokens
    # Prefill with earlier context (a chunked prompt) and decodes read the float16 cache back.
    llm = make_engine(loaded, kv_cache_dtype="bfloat16", num_gpu_blocks_override=64, max_num_batched_tokens=16)
    out = llm.generate([list(range(3, 40)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert llm.engine.core.kv_manager.usage == 0.0


def test_kv_cache_dtype_errors(tiny):
    from pagoda.config import EngineArgs
    from pagoda.engine.core import EngineCore

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16; got 'fp8'"):
        EngineArgs(kv_cache_dtype="fp8")
    core = EngineCore.__new__(EngineCore)  # only the dtype choice: no CUDA machine needed
    core.args, core.device, core.loaded = EngineArgs(kv_cache_dtype="float16"), torch.device("cuda"), tiny[0]
    with pytest.raises(ValueError, match="supported on the CPU only"):
        core._kv_cache_dtype()
    core.args = EngineArgs()
    assert core._kv_cache_dtype() == torch.float32
