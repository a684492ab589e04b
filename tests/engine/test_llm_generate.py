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


# -- bad input at the offline front door: a ValueError before anything runs, and the engine unharmed --


def _assert_engine_clean_and_working(llm, want):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv_manager.usage == 0.0
    got = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want


GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BAD_CALLS = {
    "prompts is an int": lambda llm: llm.generate(5, GOOD, use_tqdm=False),
    "prompts is None": lambda llm: llm.generate(None, GOOD, use_tqdm=False),
    "sampling_params is a dict": lambda llm: llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False),
    "sampling_params list holds a str": lambda llm: llm.generate([[1], [2]], [GOOD, "x"], use_tqdm=False),
    "priority shorter than prompts": lambda llm: llm.generate([[1], [2]], GOOD, priority=[1], use_tqdm=False),
    "priority longer than prompts": lambda llm: llm.generate([[1]], GOOD, priority=[1, 2], use_tqdm=False),
    "priority is an int": lambda llm: llm.generate([[1]], GOOD, priority=1, use_tqdm=False),
    # These three used to pass validation and fail inside the step, leaving the request in the engine,
    # so that every later generate() failed the same way.
    "logprobs over the vocabulary": lambda llm: llm.generate([[1], [2]], [GOOD, SamplingParams(max_tokens=2, logprobs=10_000)], use_tqdm=False),
    "logprobs over max_logprobs (20)": lambda llm: llm.generate([[1]], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False),
    "logprobs=True": lambda llm: llm.generate([[1]], SamplingParams(max_tokens=2, logprobs=True), use_tqdm=False),
    "prompt_logprobs over max_logprobs (20)": lambda llm: llm.generate([[1, 2]], [GOOD, SamplingParams(max_tokens=2, prompt_logprobs=21)], use_tqdm=False),
    "seed out of range": lambda llm: llm.generate([[1], [2]], [GOOD, SamplingParams(max_tokens=2, seed=2**70)], use_tqdm=False),
    "seed is a float": lambda llm: llm.generate([[1]], SamplingParams(max_tokens=2, seed=1.5), use_tqdm=False),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_generate_input_is_a_value_error_and_leaves_the_engine_working(tiny_llama3_fp32, case):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_model_len=128)
    want = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError):
        BAD_CALLS[case](llm)
    _assert_engine_clean_and_working(llm, want)


def test_logprobs_up_to_max_logprobs_are_served(tiny_llama3_fp32):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64)
    out = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0]
    assert all(len(step) >= 20 for step in out.logprobs)
    # max_logprobs=-1 lifts the cap to the vocabulary, as in vLLM.
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_logprobs=-1)
    out = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=1, logprobs=512), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) == 512
    with pytest.raises(ValueError, match="greater than max allowed: 512"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1, logprobs=513), use_tqdm=False)


def test_numpy_integer_seed_is_a_seed(tiny_llama3_fp32):
    # SamplingParams accepted it, then the offline engine refused it (and msgpack cannot send it).
    import numpy as np

    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64)
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=np.int64(7))
    assert type(sp.seed) is int
    same = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)
    outs = llm.generate([[1, 2, 3], [1, 2, 3]], [sp, same], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_logit_bias_and_min_tokens_offline(tiny_llama3_fp32):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate([[1, 2, 3]], greedy.clone(logit_bias={9: 100.0}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [9] * 6
    # A stop token the model would sample first is held back until min_tokens outputs exist.
    held = llm.generate([[1, 2, 3]], greedy.clone(stop_token_ids=[want[0]], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert want[0] not in held.token_ids[:4] and len(held.token_ids) >= 4
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        llm.generate([[1, 2, 3]], greedy.clone(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_end(tiny_llama3_fp32):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = list(range(3, 53))
    cut = llm.generate([prompt], greedy.clone(truncate_prompt_tokens=10), use_tqdm=False)[0]
    tail = llm.generate([prompt[-10:]], greedy, use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1: the context length; a prompt over it is cut to it (which then leaves no room to generate).
    assert llm.generate([prompt], greedy.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0].prompt_token_ids == prompt
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate([list(range(3, 203))], greedy.clone(truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(129\) is larger than max_model_len \(128\)"):
        llm.generate([prompt], greedy.clone(truncate_prompt_tokens=129), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=0)


def test_a_failed_step_aborts_the_calls_requests(tiny_llama3_fp32):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.core.runner
    real = runner.execute
    calls = []

    def failing(so):
        calls.append(1)
        if len(calls) == 2:  # after the prefill, in the middle of decoding
            raise RuntimeError("boom")
        return real(so)

    runner.execute = failing
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[1, 2, 3], [4, 5], [6]], sp, use_tqdm=False)
    runner.execute = real
    _assert_engine_clean_and_working(llm, want)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_model_len": 0},  # used to mean "the model's length"
        {"max_model_len": 64.0},
        {"num_gpu_blocks_override": 0},  # used to mean "size the cache by memory" (2 GiB on CPU)
        {"num_gpu_blocks_override": -3},
        {"kv_cache_memory": 0},
        {"device": "bogus"},  # used to be torch's RuntimeError
        {"device": "mps"},
        {"seed": None},
        {"dtype": "fp8"},
        {"max_logprobs": -2},
    ],
)
def test_engine_args_refuse_bad_values(kwargs):
    from pagoda.config import EngineArgs

    with pytest.raises(ValueError):
        EngineArgs.from_kwargs(**kwargs)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_value_error(tiny_llama3_fp32):
    from pagoda.config import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="no CUDA device"):  # used to be torch's AssertionError
        LLMEngine(EngineArgs(device="cuda", num_gpu_blocks_override=64), loaded=tiny_llama3_fp32, tokenizer=None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "bogus"], "device must be auto, cpu, cuda or cuda:N"),
        (["--num-gpu-blocks-override", "0"], "num_gpu_blocks_override must be >= 1"),
        (["--max-model-len", "0"], "max_model_len must be >= 1"),
        (["--kv-cache-memory", "0"], "kv_cache_memory must be a positive number"),
        (["--speculative-config", "{method: ngram}"], "speculative_config is not valid JSON"),
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
         "speculative_config: method must be one of ngram, draft_model"),
    ],
)
def test_cli_generate_refuses_bad_engine_flags_in_one_line(argv, message, capsys):
    from pagoda.entrypoints.cli import main

    # Refused before the model loads: the default model is never read.
    assert main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error: ") and message in err and err.count("\n") == 1


def test_cli_takes_vllm_dtype_names():
    import argparse

    from pagoda.entrypoints.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for name in ("half", "float", "float16", "bfloat16", "float32", "auto"):
        assert p.parse_args(["--dtype", name]).dtype == name


def test_chat_bad_messages_and_content_parts(smollm2_fp32, smollm2_tokenizer):
    llm = make_engine(smollm2_fp32, smollm2_tokenizer, num_gpu_blocks_override=128)
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user"}], sp, use_tqdm=False)  # used to be jinja2's UndefinedError
    with pytest.raises(ValueError, match="messages must be"):
        llm.chat("hello", sp, use_tqdm=False)
    with pytest.raises(ValueError, match="text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp, use_tqdm=False)
    # OpenAI-style text parts are joined with newlines, as vLLM does.
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}], sp, use_tqdm=False)
    plain = llm.chat([{"role": "user", "content": "Hi\nthere"}], sp, use_tqdm=False)
    assert parts[0].prompt_token_ids == plain[0].prompt_token_ids
    assert not llm.engine.has_unfinished_requests()
