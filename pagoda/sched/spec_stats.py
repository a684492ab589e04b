"""Speculative decoding's counters, kept by the scheduler, which sees every verified row in update().

Named as vLLM's spec_decode_* metrics: rows verified (drafts), draft tokens scored, draft tokens
accepted, and accepted drafts by their position in the draft (position 0 is the first draft token).
"""

from __future__ import annotations


class SpecDecodeCounters:
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_fields(self) -> dict:
        """SchedulerStats' spec_* fields."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
