"""Tool calls in /v1/chat/completions: `tool_choice` as a named function or "required", enforced by
structured outputs (the JSON schema of the function's parameters, or a list of calls to the tools),
and the generated JSON turned into OpenAI's `tool_calls`.

These need no model-specific parser: the output is JSON by construction. "auto" (the model decides,
in its own call syntax) needs the server's tool-call parser (`pagoda.serve.tool_parsers`, applied by
`pagoda.serve.chat_output`); "none" generates text, the tools still reach the chat template so the
model knows them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pagoda.errors import InvalidRequestError


class ToolChoiceError(InvalidRequestError):
    """The request's tools or tool_choice cannot be served (a 400 on the request field `field`)."""


def functions_of(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, checking each tool's shape."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolChoiceError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                  "'parameters': {...}}}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[fn["name"]] = params
    return out


def tool_call_schema(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> tuple[str, dict] | None:
    """(mode, JSON schema to enforce) for a named function ("named") or "required"; ("auto", {}) for
    "auto" (the default with tools), whose grammar the tool-call parser makes; None when the output
    is text ("none", or no tools)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools", "tool_choice")
        return None
    functions = functions_of(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        return "auto", {}
    if tool_choice == "required":
        calls = [
            {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"const": name}, "parameters": params}}
            for name, params in functions.items()
        ]
        return "required", {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name is None:
        raise ToolChoiceError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                              f"'function': {{'name': ...}}}}, got {tool_choice!r}", "tool_choice")
    if name not in functions:
        raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    return "named", functions[name]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(mode: str, tool_choice: Any, text: str) -> list[dict[str, Any]] | None:
    """OpenAI's tool_calls from the generated JSON; None when it is not complete JSON (the output was
    cut by max_tokens or a stop string), in which case the text is returned as content."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if mode == "named":
        return [_call(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    try:  # the grammar made it a list of {name, parameters}, unless its matcher failed
        return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
    except (TypeError, KeyError):
        return None
