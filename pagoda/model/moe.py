"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama family's attention with
sparse feed-forward blocks, and how their expert weights load and split over ranks.

The architectures differ only in what the config says: Mixtral (`model_type` mixtral) renormalises
its top-k weights and every layer is sparse; Qwen2-MoE and Qwen3-MoE (`num_experts`) renormalise
where `norm_topk_prob`, and a layer is dense where it is in `mlp_only_layers` or `(layer + 1) %
decoder_sparse_step != 0`; Qwen2-MoE adds a shared expert, scaled by sigmoid(shared_expert_gate(x)).

Under tensor parallelism a rank holds either a slice of every expert (`intermediate / tp` rows of
each expert's gate and up, the same columns of its down: the default) or whole experts (`E / tp` of
them, contiguous: `TPGroup.expert_parallel`, vLLM's --enable-expert-parallel). Either way every rank
sees every token (attention leaves the hidden states replicated), computes its part of the block's
output, and one all-reduce sums the parts, as the dense MLP's does; with whole experts no all-to-all
is needed, because no token has to travel to reach its experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from pagoda.model.errors import ModelLoadError
from pagoda.model.fused_moe import StackedExperts, fused_experts, select_experts
from pagoda.model.layers import silu_and_mul
from pagoda.model.llama import LlamaForCausalLM, LlamaMLP
from pagoda.model.pipeline import SINGLE_STAGE, PPStage
from pagoda.model.tensor_parallel import SINGLE, TPGroup, shard_tensor, split_for


@dataclass(frozen=True)
class MoESpec:
    """The sparse blocks' shape, read from any of the three configs."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse_step: int
    dense_layers: frozenset[int]

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def moe_spec(config) -> MoESpec:
    mixtral = getattr(config, "model_type", None) == "mixtral"
    spec = MoESpec(
        # (transformers names Qwen3-MoE's count both ways; Mixtral's is num_local_experts)
        num_experts=getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None),
        top_k=getattr(config, "num_experts_per_tok", None),
        intermediate_size=config.intermediate_size if mixtral else getattr(config, "moe_intermediate_size", None),
        renormalize=True if mixtral else bool(getattr(config, "norm_topk_prob", False)),
        shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        sparse_step=1 if mixtral else getattr(config, "decoder_sparse_step", 1),
        dense_layers=frozenset(() if mixtral else (getattr(config, "mlp_only_layers", None) or ())),
    )
    for key in ("num_experts", "top_k", "intermediate_size", "sparse_step"):
        value = getattr(spec, key)
        if type(value) is not int or value <= 0:
            raise ValueError(f"mixture of experts: {key} must be a positive integer, got {value!r}")
    if spec.top_k > spec.num_experts:
        raise ValueError(f"num_experts_per_tok ({spec.top_k}) exceeds the {spec.num_experts} experts")
    return spec


def is_moe(config) -> bool:
    return getattr(config, "num_local_experts", None) is not None or getattr(config, "num_experts", None) is not None


def check_expert_split(config, size: int, expert_parallel: bool) -> None:
    """Raise ValueError, in one line, for experts that `size` ranks cannot split (nothing to check for
    a dense model)."""
    if not is_moe(config) or size == 1:
        return
    spec = moe_spec(config)
    if expert_parallel and spec.num_experts < size:
        raise ValueError(f"expert parallelism over {size} ranks needs at least {size} experts; "
                         f"the model has {spec.num_experts}")
    if not expert_parallel and spec.intermediate_size < size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the experts' intermediate size {spec.intermediate_size}")


def expert_range(num_experts: int, tp: TPGroup) -> tuple[int, int]:
    """[start, end) of the experts this rank holds: all of them unless expert parallel."""
    if not tp.expert_parallel:
        return 0, num_experts
    return tp.rank * num_experts // tp.size, (tp.rank + 1) * num_experts // tp.size


class FusedMoE(nn.Module):
    """The router (`gate`, replicated) and this rank's experts as two stacked weights: w13 [E, 2I, H]
    (each expert's gate rows, then its up rows) and w2 [E, H, I]."""

    def __init__(self, config, spec: MoESpec, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.top_k, self.renormalize = tp, spec.top_k, spec.renormalize
        self.num_experts = spec.num_experts
        self.expert_start, end = expert_range(spec.num_experts, tp)
        inter = spec.intermediate_size
        self.inter_start, self.inter_count = (0, inter) if tp.expert_parallel or tp.size == 1 else (
            tp.rank * inter // tp.size, (tp.rank + 1) * inter // tp.size - tp.rank * inter // tp.size)
        hidden = config.hidden_size
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.w13_weight = nn.Parameter(torch.empty(end - self.expert_start, 2 * self.inter_count, hidden))
        self.w2_weight = nn.Parameter(torch.empty(end - self.expert_start, hidden, self.inter_count))
        # What computes the projections: None for the stacked weights above; the runner may set
        # another implementation (oneDNN-packed copies on the CPU, pagoda/exec/cpu_moe.py), and
        # another kernel over the stacked weights (a Triton grouped GEMM on CUDA, exec/triton_moe.py).
        self.packed_experts = None
        self.experts_kernel = fused_experts
        self.packed_at_load = False  # the loader gives the experts as packed blocks, not into w13/w2

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the routed experts' output (summed over the ranks by the caller)."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        experts = self.packed_experts or StackedExperts(self.w13_weight, self.w2_weight)
        return self.experts_kernel(x, experts, weights, ids, self.expert_start, self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.routed(x))


class SharedExpertMoE(FusedMoE):
    """Qwen2-MoE's block: the routed experts plus a shared expert (tensor-parallel like a dense MLP),
    scaled per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config, spec: MoESpec, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, spec, tp)
        self.shared_expert = LlamaMLP(config, tp, spec.shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert
        out = self.routed(x)
        # The sigmoid scales each token's row, so it commutes with the sum over ranks: one all-reduce.
        out += torch.sigmoid(self.shared_expert_gate(x)) * shared.down_proj(silu_and_mul(shared.gate_up_proj(x)))
        return self.tp.all_reduce(out)


def moe_mlp(config, layer: int, tp: TPGroup) -> nn.Module:
    spec = moe_spec(config)
    if not spec.is_sparse(layer):
        return LlamaMLP(config, tp)
    return SharedExpertMoE(config, spec, tp) if spec.shared_intermediate_size else FusedMoE(config, spec, tp)


# A checkpoint's expert tensors: one per expert and projection (Mixtral's w1/w3/w2, Qwen's
# gate/up/down_proj), or stacked over the experts (transformers 5's in-memory gate_up_proj and
# down_proj; a GGUF's gate, up and down apiece).
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)")
# Pagoda's own stacked parameters (the GGUF load cache's layout) under the names above.
_OWN = {".mlp.w13_weight": ".mlp.experts.gate_up_proj", ".mlp.w2_weight": ".mlp.experts.down_proj"}
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class MoEForCausalLM(LlamaForCausalLM):
    """Serves MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM."""

    make_mlp = staticmethod(moe_mlp)
    cuda_graphs_ok = False  # the fused experts read each expert's token count on the host

    def __init__(self, config, architecture: str = "MixtralForCausalLM", tp: TPGroup = SINGLE,
                 pp: PPStage = SINGLE_STAGE) -> None:
        check_expert_split(config, tp.size, tp.expert_parallel)
        super().__init__(config, architecture, tp, pp)
        self.spec = moe_spec(config)

    @staticmethod
    def attention_flags(config, architecture: str) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        if architecture == "Qwen2MoeForCausalLM":
            return bool(getattr(config, "qkv_bias", True)) or bias, False
        return bias, architecture == "Qwen3MoeForCausalLM"

    def _checkpoint_params(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if not n.endswith(("w13_weight", "w2_weight"))}

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1 and ".shared_expert." in name:
            sp = split_for(self.config, self.tp, self.spec.shared_intermediate_size)
            if ".down_proj." in name:
                return tensor.narrow(1, sp.inter_start, sp.inter_count)
            return tensor.narrow(0, sp.inter_start, sp.inter_count)
        return shard_tensor(name, tensor, self.config, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        loaded: set[tuple[int, int, str]] = set()
        super().load_weights(self._divert_experts(weights, loaded, source), source)
        missing = [
            f"model.layers.{layer}.mlp.experts.{e}.{part}"
            for layer in range(self.model.first_layer, self.model.end_layer)
            if self.spec.is_sparse(layer) and not self.model.layers[layer].mlp.packed_at_load
            for e in range(*expert_range(self.spec.num_experts, self.tp)) for part in ("gate", "up", "down")
            if (layer, e, part) not in loaded
        ]
        if missing:
            raise ModelLoadError(f"{source}: missing expert tensor(s) {', '.join(missing[:5])}"
                                 f"{' ...' if len(missing) > 5 else ''}")

    def _divert_experts(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set, source: str
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """The non-expert tensors, for the dense loader; expert tensors go into w13 and w2 here."""
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
            for own, stacked_name in _OWN.items():
                if name.endswith(own):
                    name = name.removesuffix(own) + stacked_name
            per, stacked = _PER_EXPERT.fullmatch(name), _STACKED.fullmatch(name.removesuffix(".weight"))
            if per is None and stacked is None:
                yield name, tensor
                continue
            if not self._holds(name):
                continue
            layer = int((per or stacked).group(1))
            if per is not None:
                self._load_expert(layer, int(per.group(2)), _PART[per.group(3)], tensor, name, loaded, source)
                continue
            kind = stacked.group(2)
            for e in range(tensor.shape[0]):
                parts = ("gate", "up") if kind == "gate_up_proj" else (kind.removesuffix("_proj"),)
                for part, piece in zip(parts, tensor[e].chunk(len(parts))):
                    self._load_expert(layer, e, part, piece, name, loaded, source)

    def _load_expert(self, layer: int, expert: int, part: str, tensor: torch.Tensor, name: str, loaded: set,
                     source: str) -> None:
        block = self.model.layers[layer].mlp
        if not isinstance(block, FusedMoE) or not 0 <= expert < block.num_experts:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for this architecture")
        local = expert - block.expert_start
        if not 0 <= local < block.w13_weight.shape[0]:
            return  # another rank's expert
        i0, n = block.inter_start, block.inter_count
        hidden = self.config.hidden_size
        full = (hidden, self.spec.intermediate_size) if part == "down" else (self.spec.intermediate_size, hidden)
        if tuple(tensor.shape) != full:
            raise ModelLoadError(f"{source}: tensor {name!r} (expert {expert}, {part}) has shape "
                                 f"{tuple(tensor.shape)}, expected {full}")
        if part == "down":
            block.w2_weight.data[local].copy_(tensor.narrow(1, i0, n))
        else:
            block.w13_weight.data[local].narrow(0, 0 if part == "gate" else n, n).copy_(tensor.narrow(0, i0, n))
        key = (layer, expert, part)
        if key in loaded:
            raise ModelLoadError(f"{source}: expert tensor {name!r} ({part} of expert {expert}) appears more than once")
        loaded.add(key)
