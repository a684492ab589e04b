"""A chat choice's generated text as the client sees it, when the server has parsers: the thinking as
`reasoning_content` (`--reasoning-parser`), the calls of `tool_choice: "auto"` as `tool_calls`
(`--enable-auto-tool-choice --tool-call-parser NAME`), the rest as `content`; for whole responses
(`whole_message`) and streams (`ChoiceStream`). Also what such a request asks of the engine: the
grammar that holds a started call to the tools (`apply_auto_tools`).

Forced calls (`tool_choice` "required" or a named function) need no parser: `pagoda.serve.tool_calls`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from pagoda.engine.input_processor import check_structured_outputs
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.serve.reasoning_parsers import ReasoningParser, ReasoningStream, get_reasoning_parser
from pagoda.serve.tool_calls import functions_of
from pagoda.serve.tool_parsers import ParsedCall, ToolCallStream, ToolParser, Vocabulary, get_tool_parser

_VOCABULARIES: "weakref.WeakKeyDictionary[Any, Vocabulary]" = weakref.WeakKeyDictionary()


@dataclass
class ChatParsers:
    """The server's parsers (None: that part of the text is content)."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None  # only with --enable-auto-tool-choice

    @classmethod
    def from_names(cls, reasoning: str | None, tool_call_parser: str | None, auto_tool_choice: bool) -> "ChatParsers":
        """Raises ValueError (one line) for an unknown name or auto tool choice without a parser."""
        if auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        return cls(get_reasoning_parser(reasoning) if reasoning else None,
                   get_tool_parser(tool_call_parser) if tool_call_parser and auto_tool_choice else None)


def vocabulary(tokenizer: Any) -> Vocabulary:
    """The tokenizer's markers, worked out once per tokenizer."""
    vocab = _VOCABULARIES.get(tokenizer) if tokenizer is not None else None
    if vocab is None:
        vocab = Vocabulary(tokenizer)
        if tokenizer is not None:
            _VOCABULARIES[tokenizer] = vocab
    return vocab


def apply_auto_tools(params: SamplingParams, parser: ToolParser | None, tools: list[dict], tokenizer: Any) -> None:
    """Make `params` hold calls to `tools` in `parser`'s syntax once the model starts one; an
    InvalidRequestError (a 400 on `tool_choice`) when the server has no tool-call parser."""
    if parser is None:
        raise InvalidRequestError(
            'tool_choice "auto" (the default with tools) needs the server started with --enable-auto-tool-choice '
            "and --tool-call-parser; or use 'required', a named function or 'none'", "tool_choice")
    vocab = vocabulary(tokenizer)
    grammar = StructuredOutputsParams(grammar=parser.grammar(functions_of(tools), vocab))
    try:
        check_structured_outputs(grammar)
    except ValueError as exc:  # a parameters schema the grammar engine cannot compile
        raise InvalidRequestError(f"tools: {exc}", "tools") from None
    params.structured_outputs = grammar
    if parser.keeps_special_tokens(vocab):
        params.skip_special_tokens = False  # the trigger ([TOOL_CALLS]) must reach the parser


def _calls_delta(calls: list[ParsedCall], first_index: int) -> list[dict]:
    return [{"index": first_index + k, **c.openai()} for k, c in enumerate(calls)]


def whole_message(text: str, parsers: ChatParsers, auto_tools: bool) -> tuple[dict, bool]:
    """The assistant message of a finished choice, and whether it called tools."""
    reasoning, content = parsers.reasoning.split(text) if parsers.reasoning is not None else (None, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parsers.reasoning is not None:
        message["reasoning_content"] = reasoning
    called = False
    if auto_tools and parsers.tools is not None and content:
        content, calls = parsers.tools.extract(content)
        if calls:
            message["content"] = content
            message["tool_calls"] = [c.openai() for c in calls]
            called = True
    return message, called


class ChoiceStream:
    """One streamed choice: each text delta becomes the delta fields to send (possibly none yet)."""

    def __init__(self, parsers: ChatParsers, auto_tools: bool) -> None:
        self.reasoning = ReasoningStream(parsers.reasoning) if parsers.reasoning is not None else None
        self.tools = ToolCallStream(parsers.tools) if auto_tools and parsers.tools is not None else None
        self.num_calls = 0

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> dict:
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._delta(reasoning, content, final=False)

    def finish(self) -> dict:
        """The delta fields of what was held back, once the choice ended."""
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict:
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _calls_delta(calls, self.num_calls)
            self.num_calls += len(calls)
        return delta
