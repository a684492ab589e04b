"""Incremental detokenization with stop-string handling.

The engine produces token ids one step at a time; a request's text has to grow with them, be
streamed out in pieces, and end as soon as a stop string appears. Three things make this harder
than ``tokenizer.decode(ids)`` after every step:

* **Cost.** Re-decoding the whole output every step is quadratic in its length. We decode a small
  window instead, the way vLLM and Hugging Face's ``TextStreamer`` do: ``ids[prefix_offset:]`` is
  decoded and compared with the decode of ``ids[prefix_offset:read_offset]``; the difference is the
  new text. The few tokens of left context matter because many tokenizers decode a token
  differently at the start of a sequence (SentencePiece drops the leading space of ``▁word``).
* **Split characters.** Byte-level tokenizers (GPT-2, Llama 3, SmolLM2) split one multi-byte UTF-8
  character (an emoji, most CJK) across several tokens; a window ending inside such a character
  decodes to U+FFFD. Such text is held back until the character is complete, so no stream ever shows
  a replacement character that the final text does not have.
* **Stop strings.** A stop string can span token boundaries, and the text after it must never be
  shown. The text is searched as it grows and truncated at the first stop string found; the
  streaming delta also holds back any tail that could still turn out to be the start of a stop
  string, so that a client never receives half of a stop string which is later cut from the text.

The engine calls :meth:`IncrementalDetokenizer.update` with each step's new ids and reads
:meth:`IncrementalDetokenizer.get_delta_text` for streaming; :attr:`IncrementalDetokenizer.output_text`
holds the whole text so far.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["IncrementalDetokenizer", "INITIAL_PREFIX_TOKENS", "plain_decode"]

# How many prompt tokens seed the decode window. Enough left context for every tokenizer we know
# to decode the first output token as it would decode in the middle of a text (leading spaces,
# byte fallbacks); vLLM uses the same number.
INITIAL_PREFIX_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def plain_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own ``decode(ids, skip_special_tokens=...)`` where Hugging Face's
    ``decode`` would return its text unchanged, else None.

    Why: the wrapper's argument conversion and dispatch cost ~5 us of the ~6.5 a short window takes,
    and a stream decodes two windows a token, in the API process, whose CPU the core's threads
    share on a small machine. It adds nothing when the class keeps transformers' own ``decode`` and
    ``_decode`` (no model-specific decoding) and does not clean up tokenization spaces.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode:
        return None
    return getattr(backend, "decode", None)


class IncrementalDetokenizer:
    """Turns one request's stream of output token ids into text, and finds its stop strings.

    ``tokenizer`` is anything with Hugging Face's ``decode(ids, skip_special_tokens=...)``.
    ``prompt_token_ids`` only provide left context for the first output tokens; prompt text never
    appears in :attr:`output_text`.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        eos_token_id: int | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = plain_decode(tokenizer) or tokenizer.decode
        self.stop: list[str] = [s for s in stop if s]  # an empty stop string would end every request
        # As vLLM: the text of the first min_tokens output tokens is not searched for stop strings
        # (a stop string may still start there and end in later text).
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens seen
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.eos_token_id = eos_token_id

        # The full text so far: stop string and everything after it excluded (the stop string is kept
        # when include_stop_str_in_output).
        self.output_text: str = ""
        # The stop string that ended the request, once one has.
        self.stop_reason: str | None = None
        self.finished: bool = False

        # Only a tail of the prompt is kept: the window never reaches further back than that.
        context = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Decode of token_ids[prefix_offset:read_offset], cached: a held-back step then costs one
        # decode, a releasing step two.
        self._prefix_text = self._decode(context)
        # Characters of output_text already handed out by get_delta_text().
        self._num_sent_chars = 0

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int | None, flush: bool) -> str:
        """Appends one token (None: none) and returns the text that became certain.

        With ``flush`` the request is over, so text ending in an incomplete character is final too:
        it is released as the full decode shows it (with U+FFFD), which keeps output_text equal to
        ``tokenizer.decode(all_ids)``.
        """
        if token_id is not None:
            self._token_ids.append(token_id)
        if self._read_offset == len(self._token_ids):
            return ""  # nothing pending
        window = self._token_ids[self._prefix_offset :]
        new_text = self._decode(window)
        # Hold back while the last character is still incomplete, and while the pending tokens have
        # decoded to nothing (skipped special tokens): the window then simply grows, which keeps the
        # left context of the next real token.
        if not flush and (len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: the tokens just released become the left context of the next ones.
        # Their prefix text must be decoded on its own rather than cut out of new_text, because a
        # sequence's first token may decode differently (SentencePiece drops its leading space) and
        # the next step compares against exactly that decode.
        had_context = self._read_offset > self._prefix_offset
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        if had_context:
            self._prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        else:
            self._prefix_text = new_text  # the window had no context, so it decoded these alone
        return delta

    # ------------------------------------------------------------------ stop strings

    def _append_and_check_stop(self, delta: str) -> str | None:
        """Appends decoded text; on a stop string truncates output_text and returns the stop."""
        if not delta:
            return None
        if self._num_tokens <= self.min_tokens:
            self.output_text += delta  # min_tokens not reached: no stop string ends the text yet
            return None
        old_len = len(self.output_text)
        text = self.output_text + delta
        # A stop string found now must end inside the new text (earlier text was already searched),
        # so each search starts at most len(stop) - 1 characters before the new text.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            start = text.find(s, max(0, old_len - len(s) + 1))
            if start < 0:
                continue
            # The stop string that completes first wins, as a character-by-character reader would
            # see it; among those ending together, the longer (earlier-starting) one.
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            self.output_text = text
            return None
        end, start, s = best
        self.output_text = text[:end] if self.include_stop_str_in_output else text[:start]
        return s

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    # ------------------------------------------------------------------ engine API

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Adds a step's new token ids; returns the stop string matched, else None.

        A returned stop string means the request must end now: output_text has been truncated at
        it and tokens after it are ignored. ``finished`` says the request ends after these tokens
        for another reason (EOS, max_tokens, abort), so held-back text is released.
        """
        if self.finished:
            return None  # the request already ended; late tokens are not part of its text
        ids = list(new_token_ids)
        # The EOS that ends a request is a control token, not text: keep it out even when
        # special tokens are shown (vLLM does the same), unless the stop itself is wanted.
        if (
            finished
            and ids
            and self.eos_token_id is not None
            and ids[-1] == self.eos_token_id
            and not self.include_stop_str_in_output
        ):
            ids.pop()
        for token_id in ids:
            self._num_tokens += 1
            stop = self._append_and_check_stop(self._step(token_id, flush=False))
            if stop is not None:
                return self._finish(stop)
        if finished:
            stop = self._append_and_check_stop(self._step(None, flush=True))
            self._finish(stop)
            return stop
        return None

    def _finish(self, stop: str | None) -> str | None:
        self.finished = True
        self.stop_reason = stop
        return stop

    def get_delta_text(self) -> str:
        """Text added since the last call, safe to stream.

        While the request runs, this never ends in a character that is still incomplete (U+FFFD)
        and never ends in text that might be the start of a stop string; once it has finished,
        everything left is released.
        """
        end = len(self.output_text)
        if not self.finished:
            end -= self._stop_prefix_len(self.output_text)
        if end <= self._num_sent_chars:
            return ""
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta
