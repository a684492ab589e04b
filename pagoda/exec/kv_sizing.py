"""KV cache sizing on CUDA: a profiling forward at the full token budget, then what memory is left.

The KV cache gets `total * gpu_memory_utilization - peak usage` bytes, where the peak usage is the
most the device held while one dummy step of `max_num_batched_tokens` tokens ran (weights,
activations, logits of up to `max_num_seqs` rows and their softmax) plus memory outside PyTorch's
allocator (CUDA context, cuBLAS workspaces, other processes). The profile's own small KV cache is
taken back out of the peak. Memory readings come through `MemoryReader`, so the arithmetic is
tested with injected numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.paged_attention import PagedKVCache
from pagoda.model.attention import AttentionContext


class MemoryReader(Protocol):
    def reset_peak(self) -> None: ...
    def synchronize(self) -> None: ...
    def peak_allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device."""
        ...


@dataclass
class CudaMemory:
    device: torch.device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)


def kv_cache_bytes(total: int, utilization: float, peak_usage: int) -> int:
    """What the KV cache may take: the utilization's share of the device, less the profiled peak."""
    return int(total * utilization) - peak_usage


def peak_usage(total: int, free: int, reserved: int, peak_allocated: int, profile_kv_bytes: int) -> int:
    """Bytes in use at the profile's peak: PyTorch's peak allocation (less the profile's KV cache)
    plus everything on the device that PyTorch's allocator does not hold."""
    outside_torch = (total - free) - reserved
    return peak_allocated - profile_kv_bytes + outside_torch


def dummy_prefill(
    num_tokens: int, max_model_len: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, int]:
    """A prefill step of `num_tokens` tokens cut into sequences of at most max_model_len, each on
    its own consecutive blocks from block 1; returns (input_ids, positions, metadata, blocks used + 1)."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    width = max((n + block_size - 1) // block_size for n in lens)
    tables, positions, slots, qsl = [], [], [], [0]
    next_block = 1  # block 0 stays the null block, as in the real pool
    for n in lens:
        nb = (n + block_size - 1) // block_size
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table + [0] * (width - nb))
        positions.extend(range(n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(n))
        qsl.append(qsl[-1] + n)
    meta = PagedAttentionMetadata(
        num_decodes=0,
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, device=device),
        seq_lens=torch.tensor(lens, device=device),
        block_tables=torch.tensor(tables, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        max_seq_len=max(lens),
        block_size=block_size,
        max_query_len=max(lens),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return input_ids, torch.tensor(positions, device=device), meta, next_block


@torch.inference_mode()
def profile_kv_cache_bytes(
    model: torch.nn.Module,
    make_backend: Callable[[PagedKVCache], object],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    device: torch.device,
    memory: MemoryReader | None = None,
) -> int:
    """Run the profiling forward and return the bytes the KV cache may take (may be <= 0)."""
    memory = memory or CudaMemory(device)
    input_ids, positions, meta, num_blocks = dummy_prefill(max_num_batched_tokens, max_model_len, block_size, device)
    memory.synchronize()
    memory.reset_peak()
    cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    profile_kv = cache.tensor.numel() * cache.tensor.element_size()
    hidden = model(input_ids, positions, AttentionContext(make_backend(cache), meta))
    # The sampler sees at most max_num_seqs rows of logits, upcast to fp32 for its softmax.
    logits = model.compute_logits(hidden[: min(max_num_seqs, hidden.shape[0])])
    torch.softmax(logits.float(), dim=-1)
    memory.synchronize()
    peak = memory.peak_allocated()
    del hidden, logits, cache
    free, total = memory.mem_get_info()
    usage = peak_usage(total, free, memory.reserved(), peak, profile_kv)
    return kv_cache_bytes(total, gpu_memory_utilization, usage)


def profile_kv_budget(
    model: torch.nn.Module,
    args,  # pagoda.config.EngineArgs
    max_model_len: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    memory: MemoryReader | None = None,
) -> int:
    """`profile_kv_cache_bytes` with the engine's settings: the step size is the scheduler's token
    budget (a whole prompt per step when chunked prefill is off)."""
    from pagoda.exec.attention_backend import make_attention_backend

    tokens = args.max_num_batched_tokens
    if not args.enable_chunked_prefill:
        tokens = max(tokens, max_model_len)
    return profile_kv_cache_bytes(
        model,
        make_attention_backend,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=args.block_size,
        max_num_batched_tokens=tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device=device,
        memory=memory,
    )
