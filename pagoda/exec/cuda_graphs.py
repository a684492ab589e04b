"""CUDA graphs for decode steps: capture sizes, padded static inputs, capture and replay.

A decode step of n sequences is padded to the next capture size. Padding rows get slot -1 (they
write no K/V), seq_len 1 over the null block 0 (they read one harmless cached row) and token 0 at
position 0; their hidden states are returned to nobody, so their logits are never computed.

Graphs are used only on CUDA with the Triton backend (whose launches read no device value on the
host) and not under `enforce_eager`; every other step, and every mixed or prefill step, runs eagerly.
The padding itself (`DecodeBuffers`) is device-agnostic, so its effect on outputs and on the KV
cache is tested on CPU by running a padded batch eagerly.
"""

from __future__ import annotations

import bisect
import logging
import torch

from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.model.attention import AttentionBackend, AttentionContext

logger = logging.getLogger(__name__)

NULL_BLOCK = 0  # never handed out by the block pool (pagoda.kv.block_pool)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at (and always including)
    max_num_seqs, so that every decode batch the scheduler can form has a graph."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    sizes = [s for s in sizes if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest capture size >= n, or None when n exceeds them all (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """Static input tensors a captured graph reads; `fill` copies a step's batch in and pads it."""

    def __init__(self, max_size: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_size, max_blocks), NULL_BLOCK, dtype=torch.long, device=device)
        # One query per row: the start offsets never change.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.long, device=device)

    def metadata(self, size: int, max_seq_len: int, num_actual: int, seq_lens_cpu: list[int]) -> PagedAttentionMetadata:
        """Metadata over the first `size` rows of the buffers (views, so a graph sees later fills)."""
        return PagedAttentionMetadata(
            num_decodes=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=seq_lens_cpu,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            max_query_len=1,
            num_actual_tokens=num_actual,
        )

    def dummy(self, size: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """Inputs for capture: every row a padding row, so capturing writes nothing to the cache."""
        self._pad(0, size)
        meta = self.metadata(size, max_seq_len, 0, [1] * size)
        return self.input_ids[:size], self.positions[:size], meta

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """Copy a pure-decode batch of n <= size rows in, pad rows n..size-1; returns padded inputs.

        Only device-to-device copies: nothing here waits for the device."""
        n = meta.num_decodes
        nb = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past nb keep stale ids: a row never reads past its seq_len.
        self.block_tables[:n, :nb].copy_(meta.block_tables, non_blocking=True)
        self._pad(n, size)
        padded = self.metadata(size, meta.max_seq_len, n, meta.seq_lens_cpu + [1] * (size - n))
        return self.input_ids[:size], self.positions[:size], padded

    def _pad(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.seq_lens[start:end] = 1
        self.block_tables[start:end, 0] = NULL_BLOCK


class CUDAGraphDecoder:
    """One captured model forward per capture size, sharing one memory pool; replays decode steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        # Captured launches keep the split-K count they were captured with: size it for the
        # longest context a step may hold, not for the dummy batch.
        self.max_model_len = max_model_len
        max_blocks = (max_model_len + block_size - 1) // block_size
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # Largest first: smaller graphs then fit into the pool the largest one allocated.
        for size in reversed(self.sizes):
            ids, pos, meta = self.buffers.dummy(size, self.max_model_len)
            ctx = AttentionContext(self.backend, meta)
            # Warm up outside capture: Triton compiles, cuBLAS picks its kernels and workspace.
            self.model(ids, pos, ctx)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(ids, pos, ctx)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, num_decodes: int, num_reqs: int) -> bool:
        return num_decodes == num_reqs and 0 < num_decodes <= self.sizes[-1] and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """Hidden states [n, H] of a pure-decode batch; rows past n of the graph output are padding."""
        n = meta.num_decodes
        size = padded_batch_size(n, self.sizes)
        assert size is not None, f"decode batch of {n} exceeds the largest CUDA graph ({self.sizes[-1]})"
        # The graph keeps the metadata it was captured with (max_seq_len = max_model_len); only the
        # static tensors change, so the padded metadata `fill` returns is not needed here.
        self.buffers.fill(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]
