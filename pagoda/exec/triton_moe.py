"""The fused routed experts on the GPU: one Triton grouped GEMM per projection over the tokens sorted
by expert (pagoda/model/fused_moe.py describes the computation; this is its `experts_kernel` there).

The (token, expert) pairs are sorted by expert, so each expert's rows are one contiguous run. The
runs are cut into tiles of `_BLOCK_M` rows, no tile spanning two experts; a tile's program multiplies
its rows by its expert's weight, one `_BLOCK_N` slice of the output per program. Which expert and
which rows a tile has is computed on the device from the expert counts (a cumulative sum and a
search), over a grid sized from shapes alone: ceil(rows / _BLOCK_M) + E tiles bound any split, and
the tiles past the real ones return at once. So nothing reads a device value on the host, and an
expert without a token has no tile and costs nothing. SiLU-and-multiply, the routing weights and the
scatter back to the tokens are PyTorch ops between and after the two GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.model.fused_moe import StackedExperts

_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr,
                         n_out, k_dim, stride_am, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows] = a[rows] @ w[e].T for the tile's rows (all of expert e's), one N-slice."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # past the real tiles
        return
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, w)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _tiles(counts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) per tile, -1 as the expert of tiles past the real ones; counts [E]."""
    num_experts = counts.shape[0]
    max_tiles = -(-num_rows // _BLOCK_M) + num_experts
    per_expert = (counts + _BLOCK_M - 1) // _BLOCK_M
    tile_end = torch.cumsum(per_expert, 0)
    row_end = torch.cumsum(counts, 0)
    tile = torch.arange(max_tiles, device=counts.device)
    expert = torch.searchsorted(tile_end, tile, right=True)
    real = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first_tile = tile_end[expert] - per_expert[expert]
    first_row = row_end[expert] - counts[expert] + (tile - first_tile) * _BLOCK_M
    return torch.where(real, expert, -1).to(torch.int32), first_row.to(torch.int32), row_end[expert].to(torch.int32)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, tiles: tuple) -> torch.Tensor:
    """a [N, K] sorted by expert, w [E, Nout, K] -> [N, Nout]."""
    a, w = a.contiguous(), w.contiguous()
    out = a.new_empty(a.shape[0], w.shape[1])
    grid = (tiles[0].shape[0], triton.cdiv(w.shape[1], _BLOCK_N))
    _grouped_gemm_kernel[grid](a, w, out, *tiles, w.shape[1], w.shape[2], a.stride(0), w.stride(0), w.stride(1),
                               out.stride(0), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out


def triton_fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, ids: torch.Tensor,
                         expert_start: int = 0, global_experts: int | None = None) -> torch.Tensor:
    """fused_moe.fused_experts' contract, without a host read: pairs of other ranks' experts (expert
    parallel) sort last and no tile covers them."""
    from pagoda.model.layers import silu_and_mul

    num_tokens, top_k = ids.shape
    num_experts = experts.num_experts
    if num_tokens == 0:
        return torch.zeros_like(x)
    local = ids.reshape(-1) - expert_start
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_experts + 1)[:num_experts]
    tiles = _tiles(counts, order.shape[0])
    tokens = order // top_k
    gate_up = _grouped_gemm(x.index_select(0, tokens), experts.w13, tiles)
    down = _grouped_gemm(silu_and_mul(gate_up), experts.w2, tiles)
    # Rows past the local pairs were never written: weigh them by zero (masked, not multiplied, as
    # they may hold anything).
    kept = (local.index_select(0, order) < num_experts).unsqueeze(1)
    scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    down = torch.where(kept, down.float() * scale, 0.0).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, down)


def use_triton_experts(model: torch.nn.Module) -> int:
    """Route every FusedMoE of `model` through the Triton grouped GEMM (not those whose experts are
    kept quantized: their kernels are triton_quant's); returns how many."""
    from pagoda.model.moe import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.packed_experts is None]
    for layer in layers:
        layer.experts_kernel = triton_fused_experts
    return len(layers)
