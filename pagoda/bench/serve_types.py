"""The records `bench serve` passes between its load generator, metrics and plot: the run's
settings (`ServeConfig`), a prompt to send, and one request's timestamps (`RequestResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServeConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    num_prompts: int = 128
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len_min: int = 32
    input_len_max: int = 512
    output_len: int = 128
    seed: int = 0
    prompt_format: str = "ids"  # "ids": token-id lists; "text": the ids decoded by the tokenizer
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    num_warmups: int = 1
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    ready_timeout_s: float = 300.0  # how long warm-up waits for a server that is still starting


@dataclass
class Prompt:
    prompt: list[int] | str
    prompt_len: int  # tokens as we built them (the server's usage wins when reported)


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    output_len: int  # asked for
    send_time: float = 0.0  # seconds since the benchmark started
    token_times: list[float] = field(default_factory=list)  # same clock, one per token event
    end_time: float = 0.0
    output_tokens: int = 0
    usage_reported: bool = False
    success: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]
