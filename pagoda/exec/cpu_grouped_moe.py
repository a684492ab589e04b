"""The CPU's grouped MoE kernel (csrc/moe_experts.cpp): bf16 experts packed once for it, and the
`experts_kernel` that runs a layer's routed experts in one C++ call (fused_moe.fused_experts'
contract). Used where the CPU has AVX512-BF16 and the shapes tile (intermediate % 32, hidden % 64);
elsewhere the experts stay oneDNN-packed (cpu_moe.PackedExperts)."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from pagoda.exec.cpu_kernels import load_moe_experts
from pagoda.exec.cpu_linear import pack_tasks

_BLOCK = 16  # output columns per packed block (the kernel's kBlock)


@lru_cache(maxsize=1)
def grouped_kernel():
    """The kernel module where it builds and the CPU has AVX512-BF16, else None (PAGODA_NO_GROUPED_MOE=1: None)."""
    if os.environ.get("PAGODA_NO_GROUPED_MOE") == "1":
        return None
    kernel = load_moe_experts()
    return kernel if kernel is not None and kernel.has_avx512_bf16() else None


def grouped_applies(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    num_experts, hidden, inter = w2.shape
    return w13.dtype == torch.bfloat16 and inter % 32 == 0 and hidden % 64 == 0 and grouped_kernel() is not None


def pack_halves(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, N/64, 2, K/2, 2, 16, 2]: `pack_tasks` with each task's four blocks in two
    halves of two, each half one contiguous range (csrc/bf16_tile.h tile_rows_halves)."""
    e, n, k = w.shape
    tasks = pack_tasks(w).reshape(e, n // (4 * _BLOCK), k // 2, 2, 2, _BLOCK, 2)
    return tasks.permute(0, 1, 3, 2, 4, 5, 6).contiguous()


class GroupedExperts:
    """This rank's experts packed for the grouped kernel (`pack_halves`), w13's rows reordered first so
    that a task's two halves are gate blocks 2g, 2g + 1 and up blocks 2g, 2g + 1: its 32 columns of
    silu(gate) * up."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.num_experts, self.inter = w13.shape[0], w2.shape[2]
        e, _, h = w13.shape
        # [E, 2 (gate, up), I/32, 32, H] -> [E, I/32, 2, 32, H]: gate 32 rows, then the same 32 of up
        halves = w13.reshape(e, 2, self.inter // (2 * _BLOCK), 2 * _BLOCK, h).transpose(1, 2)
        self.w13 = pack_halves(halves.reshape(e, 2 * self.inter, h))
        self.w2 = pack_halves(w2)


def grouped_fused_experts(x: torch.Tensor, experts: GroupedExperts, weights: torch.Tensor, ids: torch.Tensor,
                          expert_start: int = 0, global_experts: int | None = None) -> torch.Tensor:
    """fused_moe.fused_experts' contract in one C++ call; pairs of other ranks' experts add nothing."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    return grouped_kernel().moe_experts_bf16(x.contiguous(), ids.contiguous(), weights.float().contiguous(),
                                             experts.w13, experts.w2, expert_start)
