"""The attention metadata of one step: the flattened ragged batch as the paged backends see it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttentionMetadata:
    """Rows are ordered decodes first (one query each), then prefill chunks.

    slot_mapping[t] is where token t's K/V goes in the flattened cache (-1: a padding row, nothing written).
    query_start_loc[i]..query_start_loc[i+1] are request i's rows; seq_lens[i] counts its context
    including this step's tokens; block_tables[i] lists its blocks (padded with 0).
    """

    num_decodes: int
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int64, on the device
    seq_lens: torch.Tensor  # [B] int64, on the device
    block_tables: torch.Tensor  # [B, max_blocks] int64, on the device
    # Host copies so the CPU backend can slice without syncing with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    block_size: int
    # Longest query chunk of the step (a host int, so GPU kernels size their grid without a sync);
    # 0: not given, derived from query_start_loc_cpu.
    max_query_len: int = 0
    # Rows that write K/V; a CUDA-graph padded batch appends rows with slot -1 after them.
    # None: every row of slot_mapping is real.
    num_actual_tokens: int | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
