"""What the scheduler decided for one step, as plain data for the execution layer.

Owns `SchedulerOutput` (the step), `ScheduledRequest` (one request's share of it), `NewRequestData`
(what a runner needs to (re)build a request's state), `KVTransfer` (a block copy between the KV
tiers, ordered by the KV manager, carried out by the runner's side) and `SchedulerStats`. Everything here is ints,
lists of ints, strings and `SamplingParams`, never a scheduler object, so the model runner depends on
no scheduler code and a step can be sent to a worker process as it is (msgspec structs encode
directly).

The step is incremental, as vLLM's is: a request's prompt, its outputs so far and its sampling
parameters travel once, when it is first scheduled or resumed after preemption (`new_request`); after
that each step carries only the token ids it computes. The runner keeps a per-request mirror of the
token ids, built from `new_request` and extended from `new_token_ids`, so nothing per step is
proportional to a request's context length (the block table copy aside, see `block_ids`).
"""

from __future__ import annotations

import msgspec

from pagoda.sampling_params import SamplingParams

# The per-row structs are gc=False (not tracked by the cycle collector): a step makes hundreds of
# them, and tracked, they set off collections that walk every live request's token lists, which
# doubled schedule()'s time in benchmarks/bench_scheduler.py. They hold no reference cycles.


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the runner holds no state for: first scheduled, or resumed after preemption."""

    # Shared with the scheduler's request, which never changes it: the runner only reads it.
    prompt_token_ids: list[int]
    # The outputs so far (non-empty only on a resume), a copy: the runner may keep and extend it.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's share of a step: compute tokens [num_computed_tokens, +num_new_tokens)."""

    request_id: str
    num_computed_tokens: int  # before this step, after cache hits
    # Known tokens plus draft tokens (spec_token_ids): what the step computes and the budget counts.
    num_new_tokens: int
    # The ids of the known tokens among them: this step's input for the request (mostly one, a decode).
    new_token_ids: list[int]
    new_block_ids: list[int]
    # The whole block table, a copy: the runner may keep or extend it.
    block_ids: list[int]
    num_tokens: int  # tokens known when scheduled (prompt + outputs)
    # The first prompt position whose logprobs are still unknown (row p scores prompt token p + 1);
    # None when the request wants no (more) prompt logprobs. A preempted request computes its prompt
    # again, and this keeps the runner from scoring positions twice.
    prompt_logprobs_from: int | None = None
    # Set when the runner must (re)build its state for the request; None on every later step.
    new_request: NewRequestData | None = None
    # Speculative decoding: draft tokens that follow new_token_ids in this step's input, their KV
    # slots allocated with it. The runner verifies them and returns the accepted ones plus one more;
    # the scheduler gives the rejected ones' slots back in update().
    spec_token_ids: list[int] = msgspec.field(default_factory=list)

    @property
    def is_new(self) -> bool:
        """First scheduled, or resumed after preemption: the runner must (re)build its state."""
        return self.new_request is not None

    @property
    def samples(self) -> bool:
        """This step reaches the end of the known tokens, so a token is sampled for it."""
        return self.num_computed_tokens + self.num_new_tokens >= self.num_tokens

    def __repr__(self) -> str:
        # The default repr would print whole prompts.
        return (
            f"ScheduledRequest({self.request_id!r}, computed={self.num_computed_tokens}, "
            f"new={self.num_new_tokens}, spec={len(self.spec_token_ids)}, new_blocks={self.new_block_ids}, "
            f"is_new={self.is_new})"
        )


class KVTransfer(msgspec.Struct, array_like=True, gc=False):
    """One block copy between the first tier (the KV cache's block `block_id`) and a slot of the
    second tier, for the block stored under `block_hash` (a disk tier writes it into the file)."""

    block_id: int
    slot: int
    block_hash: int


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    """One step. The scheduler fills it in schedule() and reads it back in update()."""

    scheduled: list[ScheduledRequest] = msgspec.field(default_factory=list)  # batch order: running, then new
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = msgspec.field(default_factory=list)
    # Finished or aborted since the previous schedule(): the runner drops their cached state.
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    # Second-tier copies (pagoda.kv.offload), in this order: saves of blocks this step may reuse
    # (preempted requests'), then loads (their blocks are read by the forward), both before the
    # forward; then saves beside it, done when the step is (their blocks are pinned until then).
    kv_saves_first: list[KVTransfer] = msgspec.field(default_factory=list)
    kv_loads: list[KVTransfer] = msgspec.field(default_factory=list)
    kv_saves: list[KVTransfer] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no request and no copy between the KV tiers."""
        return not self.scheduled and not self.kv_saves_first and not self.kv_loads and not self.kv_saves


class SchedulerStats(msgspec.Struct):
    """The scheduler's counters, for the engine core's stats."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding, counted since the start (vLLM's spec_decode_* counters): verified rows,
    # draft tokens scored, draft tokens accepted, and accepted drafts by position in the draft.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # The second KV tier (pagoda.kv.offload.OffloadStats), since the start.
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0
    kv_offload_saved_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
