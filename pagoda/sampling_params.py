"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import json as _json
import math
import numbers
from dataclasses import dataclass, field

from pagoda.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of several strings, a Lark/GBNF grammar,
    or any JSON object (vLLM's names). Exactly one is set; the engine enforces it token by token."""

    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)  # one form, which msgpack carries as is
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of json, regex, choice, grammar or "
                             f"json_object; got {', '.join(given) or 'none'}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured outputs' choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured outputs' {name} must be a string, got {type(value).__name__}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N alternatives beside the sampled token
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100 to 100)
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens; -1: max_model_len
    skip_special_tokens: bool = True
    detokenize: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (
            isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) for x in self.stop)
        ):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                                      "stop_token_ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool):
            self.seed = int(self.seed)  # a numpy integer, say: the engine and msgpack want a plain int
        self._validate()
        if self.logit_bias is not None:
            # Plain ints and floats (numpy's would not travel to the engine core as msgpack).
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            # Names its field: the server's 400 says which one without reading the message.
            return InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", name)

        # Numbers first: a string would fail the comparisons below with a TypeError, and NaN would
        # pass every one of them (each comparison with NaN is false) and sample garbage.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            if isinstance(getattr(self, name), bool):
                raise bad(name, "must be an integer, not a boolean")
        if self.seed is not None and not isinstance(self.seed, numbers.Integral):
            raise bad("seed", "must be an integer")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise bad("truncate_prompt_tokens", "must be -1 (the context length) or an integer >= 1")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                and isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                for t, v in self.logit_bias.items()
            ):
                raise bad("logit_bias", "must map token ids (integers >= 0) to finite numbers")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
                                      "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self, **changes) -> "SamplingParams":
        from dataclasses import replace

        return replace(self, **changes)
