"""prompt_logprobs: the prompt tokens' logprobs equal transformers' on SmolLM2, and chunking,
preemption, prefix caching, n > 1 and delta outputs neither change nor repeat them."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.engine.prompt_logprob_store import PromptLogprobStore
from tests.conftest import make_engine

GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
TOL = 1e-3  # fp32, prefill in one pass against transformers' forward


def _entries(out):
    """(prompt token's logprob, its rank, {id: logprob} of every token named) per prompt position
    after the first."""
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    rows = []
    for tid, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        first = next(iter(entry))
        assert first == tid  # the prompt token itself comes first
        rows.append((entry[tid].logprob, entry[tid].rank, {t: e.logprob for t, e in entry.items()}))
    return rows


def test_prompt_logprobs_equal_transformers_and_leave_greedy_output(
    smollm2_fp32, smollm2_tokenizer, smollm2_prompt_ids, smollm2_hf_greedy32, hf_smollm2
):
    num_top = 3
    llm = make_engine(smollm2_fp32, tokenizer=smollm2_tokenizer, num_gpu_blocks_override=512)
    params = GREEDY32.clone(prompt_logprobs=num_top)
    outs = llm.generate([{"prompt_token_ids": p} for p in smollm2_prompt_ids], params, use_tqdm=False)
    # Asking for prompt logprobs changes nothing about what is generated.
    assert [o.outputs[0].token_ids for o in outs] == smollm2_hf_greedy32
    for ids, out in zip(smollm2_prompt_ids, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
        for pos, (lp, rank, top) in enumerate(_entries(out)):
            row, tid = ref[pos], ids[pos + 1]
            assert abs(lp - row[tid].item()) < TOL
            # The rank counts tokens more likely than the prompt token (near-ties may go either way).
            assert int((row > row[tid] + TOL).sum()) + 1 <= rank <= int((row > row[tid] - TOL).sum()) + 1
            alternatives = {t: v for t, v in top.items() if out.prompt_logprobs[pos + 1][t].rank <= num_top}
            assert len(alternatives) == num_top
            kth = row.topk(num_top).values[-1].item()
            for t, v in alternatives.items():
                assert abs(v - row[t].item()) < TOL and v >= kth - TOL
        # Each entry's text is that token alone.
        entry = out.prompt_logprobs[1][ids[1]]
        assert entry.decoded_token == smollm2_tokenizer.decode([ids[1]])


def _prompt_logprobs(llm, prompts, **params):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 4, "ignore_eos": True, "prompt_logprobs": 2, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _assert_same(a, b):
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert list(x) == list(y)  # same tokens, in the same order
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank


PROMPTS = [list(range(3, 3 + n)) for n in (70, 41, 96, 2, 1)]


def test_chunking_preemption_caching_and_n_keep_prompt_logprobs(tiny_llama3_fp32):
    plain = _prompt_logprobs(make_engine(tiny_llama3_fp32, num_gpu_blocks_override=128), PROMPTS)
    assert [len(o.prompt_logprobs) for o in plain] == [70, 41, 96, 2, 1]

    # Chunked prefill: 16-token steps split every long prompt; each position is reported once.
    chunked = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=128, max_num_batched_tokens=16)
    for a, b in zip(plain, _prompt_logprobs(chunked, PROMPTS)):
        _assert_same(a, b)

    # Preemption: 12 usable blocks of 16 tokens cannot hold these requests together, so some compute
    # their prompts twice; the second pass must not add rows.
    small = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=13, max_num_batched_tokens=32)
    again = _prompt_logprobs(small, PROMPTS, min_tokens=0)
    assert small.engine.core.stats().num_preemptions > 0
    for a, b in zip(plain, again):
        _assert_same(a, b)

    # Prefix caching: a request that asks for prompt logprobs computes its whole prompt even when it
    # is cached, while one that does not ask still reuses the cached blocks.
    cached = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=128, enable_prefix_caching=True)
    _prompt_logprobs(cached, PROMPTS[:1])
    second = _prompt_logprobs(cached, PROMPTS[:1])[0]
    assert second.num_cached_tokens == 0
    _assert_same(plain[0], second)
    without = cached.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert without.num_cached_tokens == 64 and without.prompt_logprobs is None

    # n > 1: one set of prompt logprobs for the request, computed once.
    many = _prompt_logprobs(cached, PROMPTS[:1], n=3, seed=1, temperature=1.0)[0]
    assert len(many.outputs) == 3
    _assert_same(plain[0], many)


def test_delta_outputs_carry_prompt_logprobs_once(tiny_llama3_fp32):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    eng = llm.engine
    prompt = list(range(5, 45))
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=0),
                    request_id="d", delta=True)
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in eng.step()]
    with_rows = [p for p in seen if p is not None]
    assert len(seen) == 5 and len(with_rows) == 1 and len(with_rows[0]) == len(prompt)
    # prompt_logprobs=0: just the prompt token at each position.
    assert all(len(e) == 1 and next(iter(e)) == t for e, t in zip(with_rows[0][1:], prompt[1:]))


def test_store_keeps_each_position_once_and_refuses_a_gap():
    store = PromptLogprobStore()
    store.start("r")
    row = lambda p: ([p], [-float(p)], 1)  # noqa: E731
    assert store.add("r", 0, [row(0), row(1), row(2)]) == 3
    # A preempted request computes its prompt again: the rows of known positions are dropped.
    assert store.add("r", 1, [row(1), row(2), row(3)]) == 4
    with pytest.raises(ValueError, match="from position 6, 4 known: a gap"):
        store.add("r", 6, [row(6)])
    assert store.take("r") == [row(0), row(1), row(2), row(3)]
    assert store.take("r") is None and store.take("never-asked") is None and len(store) == 0
    store.start("s")
    store.drop("s")
    assert len(store) == 0


def test_engine_leaves_no_prompt_logprob_rows_behind(tiny_llama3_fp32):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    eng = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    eng.add_request({"prompt_token_ids": list(range(5, 45))}, params, request_id="done")
    eng.add_request({"prompt_token_ids": list(range(5, 45))}, params, request_id="aborted")
    eng.step()  # 16 tokens: "done" is mid-prompt, "aborted" waits
    eng.abort_request("aborted")
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.core.prompt_logprobs) == 0
