"""The kernels an MoE's experts run on (`prepare_experts`): on CUDA the Triton grouped GEMM
(triton_moe.py); on the CPU, for bf16 where the CPU has AVX512-BF16 and the shapes tile, the grouped
kernel that runs a layer's experts in one C++ call (cpu_grouped_moe.py); otherwise oneDNN-packed
experts: each expert's gate-up and down weights packed once into oneDNN's blocked layout, as the
dense layers' linears are (cpu_linear.py), for the fused MoE layer (pagoda/model/fused_moe.py), which
calls them expert by expert over each expert's run of rows.

Unpacked, a bf16 matmul reorders its weight on every call; packed, it reads the blocked copy
directly. The stacked weights are dropped once packed (their pages given back when mapped from
the load cache), so an MoE holds one copy of its experts, as a dense model holds one of its MLP.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

# (cpu_linear's helpers, shared within the execution layer)
from pagoda.exec.cpu_grouped_moe import GroupedExperts, grouped_applies, grouped_fused_experts
from pagoda.exec.cpu_linear import _onednn_usable, _pack, _packed_linear
from pagoda.model.mmap_weights import release_pages
from pagoda.model.moe import FusedMoE

logger = logging.getLogger(__name__)


class PackedExperts:
    """The same members as fused_moe.StackedExperts, over packed copies of each expert's weights."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.num_experts, self.inter = w13.shape[0], w2.shape[2]
        self.w13 = [_pack(w13[e]) for e in range(self.num_experts)]
        self.w2 = [_pack(w2[e]) for e in range(self.num_experts)]

    def gate_up(self, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_packed_linear(rows, self.w13[expert], None))

    def down(self, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_packed_linear(rows, self.w2[expert], None))


def pack_experts(model: nn.Module, device: torch.device) -> int:
    """Give every FusedMoE of `model` packed experts where oneDNN serves their dtype on `device`;
    returns how many layers were packed."""
    # (experts already set are kept quantized: model/quant_loader.py, with their kernels from quant_linear.py)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.packed_experts is None
              and _onednn_usable(m.w13_weight, device)]
    for layer in layers:
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        try:
            if grouped_applies(w13, w2):
                layer.packed_experts, layer.experts_kernel = GroupedExperts(w13, w2), grouped_fused_experts
            else:
                layer.packed_experts = PackedExperts(w13, w2)
        except (RuntimeError, AttributeError) as exc:  # a torch build without these oneDNN ops
            logger.warning("packed experts unavailable (%s); using torch.mm", exc)
            return 0
        release_pages([layer.w13_weight, layer.w2_weight])
        # The packed copies replace the stacked weights; an empty tensor keeps the parameter's name.
        layer.w13_weight.data = layer.w13_weight.data.new_empty(0)
        layer.w2_weight.data = layer.w2_weight.data.new_empty(0)
    return len(layers)


def prepare_experts(model: nn.Module, device: torch.device, triton_ok: bool) -> None:
    """The experts' kernels for `device`: packed on the CPU, the Triton grouped GEMM on CUDA (where
    `triton_ok`: the runner's attention found triton importable), torch.mm otherwise."""
    if device.type == "cpu":
        pack_experts(model, device)
    elif device.type == "cuda" and triton_ok:
        from pagoda.exec.triton_moe import use_triton_experts

        use_triton_experts(model)
