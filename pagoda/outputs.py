"""What generation returns to users, with vLLM's names: RequestOutput, CompletionOutput, Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when not known
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # scores it), else that token's Logprob and the top-N alternatives. A delta stream sends it once.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The weights that produced it: their version, or "A+B" when an in-place update swapped A for B
    # while it ran. None where unknown.
    weight_version: str | None = None
