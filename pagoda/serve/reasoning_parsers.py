"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the model's thinking, between `<think>` and
`</think>`, goes to the message's `reasoning_content` instead of its `content`, whole or streamed.

- `deepseek_r1`: the answer starts in thinking (its chat template opens `<think>` in the prompt);
  everything before `</think>` is reasoning, all of it when `</think>` never comes (cut short).
- `qwen3`: thinking only when the answer has `</think>` (a leading `<think>` is dropped); without
  it the whole answer is content (thinking switched off by `enable_thinking: false`). Streamed, an
  answer that does not open with `<think>` is content from its first character.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    name = ""
    starts_in_reasoning = False  # without </think>: reasoning (deepseek_r1) or content (qwen3)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part."""
        body = text
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            body = stripped[len(THINK_START):]
        reasoning, end, content = body.partition(THINK_END)
        if not end:
            return (body or None, None) if self.starts_in_reasoning else (None, text or None)
        return reasoning or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


class ReasoningStream:
    """One choice's text as it streams, split into (reasoning delta, content delta); a possible
    start of `<think>` or `</think>` is held back until it is known."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.buffer = ""
        # "start": not yet known whether the answer opens with <think>; then "reasoning", "content".
        self.mode = "reasoning" if parser.starts_in_reasoning else "start"
        self.opened = False  # a leading <think> was consumed

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.mode == "start" or (self.mode == "reasoning" and not self.opened):
                stripped = self.buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self.buffer = stripped[len(THINK_START):]
                    self.opened, self.mode = True, "reasoning"
                    continue
                if THINK_START.startswith(stripped):  # "", or a part of "<think>": wait
                    return reasoning, content
                self.opened = True  # no <think>: deepseek_r1 still thinks, qwen3 answers
                if self.mode == "start":
                    self.mode = "content"
            if self.mode == "content":
                content += self.buffer
                self.buffer = ""
                return reasoning, content
            before, end, after = self.buffer.partition(THINK_END)
            if end:
                reasoning += before
                self.buffer, self.mode = after, "content"
                continue
            keep = _held(self.buffer, THINK_END)
            reasoning += self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back, once the choice ended."""
        rest, self.buffer = self.buffer, ""
        if self.mode == "reasoning":
            return rest, ""
        return "", rest
