"""One generation request as the scheduler sees it: its tokens, its progress and its status.

The request keeps one token list (prompt + output) that grows in place, and the chained hashes of
its full blocks, extended incrementally as tokens arrive so a lookup never rehashes a whole context.
Its `StopConditions` say when it ends. What the engine keeps per request (timelines, prompt-logprob
rows) is the engine core's, by request id; the request holds only what scheduling reads.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pagoda.kv.hashing import BlockHash, BlockHasher, hash_block_tokens
from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason string, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISH_REASONS = dict(_FINISH_REASONS)


_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH


@dataclass(frozen=True, slots=True)
class StopConditions:
    """When a request ends, checked per output token in vLLM's order: EOS, then the stop token ids
    (both only once min_tokens outputs exist), then the output cap. Precomputed from the sampling
    parameters so that the per-token check is a few comparisons."""

    eos_token_id: int | None  # None under ignore_eos (or when the model has none)
    stop_token_ids: frozenset[int]
    min_tokens: int
    # Output tokens at most: max_tokens, lowered by the scheduler to what max_model_len leaves
    # (`capped`); math.inf when neither bounds it yet.
    max_output_tokens: float

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_id: int | None) -> StopConditions:
        return cls(
            None if params.ignore_eos else eos_token_id,
            frozenset(params.stop_token_ids or ()),
            params.min_tokens,
            math.inf if params.max_tokens is None else params.max_tokens,
        )

    def capped(self, max_output_tokens: int) -> StopConditions:
        """These conditions with at most `max_output_tokens` outputs (e.g. what max_model_len leaves)."""
        if max_output_tokens >= self.max_output_tokens:
            return self
        return replace(self, max_output_tokens=max_output_tokens)

    def check(self, token_ids: Sequence[int], num_output_tokens: int) -> tuple[int, RequestStatus] | None:
        """Check `token_ids` as appended one at a time after `num_output_tokens` outputs.

        Returns None when none of them ends the request (the common case, so it allocates nothing),
        else (how many to keep: up to and including the one that ends it, FINISHED_STOPPED or
        FINISHED_LENGTH).
        """
        n_out = num_output_tokens
        for token in token_ids:
            n_out += 1
            if n_out >= self.min_tokens and (token == self.eos_token_id or token in self.stop_token_ids):
                return n_out - num_output_tokens, _STOPPED
            if n_out >= self.max_output_tokens:
                return n_out - num_output_tokens, _LENGTH
        return None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        extra_keys: tuple = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # never changed: steps share it with the runner
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # lower value is scheduled first (vLLM's convention)
        self.extra_keys = tuple(extra_keys)

        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        # Speculative decoding: draft tokens proposed after the last step, scheduled (and consumed)
        # by the next one; never part of all_token_ids until verified.
        self.spec_token_ids: list[int] = []
        # SamplingParams.prompt_logprobs: the prompt tokens' logprobs come from the rows the model
        # computes for them, so until they are all known the request reads no cached prefix (a hit's
        # rows are never computed). The rows are the engine core's; the request keeps only where they
        # stand, which the core reports through advance_prompt_logprobs(): the first prompt position
        # still lacking logprobs (row p scores prompt token p + 1), or None when no (more) are wanted.
        # Every step carries it, so a preempted request that computes its prompt again is not scored
        # twice.
        wants = sampling_params.prompt_logprobs is not None and self.num_prompt_tokens > 1
        self.prompt_logprobs_from: int | None = 0 if wants else None
        # What update() checks per token; the scheduler caps it by max_model_len at admission.
        self.stop_conditions = StopConditions.from_params(sampling_params, eos_token_id)

        self.block_hashes: list[BlockHash] = []
        self._block_size = 0  # 0: hashing not bound yet (the KV manager binds it)
        self._hasher: BlockHasher = hash_block_tokens

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return self.status.is_finished

    # -- tokens and hashes -----------------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_size and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self._block_size:
            self._hash_new_full_blocks()

    def append_until_stop(self, token_ids: list[int]) -> RequestStatus | None:
        """Append sampled tokens up to the first that meets a stop condition (later ones are cut).
        Returns the finish status it sets (the caller finishes the request), or None. A stop token
        other than EOS becomes stop_reason."""
        output = self.output_token_ids
        stop = self.stop_conditions.check(token_ids, len(output))
        status = None
        if stop is not None:
            keep, status = stop
            token_ids = token_ids[:keep]
        # append_output_token_ids, inlined: calling it costs update() ~10 us a step at 256 requests
        # (benchmarks/bench_scheduler.py).
        all_ids = self.all_token_ids
        output.extend(token_ids)
        all_ids.extend(token_ids)
        bs = self._block_size
        if bs and len(all_ids) >= (len(self.block_hashes) + 1) * bs:
            self._hash_new_full_blocks()
        if status is _STOPPED and token_ids[-1] != self.stop_conditions.eos_token_id:
            self.stop_reason = token_ids[-1]
        return status

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some prompt position still lacks its logprobs."""
        return self.prompt_logprobs_from is not None

    def advance_prompt_logprobs(self, num_known: int) -> None:
        """The logprobs of prompt positions [0, num_known) are known (the engine core keeps them)."""
        if self.prompt_logprobs_from is not None:
            self.prompt_logprobs_from = num_known if num_known < self.num_prompt_tokens - 1 else None

    def bind_block_hashing(self, block_size: int, hasher: BlockHasher = hash_block_tokens) -> None:
        """Start hashing full blocks of block_size tokens (idempotent for the same size)."""
        if self._block_size == block_size and self._hasher is hasher:
            return
        self._block_size = block_size
        self._hasher = hasher
        self.block_hashes = []
        self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        bs = self._block_size
        tokens = self.all_token_ids
        hashes = self.block_hashes
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * bs, len(tokens) - bs + 1, bs):
            parent = self._hasher(parent, tokens[start : start + bs], self.extra_keys)
            hashes.append(parent)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
