"""Paged attention in PyTorch: K/V written by slot mapping, ragged queries attending over block tables.

The cache may be stored in a narrower dtype than the model computes in (`kv_cache_dtype`): rows are
converted on write and read back in the queries' dtype. An int8 cache keeps each token's K or V row
of each KV head as int8 values with an fp16 scale per 32 of them (csrc/kv_int8.h); only the C++
kernels write it. On CPU the KV write and the decodes (one query per request) go through the C++ kernels of `cpu_kernels` (decode reads the blocks in place);
elsewhere decodes run as one batched scaled_dot_product_attention over K/V gathered by block table.
Each prefill chunk is one attention call (few per step, bounded by the token budget): on CPU the
C++ causal kernel, its sums in float32 for every model dtype (a bf16 model's scores and p.v on
vdpbf16ps where the CPU has AVX512-BF16, the probabilities rounded to bf16 for p.v as transformers'
eager attention rounds them; other 16-bit inputs widened; the output rounded once), elsewhere SDPA;
a chunk with no earlier context attends over its own fresh K/V without touching the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.cpu_memory import lazy_zeros, release_ranges


class PagedKVCache:
    """Per-layer K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]; in int8,
    [num_blocks, num_kv_heads, block_size, int8_row_bytes(head_dim)] (each head's rows together)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, 2, num_blocks, *self.block_layout(block_size, num_kv_heads, head_dim, dtype))
        self.tensor = _zeros(shape, dtype, torch.device(device))
        self.num_blocks = num_blocks
        self.block_size = block_size
        # An fp8 cache's (K, V) scale per layer: it holds value / scale. 1.0, vLLM's default when a
        # checkpoint brings no scales; e4m3 covers +-448, past any K or V of the models served here.
        self.kv_scales = [(1.0, 1.0)] * num_layers
        # Only a lazily mapped CPU cache gives pages back; elsewhere the memory is held whole.
        self.can_release = self.tensor.device.type == "cpu"

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @tensor.setter
    def tensor(self, value: torch.Tensor) -> None:
        self._tensor = value
        # The per-layer views, built once per tensor: indexing it costs a few microseconds, twice
        # per layer and step.
        self._layers = [(value[i, 0], value[i, 1]) for i in range(value.shape[0])]

    @staticmethod
    def block_layout(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, ...]:
        """One block's shape in one (layer, K/V) plane of the cache."""
        if dtype == torch.int8:
            return (num_kv_heads, block_size, int8_row_bytes(head_dim))
        return (block_size, num_kv_heads, head_dim)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        layout = PagedKVCache.block_layout(block_size, num_kv_heads, head_dim, dtype)
        return num_layers * 2 * math.prod(layout) * torch.empty((), dtype=dtype).element_size()

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[idx]

    def release_blocks(self, block_ids: list[int]) -> int:
        """Give the memory of free blocks back to the OS (CPU only; their K/V read as zeros after).

        A block is one slice of every (layer, K/V) plane, so each run of consecutive ids is one
        range per plane; only whole pages inside a run are released. Returns the bytes released."""
        if not block_ids or not self.can_release:
            return 0
        t = self.tensor
        block_bytes = math.prod(t.shape[3:]) * t.element_size()
        plane_bytes = self.num_blocks * block_bytes
        ranges = []
        for first, last in _runs(sorted(block_ids)):
            for plane in range(t.shape[0] * t.shape[1]):
                base = plane * plane_bytes
                ranges.append((base + first * block_bytes, base + (last + 1) * block_bytes))
        return release_ranges(t, ranges)


# An int8 row: head_dim values, then an fp16 scale per group of INT8_GROUP values (csrc/kv_int8.h).
INT8_GROUP = 32


def int8_row_bytes(head_dim: int) -> int:
    return head_dim + 2 * -(-head_dim // INT8_GROUP)


def dequantize_int8_blocks(blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 blocks [nb, H, block_size, W] -> float32 rows [nb * block_size, H, head_dim]."""
    nb, heads, block_size, width = blocks.shape
    scales = blocks[..., head_dim:].contiguous().view(torch.float16).float()  # [nb, H, BS, groups]
    scales = scales.repeat_interleave(INT8_GROUP, dim=-1)[..., :head_dim]
    values = blocks[..., :head_dim].float() * scales
    return values.transpose(1, 2).reshape(nb * block_size, heads, head_dim)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids -> maximal runs of consecutive ids as (first, last)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU from `lazy_zeros`: no start-up time, resident only where written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return lazy_zeros(nbytes).view(dtype).view(shape)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new K/V rows at their slots, in the cache's (float) dtype; the caller has dropped padding rows (slot -1)."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int, dtype: torch.dtype,
              block_size: int, head_dim: int) -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, seq_len, H, D] contiguous K or V, in `dtype` (the queries')."""
    b, nb = block_tables.shape
    # index_select on whole blocks copies rows; advanced indexing would gather element by element.
    if cache.dtype == torch.int8:
        rows = dequantize_int8_blocks(cache.index_select(0, block_tables.reshape(-1)), head_dim)
        return rows.view(b, nb * block_size, *rows.shape[1:])[:, :seq_len].to(dtype)
    gathered = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    return gathered.view(b, nb * cache.shape[1], *cache.shape[2:])[:, :seq_len].to(dtype)


class TorchPagedAttention:
    """The CPU (and fallback) paged attention backend."""

    def __init__(self, kv_cache: PagedKVCache) -> None:
        if kv_cache.tensor.dtype == torch.float8_e4m3fn:
            raise ValueError("kv_cache_dtype='fp8' needs the Triton kernels (a CUDA GPU with triton installed)")
        self.kv_cache = kv_cache
        self.decode_kernel = self.write_kernel = self.prefill_kernel = None
        if kv_cache.tensor.device.type == "cpu":
            from pagoda.exec.cpu_kernels import load_cpu_kernels, load_prefill_attention

            kernels = load_cpu_kernels()
            if kernels is not None:
                self.decode_kernel, self.write_kernel = kernels.paged_decode, kernels.write_kv
            prefill = load_prefill_attention()
            if prefill is not None:
                self.prefill_kernel = prefill.prefill_attention
        if kv_cache.tensor.dtype == torch.int8 and self.write_kernel is None:
            raise ValueError("kv_cache_dtype='int8' needs Pagoda's C++ CPU kernels, which could not be built here "
                             "(see the log); use 'auto' or a 16-bit cache")

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedAttentionMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        slots = meta.slot_mapping
        if meta.num_actual_tokens is not None:
            slots = slots[: meta.num_actual_tokens]  # a padded batch: its slot -1 rows are not written
        num_tokens = slots.shape[0]
        # Padding rows (beyond the real tokens) write nothing and their outputs are never read.
        (self.write_kernel or write_kv)(k_cache, v_cache, k[:num_tokens], v[:num_tokens], slots)
        nd = meta.num_decodes
        if nd == q.shape[0]:  # a pure decode step: the decode output is the whole output
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i, lens[i], scale)
        return out

    def _decode(self, q, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        nd = q.shape[0]
        if self.decode_kernel is not None:
            # q may be a row-strided view of the fused QKV output (rotated in place): the kernel reads it as is.
            return self.decode_kernel(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        lens = meta.seq_lens[:nd]
        max_len = max(meta.seq_lens_cpu[:nd])
        tables = meta.block_tables[:nd, : (max_len + meta.block_size - 1) // meta.block_size]
        keys = gather_kv(k_cache, tables, max_len, q.dtype, meta.block_size, q.shape[-1]).transpose(1, 2)  # [B, H, S, D]
        values = gather_kv(v_cache, tables, max_len, q.dtype, meta.block_size, q.shape[-1]).transpose(1, 2)
        mask = (torch.arange(max_len, device=q.device).unsqueeze(0) < lens.unsqueeze(1)).view(nd, 1, 1, max_len)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def prefill_kernel_takes(self, head_dim: int) -> bool:
        """Whether a prompt's attention goes to the C++ prefill kernel (else causal SDPA)."""
        return self.prefill_kernel is not None and head_dim % 16 == 0

    def _prefill(self, q, k_new, v_new, k_cache, v_cache, meta, i: int, seq_len: int, scale: float) -> torch.Tensor:
        n = q.shape[0]
        if seq_len == n:  # no earlier context: the chunk's own fresh K/V, nothing read from the cache
            keys, values = k_new, v_new
        else:
            nb = (seq_len + meta.block_size - 1) // meta.block_size
            table = meta.block_tables[i : i + 1, :nb]
            keys = gather_kv(k_cache, table, seq_len, q.dtype, meta.block_size, q.shape[-1])[0]  # [seq_len, Hkv, D]
            values = gather_kv(v_cache, table, seq_len, q.dtype, meta.block_size, q.shape[-1])[0]
        if self.prefill_kernel_takes(q.shape[-1]):
            # ~2x SDPA's speed on 2 AVX2 cores in fp32 (csrc/prefill_attention.cpp); bf16 goes in as
            # it is (vdpbf16ps scores on AVX512-BF16, widened to float32 elsewhere), fp16 widened
            # here. bf16 SDPA rounds the attention weights to bf16 and blocks by sequence length, so
            # a prompt position's output moved with the tokens after it, and prompt logprobs (echo)
            # left those of the same tokens generated by the decode kernel; here a position's output
            # depends only on the keys it sees.
            if q.dtype in (torch.float32, torch.bfloat16):
                return self.prefill_kernel(q, keys, values, scale)
            return self.prefill_kernel(q.float(), keys.float(), values.float(), scale).to(q.dtype)
        return causal_sdpa(q, keys, values, scale)


def causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at the last n of the S positions of keys/values [S, Hkv, D], causal; [n, Hq, D]."""
    n, seq_len = q.shape[0], keys.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kh, vh = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    if seq_len == n:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=seq_len - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
