"""One generation request as the scheduler sees it: its tokens, its progress and its status.

The request keeps one token list (prompt + output) that grows in place, and the chained hashes of
its full blocks, extended incrementally as tokens arrive so a lookup never rehashes a whole context.
"""

from __future__ import annotations

import enum
import time
from typing import Any

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
        self.prompt_token_ids = list(prompt_token_ids)
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
        self.timeline: Any = None  # the engine core's record of this request (pagoda.engine.timeline)
        # SamplingParams.prompt_logprobs: the prompt tokens' logprobs come from the rows the model
        # computes for them, so until they are all known the request reads no cached prefix (a hit's
        # rows are never computed). See pagoda/exec/prompt_logprobs.py.
        self.has_prompt_logprobs = sampling_params.prompt_logprobs is not None
        # Prompt positions whose logprobs are known (row p scores prompt token p + 1); the rows wait
        # in pending_prompt_logprobs until the first output carries them. Counted, not recomputed,
        # when a preempted request computes its prompt again.
        self.num_prompt_logprobs = 0
        self.pending_prompt_logprobs: list[tuple[list[int], list[float], int]] = []

        # (eos or None, stop token ids, min_tokens, max output tokens): what update() checks per
        # token, precomputed; the scheduler folds max_model_len into the last field at admission.
        sp = sampling_params
        self._stop_spec: tuple[int | None, frozenset[int], int, float] = (
            None if sp.ignore_eos else eos_token_id,
            frozenset(sp.stop_token_ids or ()),
            sp.min_tokens,
            float("inf") if sp.max_tokens is None else sp.max_tokens,
        )

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

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some prompt position still lacks its logprobs."""
        return self.has_prompt_logprobs and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, start: int, rows: list[tuple[list[int], list[float], int]]) -> None:
        """Keep the rows of prompt positions [start, start + len(rows)) not seen before."""
        skip = self.num_prompt_logprobs - start
        if skip < 0:
            raise ValueError(f"prompt logprobs of {self.request_id!r} from position {start}, "
                             f"{self.num_prompt_logprobs} known: a gap")
        fresh = rows[skip:]
        self.pending_prompt_logprobs.extend(fresh)
        self.num_prompt_logprobs += len(fresh)

    def take_prompt_logprobs(self) -> list[tuple[list[int], list[float], int]]:
        rows, self.pending_prompt_logprobs = self.pending_prompt_logprobs, []
        return rows

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
