"""Tool-call parsers for `tool_choice: "auto"`, by model family, under vLLM's `--tool-call-parser` names:

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated
- `llama3_json` (Llama 3.1/3.2/3.3): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;`
- `mistral` (Mistral v3 tokenizers: 7B v0.3, Nemo, Small): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`

Each parser knows its family's syntax twice: as a grammar, so that once the model starts a call the
structured-outputs engine (llguidance, `pagoda.exec.structured_output`) holds it to a known function
and that function's parameters' schema (text before the call, and after it, stays free), and as a
parser of the text, whole (`extract`) or as it streams (`ToolCallStream`). The grammar is why an
emitted call always parses: a call cut short by `max_tokens` is the only one that does not, and its
text is returned as content, as vLLM does.

A marker that is one token of the model's vocabulary (`<tool_call>` for Qwen, `[TOOL_CALLS]` for
Mistral) is named by its id in the grammar; otherwise (`{"name"`) it is text, matched however the
model spells it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

# llguidance's JSON options: the separators models print (json.dumps'), no free whitespace, so a
# call's arguments cannot run on in blanks.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class Vocabulary:
    """What the grammars need to know of the tokenizer: which markers are single tokens, and which of
    those the detokenizer drops (special ones), so that their requests keep special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.added: dict[str, int] = dict(tokenizer.get_added_vocab()) if tokenizer is not None else {}
        self.special: set[str] = set(getattr(tokenizer, "all_special_tokens", ()) or ())

    def lit(self, text: str) -> str:
        """The grammar's term for `text`: its token, or the text itself."""
        token = self.added.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def is_token(self, text: str) -> bool:
        return text in self.added


def _schema(params: dict[str, Any]) -> str:
    return json.dumps({**params, "x-guidance": _JSON_STYLE}, ensure_ascii=False)


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text; None when they are not a JSON object."""
    if isinstance(value, str):  # some models quote them
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = _arguments(obj[key])
            return None if args is None else ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], "{}")


class ToolParser:
    """One family's call syntax. `triggers`: the texts that start a call; `region` parses the text
    from the first trigger on into its complete calls."""

    name: str = ""
    triggers: tuple[str, ...] = ()
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def tags(self, functions: dict[str, dict], vocab: Vocabulary) -> list[tuple[str, str]]:
        """(trigger, grammar after the trigger) of each way a call may go."""
        raise NotImplementedError

    def region(self, text: str, final: bool) -> tuple[list[ParsedCall], bool]:
        """The complete calls in `text` (which starts with a trigger), and whether it parsed as
        calls at all (False: its text is content)."""
        raise NotImplementedError

    def keeps_special_tokens(self, vocab: Vocabulary) -> bool:
        """Whether the text must keep special tokens: a trigger the detokenizer would drop."""
        return any(t in vocab.special for t in self.triggers)

    def grammar(self, functions: dict[str, dict], vocab: Vocabulary) -> str:
        """A Lark grammar (llguidance's dialect) for a whole answer: free text, with every call in this
        family's syntax. A `<think>` block first stays free too, when the vocabulary has those tokens."""
        lines = ["%llguidance {}"]
        rules = []
        for i, (trigger, body) in enumerate(self.tags(functions, vocab)):
            if vocab.is_token(trigger):
                lines.append(f"tag_{i}: TEXT {vocab.lit(trigger)} {body}")
            else:  # lazy: the free text ends at the trigger's first occurrence
                lines.append(f"tag_{i}_trigger[lazy]: TEXT {json.dumps(trigger)}")
                lines.append(f"tag_{i}: tag_{i}_trigger {body}")
            rules.append(f"tag_{i}")
        think = ""
        if vocab.is_token(THINK_START) and vocab.is_token(THINK_END):
            # Any token but </think> inside (a <tool_call> token there is thinking, not a call).
            end = vocab.added[THINK_END]
            lines.append(f"think: {vocab.lit(THINK_START)} <[^{end}]>* {vocab.lit(THINK_END)} | TEXT {vocab.lit(THINK_END)}")
            think = "think? "
        lines.insert(1, f"start: {think}({' | '.join(rules)})* TEXT")
        lines.append(r"TEXT: /(.|\n)*/")
        return "\n".join(lines) + "\n"

    def first_trigger(self, text: str) -> int:
        found = [i for i in (text.find(t) for t in self.triggers) if i >= 0]
        return min(found) if found else -1

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole answer; the content is the text before the first call."""
        start = self.first_trigger(text)
        if start < 0:
            return text, []
        calls, ok = self.region(text[start:], final=True)
        if not ok or not calls:
            return text, []
        return text[:start] or None, calls


class HermesParser(ToolParser):
    name = "hermes"
    triggers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    _open = re.compile(r"<tool_call>\s*(.*?)\s*$", re.DOTALL)

    def tags(self, functions: dict[str, dict], vocab: Vocabulary) -> list[tuple[str, str]]:
        end = vocab.lit("</tool_call>")
        out = []
        for name, params in functions.items():
            head = '\n{"name": ' + json.dumps(name) + ', "arguments": '
            out.append(("<tool_call>", f"{json.dumps(head)} %json {_schema(params)} {json.dumps('}' + chr(10))} {end}"))
        return out

    def region(self, text: str, final: bool) -> tuple[list[ParsedCall], bool]:
        calls: list[ParsedCall] = []
        end = 0
        for m in self._block.finditer(text):
            call = _json_call(m.group(1), self.args_keys)
            if call is None:
                return [], False
            calls.append(call)
            end = m.end()
        if final:
            tail = self._open.search(text, end)
            if tail is not None:  # closed by EOS rather than </tool_call>: a whole call is still a call
                call = _json_call(tail.group(1), self.args_keys)
                if call is None:  # cut short: the calls before it stand
                    return calls, bool(calls)
                calls.append(call)
        return calls, True


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    triggers = ("<|python_tag|>", '{"name"')
    args_keys = ("parameters", "arguments")

    def tags(self, functions: dict[str, dict], vocab: Vocabulary) -> list[tuple[str, str]]:
        out = []
        trigger = self.triggers[1]
        for name, params in functions.items():
            head = '{"name": ' + json.dumps(name) + ', "parameters": '
            body = f"%json {_schema(params)} {json.dumps('}')}"
            out.append((trigger, f"{json.dumps(head[len(trigger):])} {body}"))
            if vocab.is_token("<|python_tag|>"):
                out.append(("<|python_tag|>", f"{json.dumps(head)} {body}"))
        return out

    def region(self, text: str, final: bool) -> tuple[list[ParsedCall], bool]:
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            text_at = text[pos:].lstrip()
            if text_at.startswith("<|python_tag|>"):
                text_at = text_at[len("<|python_tag|>"):].lstrip()
            if not text_at.startswith("{"):
                break
            start = len(text) - len(text_at)
            try:
                obj, end = decoder.raw_decode(text, start)
            except ValueError:
                return calls, bool(calls) or not final
            call = _call(obj, self.args_keys)
            if call is None:
                return [], False
            calls.append(call)
            pos = end
            rest = text[pos:].lstrip()
            if rest.startswith(";"):
                pos = len(text) - len(rest) + 1
        return calls, True


class MistralParser(ToolParser):
    name = "mistral"
    triggers = ("[TOOL_CALLS]",)

    def tags(self, functions: dict[str, dict], vocab: Vocabulary) -> list[tuple[str, str]]:
        items = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                  "properties": {"name": {"const": name}, "arguments": params}} for name, params in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return [("[TOOL_CALLS]", f'" "? %json {_schema(schema)}')]  # sentencepiece models like a space first

    def region(self, text: str, final: bool) -> tuple[list[ParsedCall], bool]:
        body = text[len("[TOOL_CALLS]"):].lstrip()
        try:
            value, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return [], not final
        value = value if isinstance(value, list) else [value]
        calls = [_call(v, self.args_keys) for v in value]
        if any(c is None for c in calls):
            return [], False
        return calls, True  # type: ignore[return-value]


def _json_call(text: str, args_keys: tuple[str, ...]) -> ParsedCall | None:
    try:
        return _call(json.loads(text), args_keys)
    except ValueError:
        return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers` (held back from a stream)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolCallStream:
    """One choice's text as it streams: content deltas up to the first call, then each call once it
    is complete. The text that may be the start of a trigger is held back until it is known."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # content characters sent
        self.calls_sent = 0
        self.start = -1  # where the first call starts, once seen

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        if self.start < 0:
            self.start = self.parser.first_trigger(self.text)
        if self.start < 0:
            safe = len(self.text) - _held_prefix(self.text, self.parser.triggers)
            return self._content(safe), []
        content = self._content(self.start)
        calls, _ = self.parser.region(self.text[self.start:], final=False)
        return content, self._new(calls)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The rest, once the choice ended: calls not yet sent, or, when the calls do not parse (cut
        by max_tokens), their text as content."""
        if self.start < 0:
            return self._content(len(self.text)), []
        calls, ok = self.parser.region(self.text[self.start:], final=True)
        if not ok or not calls:
            if self.calls_sent:
                return "", []
            return self._content(len(self.text)), []
        return self._content(self.start), self._new(calls)

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def _content(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def _new(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        new = calls[self.calls_sent:]
        self.calls_sent = len(calls)
        return new
