"""LLM.generate on SmolLM2: batched greedy output equals transformers' in every scheduling setting."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from tests.conftest import hf_greedy, make_engine

GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _generate_all(llm, prompt_ids):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY32, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("caching", [True, False])
def test_batched_greedy_equals_transformers(smollm2_fp32, smollm2_prompt_ids, smollm2_hf_greedy32, caching):
    assert len(smollm2_prompt_ids) == 16
    llm = make_engine(smollm2_fp32, enable_prefix_caching=caching, num_gpu_blocks_override=512)
    assert _generate_all(llm, smollm2_prompt_ids) == smollm2_hf_greedy32


def test_chunked_prefill_keeps_greedy_output(smollm2_fp32, smollm2_prompt_ids, smollm2_hf_greedy32):
    # A budget of 8 tokens per step splits every prompt (the shortest has 4 tokens, most more than 8).
    llm = make_engine(smollm2_fp32, max_num_batched_tokens=8, num_gpu_blocks_override=512)
    steps = []
    original = llm.engine.core.scheduler.schedule

    def spy():
        out = original()
        steps.append(out.total_num_scheduled_tokens)
        return out

    llm.engine.core.scheduler.schedule = spy
    assert _generate_all(llm, smollm2_prompt_ids) == smollm2_hf_greedy32
    assert max(steps) <= 8
    assert max(len(p) for p in smollm2_prompt_ids) > 8  # some prompt really was chunked


def test_preemption_keeps_greedy_output(smollm2_fp32, smollm2_prompt_ids, smollm2_hf_greedy32):
    # 24 usable blocks of 16 tokens: far fewer than 16 requests of up to ~70 tokens need together.
    llm = make_engine(smollm2_fp32, num_gpu_blocks_override=25)
    assert _generate_all(llm, smollm2_prompt_ids) == smollm2_hf_greedy32
    assert llm.engine.core.stats().num_preemptions > 0
    assert llm.engine.core.kv_manager.usage == 0.0


@pytest.fixture(scope="module")
def shared_prefix_prompts(smollm2_tokenizer, smollm2_prompt_ids):
    system = (
        "You are a careful assistant. Answer briefly and precisely, cite facts you are sure of, "
        "and say so when you do not know. Here is the question:\n"
    )
    prefix = smollm2_tokenizer.encode(system * 2)
    assert len(prefix) >= 48
    return [prefix + p for p in smollm2_prompt_ids]


def test_shared_prefix_hits_cache_and_keeps_output(smollm2_fp32, hf_smollm2, shared_prefix_prompts):
    llm = make_engine(smollm2_fp32, num_gpu_blocks_override=512, max_num_seqs=4)
    got = _generate_all(llm, shared_prefix_prompts)
    stats = llm.engine.core.stats()
    assert stats.prefix_cache_hits >= 16 * 3  # later requests reuse at least the prefix's first blocks
    want = [hf_greedy(hf_smollm2, p, 32) for p in shared_prefix_prompts]
    assert got == want


def test_stop_string_and_stop_token(smollm2_fp32, smollm2_tokenizer):
    llm = make_engine(smollm2_fp32, smollm2_tokenizer, num_gpu_blocks_override=128)
    base = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert base.outputs[0].text.startswith(" Paris.")
    assert base.outputs[0].finish_reason == "length"
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8, stop=["."]), use_tqdm=False)[0]
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (" Paris", "stop", ".")
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=8, stop=["."], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text == " Paris."
    dot = base.outputs[0].token_ids[1]
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[dot]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == dot
    assert out.outputs[0].token_ids == base.outputs[0].token_ids[:2]


def test_chat_and_string_prompts(smollm2_fp32, smollm2_tokenizer):
    llm = make_engine(smollm2_fp32, smollm2_tokenizer, num_gpu_blocks_override=128)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    assert "<|im_end|>" not in out[0].outputs[0].text
