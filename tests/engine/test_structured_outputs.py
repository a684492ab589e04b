"""Structured outputs on SmolLM2: JSON schema, JSON object, regex, choice and grammar outputs follow
their grammar, end with EOS when complete, survive preemption, and leave other requests' greedy
output unchanged; bad grammars are refused up front."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from pagoda import SamplingParams, StructuredOutputsParams
from pagoda.exec.structured_output import StructuredOutputs, apply_bitmask_, check_structured_outputs
from tests.conftest import make_engine

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
# Chat turns, except the fourth: a plain few-shot prompt, since for "any JSON object" this small
# model rambles on in nested objects past any token budget when asked in a chat.
PROMPTS = [
    [{"role": "user", "content": "Describe Ann, who is 31, as a JSON object."}],
    [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
    [{"role": "user", "content": "What is the phone number of the White House?"}],
    'JSON: {"a": 1}\nJSON: {"b": 2}\nJSON:',
    [{"role": "user", "content": "Count to three."}],
    [{"role": "user", "content": "Say hello."}],
]


def _prompt_ids(tokenizer) -> list[dict]:
    return [
        {"prompt_token_ids": tokenizer.encode(p) if isinstance(p, str) else
         list(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))}
        for p in PROMPTS
    ]


def _params(max_tokens: int = 48) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [
        greedy.clone(structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        greedy.clone(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        greedy.clone(structured_outputs=StructuredOutputsParams(regex=PHONE)),
        greedy.clone(structured_outputs=StructuredOutputsParams(json_object=True)),
        greedy.clone(structured_outputs=StructuredOutputsParams(grammar='start: "one, two, three" | "1, 2, 3"')),
        greedy.clone(max_tokens=12),  # unconstrained, in the same batch
    ]


def _check(outs) -> None:
    texts = [o.outputs[0].text for o in outs]
    person = json.loads(texts[0])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 12
    assert texts[1] in ("yes", "no")
    assert re.fullmatch(PHONE, texts[2])
    assert isinstance(json.loads(texts[3]), dict)
    assert texts[4] in ("one, two, three", "1, 2, 3")
    # A complete grammar leaves EOS as the only token: each constrained output ends there.
    assert [o.outputs[0].finish_reason for o in outs[:5]] == ["stop"] * 5


def test_outputs_follow_their_grammar_and_leave_others_unchanged(smollm2_fp32, smollm2_tokenizer):
    prompts = _prompt_ids(smollm2_tokenizer)
    llm = make_engine(smollm2_fp32, tokenizer=smollm2_tokenizer, num_gpu_blocks_override=256)
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    _check(outs)
    alone = llm.generate(prompts[-1:], _params()[-1:], use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert not llm.engine.core.runner.structured_outputs.matchers  # every matcher dropped at the end

    # Preemption by recompute: a matcher keeps what its sequence sampled (the recompute samples nothing).
    small = make_engine(smollm2_fp32, tokenizer=smollm2_tokenizer, num_gpu_blocks_override=9)
    _check(small.generate(prompts, _params(), use_tqdm=False))
    assert small.engine.core.stats().num_preemptions > 0


def test_drafts_are_checked_against_the_grammar(smollm2_fp32, smollm2_tokenizer):
    """With n-gram drafts, every drafted position is masked by the grammar's state after the drafts
    before it: the outputs still follow their grammars and equal those without speculation."""
    prompts = _prompt_ids(smollm2_tokenizer)
    want = make_engine(smollm2_fp32, tokenizer=smollm2_tokenizer, num_gpu_blocks_override=256).generate(
        prompts, _params(), use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_engine(smollm2_fp32, tokenizer=smollm2_tokenizer, num_gpu_blocks_override=256, speculative_config=spec)
    verified = []
    original = llm.engine.core.runner.structured_outputs.mask_drafted
    llm.engine.core.runner.structured_outputs.mask_drafted = lambda logits, rows: (
        verified.extend(r[1] for r in rows), original(logits, rows))
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    _check(outs)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert verified  # constrained requests did carry drafts
    assert not llm.engine.core.runner.structured_outputs.matchers


def test_bad_structured_outputs_are_refused_up_front(smollm2_fp32, smollm2_tokenizer, tiny_llama3_fp32):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    for bad, why in ((StructuredOutputsParams(regex="[a-"), "unclosed character class"),
                     (StructuredOutputsParams(json='{"type": "objectx"}'), "objectx"),
                     (StructuredOutputsParams(json="not json"), "expected")):
        with pytest.raises(ValueError, match="the grammar does not compile"):
            check_structured_outputs(bad)
        with pytest.raises(ValueError, match=why):
            check_structured_outputs(bad)
    llm = make_engine(smollm2_fp32, tokenizer=smollm2_tokenizer, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="structured outputs: the grammar does not compile"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # A model without a tokenizer has no text to constrain.
    bare = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        bare.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), use_tqdm=False)


def test_bitmask_bans_exactly_the_zero_bits_of_its_rows():
    rng = np.random.default_rng(0)
    vocab = 100
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_bitmask_(logits, bitmask, [0, 2])
    for row in (0, 2):
        for t in range(vocab):
            allowed = (int(bitmask[row, t // 32]) >> (t % 32)) & 1
            assert (logits[row, t] == before[row, t]) if allowed else logits[row, t] == float("-inf")
    assert torch.equal(logits[1], before[1])  # an unconstrained row is untouched


def test_a_matcher_that_cannot_be_built_ends_only_its_request():
    def no_tokenizer():
        raise OSError("tokenizer files vanished")

    so = StructuredOutputs(no_tokenizer, vocab_size=100)
    logits = torch.randn(2, 100)
    before = logits.clone()
    so.mask(logits, [(1, "r", StructuredOutputsParams(regex="a+"), 37)])
    assert torch.equal(logits[0], before[0])  # not a constrained row
    assert logits[1].argmax() == 37 and torch.isinf(logits[1]).sum() == 99  # EOS alone: the request ends


def test_offline_engine_lends_its_tokenizer_and_a_failing_grammar_ends_only_its_request(
    tiny_llama3_fp32, tmp_path, caplog
):
    # The tiny model's folder has no tokenizer: the core must use the one the engine was given. That
    # word-level tokenizer has no decoder llguidance understands, so no matcher can be built (the
    # grammar itself was fine): the constrained requests end with EOS, the other one is untouched.
    from transformers import AutoTokenizer

    from tests.tiny_models import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    llm = make_engine(tiny_llama3_fp32, tokenizer=tokenizer, num_gpu_blocks_override=64)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(["w3 w4 w5"], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = plain.clone(ignore_eos=False, structured_outputs=StructuredOutputsParams(choice=["w7 w8", "w9"]))
    outs = llm.generate(["w3 w4 w5"] * 3, [constrained, plain, constrained], use_tqdm=False)
    assert "decoder type" in caplog.text  # llguidance's complaint about this tokenizer: it was used
    assert [o.outputs[0].token_ids for o in outs[::2]] == [[2], [2]]  # EOS (w2) alone, then stop
    assert outs[1].outputs[0].token_ids == want
