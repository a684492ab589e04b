"""The CUDA paged attention backend: Triton kernels for the KV write, paged decode and ragged prefill.

Owns three kernels and the `TritonPagedAttention` backend that launches them:

- `_write_kv_kernel`: one program per token row stores its K and V at `slot_mapping[t]`; rows with
  slot -1 (CUDA-graph padding) store nothing. An fp8 cache (`--kv-cache-dtype fp8`, e4m3) holds
  each value divided by its layer's scale (`PagedKVCache.kv_scales`); the attention kernels widen
  what they load to the queries' dtype and multiply the scales back in.
- `_decode_kernel` + `_decode_reduce_kernel`: one query per sequence over its block table. The
  context is split into `num_splits` parts (flash-decoding / split-K) so that a few long sequences
  still fill the GPU; each part writes a partial output and its log-sum-exp, and the reduce kernel
  merges them. With one split the decode kernel writes the output directly.
- `_prefill_kernel`: ragged query chunks (new prompts and chunked-prefill continuations) attend
  causally over their whole context, read from the paged cache after this step's K/V were written.

Nothing here reads a device value on the host: grids come from shapes and from host ints the
runner computed while building the batch (`max_query_len`, `max_seq_len`), so the launches can be
captured in a CUDA graph. The same kernels run on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.paged_attention import PagedKVCache

# Context tokens one decode program loads per iteration (any multiple of 16 works: the block
# table is read per token, so a tile may span several KV blocks).
_DECODE_BLOCK_N = 32
_PREFILL_BLOCK_M = 32
_PREFILL_BLOCK_N = 32
# Splits are worth their reduce only when a part still covers this many tokens.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16
# Aim for about two programs per SM of an H100/H200 (132 SMs).
_TARGET_PROGRAMS = 264


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    num_kv_heads, head_dim, inv_k_scale, inv_v_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A padding row (slot -1) must not touch the cache: mask every store instead of branching.
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim) & (slot >= 0)
    safe = tl.maximum(slot, 0)
    dst = (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:  # e4m3 has no infinity: a value past its range would become NaN, so clamp
        k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -448.0), 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale, v_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    head_dim,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    # One program: one sequence, one KV head (all GROUP query heads sharing it), one context part.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Parts are a whole number of tiles; the last ones may be empty for short sequences.
    # (ceil division written out: tl.cdiv is not available under the interpreter)
    per_split = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < head_dim
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        row = page * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # K and V are widened to the queries' dtype (a no-op unless the cache is fp8).
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(mask_n[None, :], s * scale, float("-inf"))
        # Every tile holds at least one valid key, so m_new is finite and alpha never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc * v_scale / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = mask_g[:, None] & mask_d[None, :]
    if SPLIT:
        # Partials are [B, Hq, num_splits, D] and [B, Hq, num_splits], contiguous fp32.
        num_heads = tl.num_programs(1) * GROUP
        base = (b * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + base[:, None] * BLOCK_D + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=mask_g)
    else:
        dst = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    num_splits, stride_ot, stride_oh, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head): weight each part by exp(lse - max lse).
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < head_dim
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)  # part 0 is never empty (seq_len >= 1), so m is finite
    w = tl.where(mask_s, tl.exp(lse - m), 0.0)
    # Columns past head_dim were never written (the partials are BLOCK_D wide): never read them, or
    # whatever the buffer held would be weighted in (an inf times an empty part's zero weight: NaN).
    parts = tl.load(
        part_out_ptr + (row * num_splits + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    scale, v_scale, first_req,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
):
    # One program: BLOCK_M query rows of one request, one query head.
    req = first_req + tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # tokens cached before this chunk

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = ctx + offs_m  # absolute position of each query row
    kvh = h // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req * stride_bt
    # Causal: keys beyond this tile's last query position are never seen. The grid is sized for
    # the step's longest chunk; a tile past this request's chunk loops zero times, stores nothing.
    kv_end = tl.where(m0 < q_len, tl.minimum(seq_len, ctx + m0 + BLOCK_M), 0)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        page = tl.load(table + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        row = page * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # K and V are widened to the queries' dtype (a no-op unless the cache is fp8).
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale, float("-inf"))
        # A padded query row (beyond q_len) may see no key in a tile: keep its max finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc * v_scale / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    dst = out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store K/V rows [T, Hkv, D] at `slots` [T] of caches [num_blocks, block_size, Hkv, D]; slot -1 is
    skipped. An fp8 cache stores each value divided by its scale, clamped to e4m3's range."""
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, 1.0 / k_scale, 1.0 / v_scale,
        BLOCK_SIZE=block_size, BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim), FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many parts to cut each context into: enough programs to fill the GPU, none too short."""
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    by_occupancy = max(1, -(-_TARGET_PROGRAMS // (num_seqs * num_kv_heads)))
    return min(by_length, by_occupancy, _MAX_SPLITS)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, Hq, D] attends over each row's first seq_lens[b] cached tokens (stored K and V times
    k_scale and v_scale: an fp8 cache's); returns [B, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    block_d = _pow2(head_dim, 16)  # tl.dot needs every dimension >= 16
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused placeholders
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse,
        scale * k_scale, v_scale, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        GROUP=group, BLOCK_G=_pow2(group, 16), BLOCK_D=block_d, BLOCK_N=_DECODE_BLOCK_N,
        BLOCK_SIZE=block_size, SPLIT=split, IEEE=q.dtype == torch.float32,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out,
            num_splits, out.stride(0), out.stride(1), head_dim,
            BLOCK_S=_pow2(num_splits), BLOCK_D=block_d,
        )
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_req: int,
    num_reqs: int,
    max_query_len: int,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Requests first_req..first_req+num_reqs-1: rows query_start_loc[i]..[i+1] of q attend causally
    over their seq_lens[i] cached tokens (this chunk's own K/V already written); fills `out`."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, _PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * k_scale, v_scale, first_req,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        GROUP=num_heads // num_kv_heads, BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_PREFILL_BLOCK_N,
        BLOCK_D=_pow2(head_dim, 16), BLOCK_SIZE=block_size, IEEE=q.dtype == torch.float32,
    )
    return out


class TritonPagedAttention:
    """The CUDA paged attention backend (TorchPagedAttention's interface and cache layout)."""

    def __init__(self, kv_cache: PagedKVCache) -> None:
        self.kv_cache = kv_cache

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedAttentionMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        k_scale, v_scale = self.kv_cache.kv_scales[layer_idx]
        # Every row has a slot (padding rows -1), so the write covers exactly the rows given.
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            num_splits = decode_num_splits(nd, k_cache.shape[2], meta.max_seq_len)
            paged_decode(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, num_splits, out=out[:nd],
                k_scale=k_scale, v_scale=v_scale,
            )
        num_prefills = meta.block_tables.shape[0] - nd
        if num_prefills > 0:
            max_q = meta.max_query_len or _max_query_len(meta)
            paged_prefill(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                nd, num_prefills, max_q, out, k_scale, v_scale,
            )
        return out


def _max_query_len(meta: PagedAttentionMetadata) -> int:
    """Fallback for callers that did not fill meta.max_query_len (host list, no device sync)."""
    qsl = meta.query_start_loc_cpu
    return max(qsl[i + 1] - qsl[i] for i in range(meta.num_decodes, len(qsl) - 1))
