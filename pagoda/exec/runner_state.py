"""The model runner's per-request state between steps: the rows of its persistent block-table array
(`BlockTables`) and its mirror of each live request's tokens and sampling parameters
(`CachedRequest`), which the runner builds when a step says a request is new and extends by the
tokens each step computes."""

from __future__ import annotations

import numpy as np

from pagoda.sampling_params import SamplingParams


class BlockTables:
    """A [max_rows, max_blocks] array of block ids with one row per live request."""

    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def assign(self, request_id: str) -> int:
        """The request's row (a free one for a request without one)."""
        row = self.row_of.get(request_id)
        if row is None:
            row = self.free_rows.pop()
            self.row_of[request_id] = row
        return row

    def drop(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)


class CachedRequest:
    """The runner's mirror of one live request: its tokens and sampling parameters (what sampling
    and prompt logprobs read) and its block-table row, with how much of that row is filled."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "num_tokens", "sampling_params", "eos_token_id",
                 "row", "num_blocks", "had_drafts")

    def __init__(self, prompt_token_ids: list[int], output_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None, row: int) -> None:
        self.prompt_token_ids = prompt_token_ids  # read only: shared with the scheduler's request
        self.output_token_ids = output_token_ids  # the step's copy, extended here
        self.num_tokens = len(prompt_token_ids) + len(output_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.row = row
        self.num_blocks = 0  # entries of the row written so far (a kept row is rewritten)
        # The last step carried drafts, so the scheduler may have given back (and since replaced)
        # the blocks past the verified tokens: those entries of the row are rewritten.
        self.had_drafts = False
