"""The input processor, without a model: every refusal is an InvalidRequestError naming the field to
blame (the server's OpenAI `param` comes from it), a cut prompt says so, and a prompt processed for
some params is not processed again for them."""

from __future__ import annotations

import pytest

from pagoda.engine.errors import ChatTemplateArgumentError, InvalidRequestError
from pagoda.engine.input_processor import InputProcessor, ModelLimits
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams


class _Tokenizer:
    """One token per character (its code point), with a chat template: enough for the checks."""

    chat_template = "{{ messages }}"
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "\x00" in text:
            raise ValueError("the tokenizer refuses NUL")
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, *, chat_template=None, add_generation_prompt=True,
                            continue_final_message=False, tokenize=True, return_dict=False, truncation=False,
                            **template_kwargs):
        if any("content" not in m for m in messages):
            raise KeyError("content")
        return [ord(c) for m in messages for c in m["content"]]


def _processor(**kw) -> InputProcessor:
    limits = ModelLimits(vocab_size=128, max_model_len=32, block_size=4, num_usable_blocks=6, max_logprobs=5)
    return InputProcessor(_Tokenizer(), limits, **kw)


@pytest.mark.parametrize("prompt,params,field,code", [
    ("hi", SamplingParams(logprobs=6), "logprobs", None),
    ("hi", SamplingParams(prompt_logprobs=6), "prompt_logprobs", None),
    ([], SamplingParams(), "prompt", None),
    ([500], SamplingParams(), "prompt", None),
    ("a\x00", SamplingParams(), "prompt", None),
    ({"nothing": 1}, SamplingParams(), "prompt", None),
    ("hi", SamplingParams(logit_bias={200: 1.0}), "logit_bias", None),
    ("hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), "structured_outputs", None),
    ("x" * 32, SamplingParams(), "prompt", "context_length_exceeded"),
    ("hi", SamplingParams(max_tokens=31), "max_tokens", "context_length_exceeded"),
    ("hi", SamplingParams(max_tokens=30), "max_tokens", None),  # the KV cache holds 24 tokens
    ("hi", SamplingParams(truncate_prompt_tokens=33), "truncate_prompt_tokens", None),
    ("hi", SamplingParams(seed=2**64), "seed", None),
])
def test_refusals_name_their_field(prompt, params, field, code):
    with pytest.raises(InvalidRequestError) as e:
        _processor(strict_max_tokens=True).process(prompt, params)
    assert (e.value.field, e.value.code) == (field, code), e.value


def test_offline_caps_max_tokens_at_the_context_rather_than_refusing():
    ok = _processor().process("hi", SamplingParams(max_tokens=22))
    assert ok.prompt_token_ids == [ord("h"), ord("i")] and ok.text == "hi" and not ok.truncated


def test_sampling_params_refusals_name_their_field():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"stop": [""]}, "stop"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                          ({"max_tokens": 2, "min_tokens": 3}, "min_tokens")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == field


def test_chat_refusals_name_their_field():
    proc = _processor()
    with pytest.raises(ChatTemplateArgumentError) as e:
        proc.render_chat([{"role": "user", "content": "x"}], chat_template_kwargs={"truncation": True})
    assert e.value.field == "chat_template_kwargs"
    for messages, kwargs in [([{"role": "user"}], {}),  # the template fails: its error, on messages
                             ([{"role": "user", "content": "x"}], {"continue_final_message": True})]:
        with pytest.raises(InvalidRequestError) as e:
            proc.render_chat(messages, **kwargs)
        assert e.value.field == "messages"
    assert proc.render_chat([{"role": "user", "content": "ab"}]) == [97, 98]


def test_truncation_keeps_the_end_and_says_so():
    params = SamplingParams(truncate_prompt_tokens=3)
    cut = _processor().process("abcdef", params)
    assert cut.prompt_token_ids == [100, 101, 102] and cut.truncated and cut.text == "abcdef"
    whole = _processor().process("ab", params)
    assert whole.prompt_token_ids == [97, 98] and not whole.truncated


def test_a_processed_prompt_is_processed_again_only_for_other_params():
    proc = _processor(strict_max_tokens=True)
    params = SamplingParams(max_tokens=4)
    done = proc.process("abc", params)
    assert proc.ensure_processed(done, params) is done
    with pytest.raises(InvalidRequestError) as e:  # 3 + 30 tokens do not fit these params' context
        proc.ensure_processed(done, SamplingParams(max_tokens=30))
    assert e.value.field == "max_tokens"
