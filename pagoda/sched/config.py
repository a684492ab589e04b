"""SchedulerConfig: the knobs of the token-budget scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 2048  # prompt + output tokens at most
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # per-request prefill tokens per step; 0: no cap
    policy: Literal["fcfs", "priority"] = "fcfs"
    # recompute: a victim's blocks are freed and recomputed on resume; swap: they go to the KV
    # manager's second tier and come back (recompute when it has no room).
    preemption_mode: Literal["recompute", "swap"] = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step, or it would block the queue forever.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off"
            )
