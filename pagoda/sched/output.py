"""What one scheduling step decided, as plain data for the execution layer (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.sched.request import Request


class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, +num_new_tokens)."""

    __slots__ = (
        "request",
        "request_id",
        "num_computed_tokens",
        "num_new_tokens",
        "new_block_ids",
        "block_ids",
        "is_new",
        "num_tokens",
    )

    def __init__(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        new_block_ids: list[int],
        block_ids: list[int],
        is_new: bool,
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.num_computed_tokens = num_computed_tokens  # before this step, after cache hits
        self.num_new_tokens = num_new_tokens
        self.new_block_ids = new_block_ids
        # The whole table, a copy: the runner may keep or extend it.
        self.block_ids = block_ids
        # First scheduled, or resumed after preemption: the runner must (re)build its state.
        self.is_new = is_new
        self.num_tokens = len(request.all_token_ids)  # known tokens when scheduled

    @property
    def samples(self) -> bool:
        """This step reaches the end of the known tokens, so a token is sampled for it."""
        return self.num_computed_tokens + self.num_new_tokens >= self.num_tokens

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request_id!r}, computed={self.num_computed_tokens}, "
            f"new={self.num_new_tokens}, new_blocks={self.new_block_ids}, is_new={self.is_new})"
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order: running, then new
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Finished or aborted since the previous schedule(): the runner drops their cached state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
