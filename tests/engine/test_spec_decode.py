"""Speculative decoding end to end: greedy output with n-gram drafts equals output without them under
every scheduling setting (tiny random model; SmolLM2 in the slow tests), aborts mid-speculation leave
no blocks behind, and the metrics count what was drafted and accepted."""

from __future__ import annotations

import random

import pytest

from pagoda import SamplingParams
from pagoda.kv.invariants import check_kv_invariants
from tests.conftest import make_engine

# No load gate: these tests batch up to 16 requests and want drafts in every step.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def repeated_prompts():
    """Prompts that repeat a random phrase three times (n-gram lookup finds drafts in them)."""
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 30))] * 3 for _ in range(6)]


class OracleProposer:
    """Drafts from known greedy outputs, every third step with its second draft wrong: a random tiny
    model rarely copies its prompt, and this makes every acceptance length happen."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], k: int = 4) -> None:
        self.outputs = outputs
        self.k = k
        self.calls = 0
        self.buffers: dict = {}

    def propose(self, request_id, prompt_ids, output_ids):
        self.calls += 1
        want = self.outputs[tuple(prompt_ids)][len(output_ids) : len(output_ids) + self.k]
        if self.calls % 3 == 0 and len(want) > 1:
            want = [want[0], (want[1] + 1) % 512, *want[2:]]
        return want

    def drop(self, request_id):
        pass


def _generate(loaded, prompts, params=GREEDY, blocks=256, oracle=None, **kwargs):
    llm = make_engine(loaded, num_gpu_blocks_override=blocks, block_size=16, **kwargs)
    core = llm.engine.core
    if oracle is not None:
        core.runner.spec.proposer = oracle
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_kv_invariants(core.kv_manager)
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_usable_blocks
    return [o.outputs[0].token_ids for o in outs], core


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama3_fp32, repeated_prompts):
    want, _ = _generate(tiny_llama3_fp32, repeated_prompts)
    return want


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill, and drafts cut by the budget
        {"enable_prefix_caching": False},
        {"blocks": 14},  # forces preemption
    ],
    ids=["default", "chunked", "no-caching", "preemption"],
)
def test_greedy_with_drafts_equals_no_speculation(tiny_llama3_fp32, repeated_prompts, greedy_reference, setting):
    oracle = OracleProposer({tuple(p): o for p, o in zip(repeated_prompts, greedy_reference)})
    got, core = _generate(tiny_llama3_fp32, repeated_prompts, speculative_config=NGRAM, oracle=oracle, **setting)
    assert got == greedy_reference
    stats = core.stats()
    per_pos = stats.spec_num_accepted_tokens_per_pos
    # Most drafts were right: most steps kept several; the corrupted ones stopped at position 1.
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens / 2
    assert per_pos[0] > per_pos[1] > 0 and per_pos[3] > 0
    if "blocks" in setting:
        assert stats.num_preemptions > 0


def test_ngram_proposer_greedy_equals_no_speculation(tiny_llama3_fp32, repeated_prompts, greedy_reference):
    got, core = _generate(tiny_llama3_fp32, repeated_prompts, speculative_config=NGRAM)
    assert got == greedy_reference
    assert core.stats().spec_num_drafts > 0


def test_abort_mid_speculation_frees_every_block(tiny_llama3_fp32, repeated_prompts):
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, block_size=16, speculative_config=NGRAM)
    eng = llm.engine
    core = eng.core
    for i, p in enumerate(repeated_prompts):
        eng.add_request({"prompt_token_ids": p}, GREEDY, request_id=f"r{i}")
    aborted = []
    while eng.has_unfinished_requests():
        eng.step()
        check_kv_invariants(core.kv_manager)
        # Requests holding drafts for their next step, once their blocks include draft slots: the
        # engine takes aborts between steps.
        pending = [rid for rid, r in core.scheduler.requests.items() if r.spec_token_ids]
        if pending and len(aborted) < 3:
            aborted.extend(pending[:1])
            core.abort_requests(pending[:1])
            check_kv_invariants(core.kv_manager)
    assert aborted
    kv = core.kv_manager
    assert kv.num_free_blocks == kv.num_usable_blocks and not kv.req_to_blocks
    assert not core.runner.requests and not core.runner.spec.proposer.buffers


def test_speculative_config_errors_are_one_line(tiny_llama3_fp32):
    from pagoda.config import EngineArgs

    for bad, message in [
        ("{", "not valid JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key(s) typo"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ]:
        with pytest.raises(ValueError, match=None) as info:
            EngineArgs(speculative_config=bad)
        assert message in str(info.value) and "\n" not in str(info.value)


SLOW_GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.slow
def test_smollm2_ngram_greedy_equals_transformers(smollm2_fp32, smollm2_prompt_ids, smollm2_hf_greedy32):
    # One run under all three at once (each costs ~50 s on 2 cores): chunked prefill with a budget of
    # 16 tokens, which also cuts drafts; prefix caching (on by default); 11 usable blocks, which
    # forces preemption of the 16 requests.
    llm = make_engine(smollm2_fp32, speculative_config=NGRAM, max_num_batched_tokens=16, num_gpu_blocks_override=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in smollm2_prompt_ids], SLOW_GREEDY32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == smollm2_hf_greedy32
    stats = llm.engine.core.stats()
    assert stats.spec_num_accepted_tokens_per_pos[1] > 0  # steps that kept several drafts
    assert stats.num_preemptions > 0
    assert llm.engine.core.kv_manager.usage == 0.0


def test_seeded_sampling_with_drafts_reproduces_in_any_batch(tiny_llama3_fp32, repeated_prompts, greedy_reference):
    oracle = {tuple(p): o for p, o in zip(repeated_prompts, greedy_reference)}
    # Nearly greedy, so that the greedy drafts often stand; still the rejection-sampling path.
    seeded = SamplingParams(temperature=0.05, top_p=0.9, seed=1, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    alone, core = _generate(tiny_llama3_fp32, repeated_prompts[:1], seeded, speculative_config=NGRAM,
                            oracle=OracleProposer(oracle))
    assert core.stats().spec_num_accepted_tokens > 0  # some drafts stood under sampling
    again, _ = _generate(tiny_llama3_fp32, repeated_prompts[:1], seeded, speculative_config=NGRAM,
                         oracle=OracleProposer(oracle))
    batch, _ = _generate(tiny_llama3_fp32, repeated_prompts[1:4] + repeated_prompts[:1],
                         [other, other, other, seeded], speculative_config=NGRAM, oracle=OracleProposer(oracle))
    assert alone == again and batch[3] == alone[0]
    different, _ = _generate(tiny_llama3_fp32, repeated_prompts[:1], seeded.clone(seed=42), speculative_config=NGRAM,
                             oracle=OracleProposer(oracle))
    assert different != alone


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(tiny_llama3_fp32, repeated_prompts,
                                                                      greedy_reference):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)

    def run(**kwargs):
        llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=256, **kwargs)
        if kwargs:
            llm.engine.core.runner.spec.proposer = OracleProposer(
                {tuple(p): o for p, o in zip(repeated_prompts, greedy_reference)})
        outs = llm.generate([{"prompt_token_ids": p} for p in repeated_prompts[:3]], params, use_tqdm=False)
        return [o.outputs[0] for o in outs], llm.engine.core

    want, _ = run()
    got, core = run(speculative_config=NGRAM)
    assert core.stats().spec_num_accepted_tokens > 20
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs) == 20
        for gl, wl in zip(g.logprobs, w.logprobs):
            assert list(gl) == list(wl)  # the token, then the same top-2
            for tok in gl:
                assert gl[tok].logprob == pytest.approx(wl[tok].logprob, abs=1e-4)


def test_n2_children_speculate_independently(tiny_llama3_fp32, repeated_prompts, greedy_reference):
    oracle = {tuple(p): o for p, o in zip(repeated_prompts, greedy_reference)}
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=256, speculative_config=NGRAM)
    llm.engine.core.runner.spec.proposer = OracleProposer(oracle)
    greedy = llm.generate([{"prompt_token_ids": repeated_prompts[0]}], GREEDY.clone(n=2), use_tqdm=False)[0]
    assert [o.token_ids for o in greedy.outputs] == [greedy_reference[0]] * 2
    sampled = llm.generate([{"prompt_token_ids": repeated_prompts[0]}],
                           SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert len(sampled.outputs) == 3 and all(len(o.token_ids) == 12 for o in sampled.outputs)
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    kv = llm.engine.core.kv_manager
    check_kv_invariants(kv)
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.fixture(scope="module")
def tiny_random_draft(tmp_path_factory):
    """Another random tiny Llama with the same vocabulary: a draft that is almost always wrong."""
    from tests.tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny_draft")
    save_tiny_model("llama3", folder, seed=5)
    return str(folder)


@pytest.mark.parametrize("setting", [{}, {"blocks": 14}, {"max_num_batched_tokens": 16}],
                         ids=["default", "preemption", "chunked"])
def test_draft_model_greedy_equals_no_speculation(tiny_llama3_fp32, repeated_prompts, greedy_reference,
                                                  tiny_random_draft, setting):
    own = {"method": "draft_model", "model": str(tiny_llama3_fp32.source.path), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    got, core = _generate(tiny_llama3_fp32, repeated_prompts, speculative_config=own, **setting)
    assert got == greedy_reference
    stats = core.stats()
    # The model as its own draft: every draft is its own argmax, so every draft stands.
    assert stats.spec_num_draft_tokens > 100 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if "blocks" in setting:
        assert stats.num_preemptions > 0
    draft = core.runner.spec.proposer
    assert not draft.states and len(draft.free_blocks) == core.kv_cache.num_blocks - 1  # every draft block back


def test_tiny_random_draft_greedy_equals_no_speculation(tiny_llama3_fp32, repeated_prompts, greedy_reference,
                                                        tiny_random_draft):
    rnd = {"method": "draft_model", "model": tiny_random_draft, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    got, core = _generate(tiny_llama3_fp32, repeated_prompts[:3], speculative_config=rnd, blocks=20)
    assert got == greedy_reference[:3]
    stats = core.stats()
    assert stats.spec_num_draft_tokens > 100 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 10


def test_draft_model_sampled_keeps_seeds(tiny_llama3_fp32, repeated_prompts):
    own = {"method": "draft_model", "model": str(tiny_llama3_fp32.source.path), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=11, max_tokens=24, ignore_eos=True)
    a, core = _generate(tiny_llama3_fp32, repeated_prompts[:2], seeded, speculative_config=own)
    b, _ = _generate(tiny_llama3_fp32, repeated_prompts[:2], seeded, speculative_config=own)
    assert a == b and core.stats().spec_num_accepted_tokens > 0


def test_load_gate_turns_drafts_off_above_the_batch_size(tiny_llama3_fp32, repeated_prompts, greedy_reference):
    from pagoda.config import DEFAULT_DISABLE_BY_BATCH_SIZE, EngineArgs

    assert EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config \
        .disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=256, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    core = llm.engine.core
    core.runner.spec.proposer = OracleProposer({tuple(p): o for p, o in zip(repeated_prompts, greedy_reference)})
    sizes = []
    original = core.scheduler.schedule

    def spy():
        out = original()
        sizes.append((len(out.scheduled), sum(bool(s.spec_token_ids) for s in out.scheduled)))
        return out

    core.scheduler.schedule = spy
    # Different lengths, so the batch shrinks from 6 to 1 as requests finish.
    params = [GREEDY.clone(max_tokens=6 * (i + 1)) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in repeated_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [g[: 6 * (i + 1)] for i, g in enumerate(greedy_reference)]
    # Drafts proposed in a step of more than 2 requests would show in the next step's rows.
    assert any(n > 2 for n, _ in sizes) and any(d for _, d in sizes)
    for (prev_n, _), (_, drafted) in zip(sizes, sizes[1:]):
        if prev_n > 2:
            assert drafted == 0


@pytest.mark.slow
def test_smollm2_draft_models_greedy_equal_transformers(smollm2_fp32, smollm2_prompt_ids, smollm2_hf_greedy32,
                                                        tmp_path):
    # The model as its own draft (every draft stands) and a tiny random draft with SmolLM2's
    # vocabulary (almost none stands): either way the output is the target's own, here on 4 of the
    # 16 SmolLM2 prompts (the draft model's forwards make each prompt cost several target steps).
    from tests.tiny_models import save_tiny_model

    save_tiny_model("llama3", tmp_path, seed=3, vocab_size=smollm2_fp32.config.vocab_size)
    prompts, expected = smollm2_prompt_ids[:4], smollm2_hf_greedy32[:4]
    for draft, accepts_all in ((str(smollm2_fp32.source.path), True), (str(tmp_path), False)):
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None}
        llm = make_engine(smollm2_fp32, speculative_config=config)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SLOW_GREEDY32, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, draft
        stats = llm.engine.core.stats()
        assert stats.spec_num_draft_tokens > 0
        if accepts_all:
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        else:
            assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 4
        assert llm.engine.core.kv_manager.usage == 0.0
