"""Routed experts, fused: the router's top-k, and every routed expert's SwiGLU MLP over one batch.

`select_experts` turns router logits into each token's k experts and their weights (softmax over all
experts, top-k, optionally renormalised over the k: Mixtral always, Qwen-MoE where `norm_topk_prob`).

`fused_experts` computes sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen
experts e, the way vLLM's fused MoE does it: the (token, expert) pairs are sorted by expert, so each
expert's tokens are one contiguous run of rows; one matmul per active expert and projection over its
run (gate and up merged into one [2I, H] weight), one SiLU-and-multiply over all the rows at once,
one weighting by the routing weights and one `index_add_` scatter back to the tokens. The loop is over
the experts that received a token (at most E, at most T * k), never over tokens; an expert with no
token costs nothing, so a decode step reads only the active experts' weights.

The matmuls go through an experts object (`StackedExperts` here, oneDNN-packed copies from
pagoda/exec/cpu_moe.py); on CUDA the runner replaces this whole function by a Triton grouped GEMM
with the same contract (pagoda/exec/triton_moe.py).

With expert parallelism a rank holds experts [expert_start, expert_start + E_local): pairs routed
elsewhere are dropped here, and the sum over ranks (the caller's all-reduce) adds them back.
"""

from __future__ import annotations

import torch

from pagoda.model.layers import silu_and_mul


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64). Softmax in float32 and torch.topk, the calls
    transformers makes: tied scores pick the same experts as there (torch.topk's choice, per row,
    whatever the number of rows)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts:
    """The experts' two projections as stacked weights: w13 [E, 2I, H] (each expert's gate rows, then
    its up rows) and w2 [E, H, I]. Another implementation (oneDNN-packed weights on the CPU,
    pagoda/exec/cpu_moe.py) offers the same three members."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13, w2
        self.num_experts, self.inter = w13.shape[0], w2.shape[2]

    def gate_up(self, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(rows, self.w13[expert].t(), out=out)

    def down(self, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(rows, self.w2[expert].t(), out=out)


def fused_experts(x: torch.Tensor, experts: StackedExperts, weights: torch.Tensor, ids: torch.Tensor,
                  expert_start: int = 0, global_experts: int | None = None) -> torch.Tensor:
    """x [T, H]; weights, ids [T, k] (ids among `global_experts`, of which this rank holds
    `experts.num_experts` from `expert_start`; all of them by default).

    Returns [T, H] in x's dtype: the weighted sum over each token's experts that this rank holds."""
    num_tokens, top_k = ids.shape
    num_experts, inter = experts.num_experts, experts.inter
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    local = ids.reshape(-1) - expert_start
    if expert_start or (global_experts or num_experts) > num_experts:  # expert parallel: others' sort last
        local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_experts + 1).tolist()
    rows = len(order) - counts[num_experts]  # the pairs this rank computes
    if rows == 0:
        return out
    order = order[:rows]
    tokens = order // top_k
    sorted_x = x.index_select(0, tokens)
    gate_up = x.new_empty(rows, 2 * inter)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            experts.gate_up(expert, sorted_x[start : start + count], gate_up[start : start + count])
            start += count
    act = silu_and_mul(gate_up)
    down = x.new_empty(rows, x.shape[1])
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            experts.down(expert, act[start : start + count], down[start : start + count])
            start += count
    scale = weights.reshape(-1).index_select(0, order)
    if x.dtype == torch.float32:
        down.mul_(scale.unsqueeze(1))
    else:  # weigh in float32, as transformers does, then round once
        down = (down.float() * scale.unsqueeze(1)).to(x.dtype)
    return out.index_add_(0, tokens, down)

