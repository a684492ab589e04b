"""Pydantic models of the request bodies the server accepts: OpenAI's fields plus vLLM's extensions.

Only requests are modelled; responses are built as plain dicts in `pagoda.serve.openai_format`
(cheaper per streamed chunk, and their shape is pinned by tests against the `openai` client).
Unknown fields are ignored, as OpenAI-compatible servers do, so newer clients keep working.
Turning a request into `SamplingParams` lives here too, so every field's meaning is in one file.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, field_validator, model_validator

from pagoda.engine.input_processor import check_structured_outputs
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.serve.tool_calls import tool_call_schema

_SEED_MAX = 2**63 - 1
# Integers travel to the engine core as msgpack, which holds 64 bits: larger ones must be a 400 here,
# not an OverflowError once the request is half sent.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
# JSON may spell a lone UTF-16 surrogate ("\ud800"); such a string cannot be encoded as UTF-8, so the
# tokenizer, the msgpack encoder and even our own error response would fail on it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_lone_surrogate(value: Any) -> tuple | None:
    """The path to a string (or dict key) in `value` that holds a lone surrogate, else None.
    A loop, not recursion: a deeply nested body must not end in RecursionError (a 500)."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _LONE_SURROGATE.search(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and _LONE_SURROGATE.search(k):
                    return (*path, k)
                stack.append(((*path, k), item))
        elif isinstance(v, list):  # only what can hold text: a long list of token ids costs little
            stack.extend(((*path, i), item) for i, item in enumerate(v) if isinstance(item, (str, dict, list)))
    return None


class _Body(BaseModel):
    # allow_inf_nan: Python's JSON parser accepts NaN and Infinity, which no sampling knob means.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Request(_Body):
    """A whole request body (not a part of one): its strings must be valid Unicode, and the fields
    named in `_null_means_default` take their default when sent as null."""

    # OpenAI's API lets these be null, meaning the default; some clients send every field, null or not.
    _null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = _find_lone_surrogate(data)
        if found is not None:
            where = ".".join(str(x) for x in found) or "the request body"
            raise InvalidRequestError(f"{where}: the text is not valid Unicode (a lone surrogate)",
                                      field=str(found[0]) if found else None)
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls._null_means_default):
            data = {k: v for k, v in data.items() if v is not None or k not in cls._null_means_default}
        return data


# vLLM's older structured-outputs fields, each the StructuredOutputsParams key it sets.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _checked_structured_outputs(name: str, spec: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams(**spec) whose grammar compiles, else an InvalidRequestError naming the request
    field `name` it came from (checked here so that the 400 names it)."""
    try:
        params = StructuredOutputsParams(**spec)
        check_structured_outputs(params)
    except TypeError:  # a key StructuredOutputsParams does not have
        raise InvalidRequestError(
            f"{name}: give one of json, regex, choice, grammar or json_object, got {sorted(spec)}", field=name
        ) from None
    except ValueError as exc:
        raise InvalidRequestError(f"{name}: {exc}", field=name) from None
    return params


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    _null_means_default = frozenset({"n", "stream"})

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Strict()]] | None = None  # a number, not "10" or true
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=_INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0, le=_INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[_Int64] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: _Int64 | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=0)  # the prompt tokens' logprobs, top-N
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT64_MAX)  # keep the prompt's last k tokens
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs ({"json" | "regex" |
    # "choice" | "grammar" | "json_object": ...}) and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for key in self.logit_bias or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 18:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", field="logit_bias")
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM: a stream's chunks have no place for them.
            raise InvalidRequestError("prompt_logprobs are not available when stream is true", field="prompt_logprobs")
        return self

    @property
    def structured_outputs_requested(self) -> bool:
        rf = self.response_format
        return (rf is not None and rf.get("type") not in (None, "text")) or any(
            getattr(self, name) is not None for name in ("structured_outputs", *_GUIDED_FIELDS)
        )

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one structured-outputs request among the fields that can make it, or None."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise InvalidRequestError(
                        "response_format json_schema needs json_schema.schema, a JSON schema object",
                        field="response_format",
                    )
                found.append(("response_format", {"json": schema}))
            elif kind not in (None, "text"):
                raise InvalidRequestError(
                    f"response_format type must be text, json_object or json_schema, got {kind!r}",
                    field="response_format",
                )
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs))
        for name, key in _GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if not found:
            return None
        if len(found) > 1:
            raise InvalidRequestError(f"give one structured-outputs field, not {' and '.join(n for n, _ in found)}",
                                      field=found[1][0])
        return _checked_structured_outputs(*found[0])

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for values the model-level checks let through."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            # OpenAI clamps each bias to [-100, 100], which already bans or forces a token.
            logit_bias={int(k): min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self._structured_outputs(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    _null_means_default = _SamplingFields._null_means_default | {"echo"}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0)  # at most the engine's --max-logprobs (checked there)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM extension

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, p: Any) -> Any:
        if isinstance(p, list) and (not p or any(isinstance(x, list) and len(x) == 0 for x in p)):
            raise ValueError("prompt must not be empty")
        return p

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 is only allowed with echo)", field="max_tokens")
        if self.max_tokens == 0 and self.min_tokens > 0:
            # Checked here: the engine request asks for one token (see to_sampling_params), so
            # SamplingParams' own check would name max_tokens 1, which the client never sent.
            raise InvalidRequestError(f"min_tokens must be <= max_tokens (0), got {self.min_tokens}",
                                      field="min_tokens")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the answer is the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def echo_logprobs(self) -> bool:
        """The choice's logprobs start with the echoed prompt's."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        # echo_only still samples one token (the engine always generates); the answer drops it.
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo_logprobs:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id... go to the template
    role: str
    content: str | list[ContentPart] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"message content of type {part.type!r} is not supported (text only)",
                                              "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        msg = dict(self.model_extra or {})
        msg["role"] = self.role
        msg["content"] = "" if content is None else content
        return msg


class ChatCompletionRequest(_SamplingFields):
    _null_means_default = _SamplingFields._null_means_default | {"logprobs"}

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    _tool_call: tuple[str, dict] | None = PrivateAttr(default=None)  # (mode, schema), from tool_call_schema
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self._tool_call = tool_call_schema(self.tools, self.tool_choice)  # a ToolChoiceError names its field
        if self._tool_call is not None and self.structured_outputs_requested:
            raise InvalidRequestError(
                "tool_choice and structured outputs (response_format, structured_outputs, guided_*) cannot be combined",
                field="tool_choice",
            )
        return self

    @property
    def tool_call_mode(self) -> str | None:
        """"named" or "required" when the answer is tool calls, "auto" when the model may call them,
        else None."""
        return self._tool_call[0] if self._tool_call is not None else None

    @property
    def forced_tool_call(self) -> bool:
        return self.tool_call_mode in ("named", "required")

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(max_tokens, logprobs)
        if self.forced_tool_call:
            # The calls' JSON, enforced token by token (a named function: its parameters' schema).
            params.structured_outputs = _checked_structured_outputs("tools", {"json": self._tool_call[1]})
        return params

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, plus the tools for templates that show them to the model."""
        if not self.tools:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "tools": self.tools}

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]

