"""A pure-decode CPU step through one C++ call over the decoder layers (csrc/fused_decode.cpp).

With one to a few sequences a step is bound by reading the weights plus Python's cost of calling
~25 kernels a layer (~3 ms of SmolLM2's ~9 for one sequence). `FusedCPUDecoder` hands the layers'
tensors to a C++ plan once; a pure-decode step (of up to `QUANT_MAX_ROWS` sequences with quantized
weights, of any number otherwise) then runs every layer there, calling the very kernels the
modules call (the fused layer ops, the bf16 GEMM or oneDNN's packed linears or the quantized matmul
or the W8A8 GEMM, the KV write and paged decode attention), in the same order: the output is the
module path's, bit for bit. So does the step of one prompt with no cached prefix (a short request's
first token: ~5 of SmolLM2's ~19 ms were the modules' Python), its attention by the prefill kernel
as TorchPagedAttention calls it. Everything else (mixed steps, a prompt's later chunks or one after
a cached prefix, other model shapes) takes the modules.

What it serves: Llama-family layers (Llama, Mistral, Qwen2 with its QKV bias, Qwen3 with its
per-head q/k norms) with a dense MLP, without tensor or pipeline parallelism, in float32 or bfloat16
on the CPU, with the C++ paged kernels, and linears that are packed (cpu_linear) or quantized with
their kernel (quant_linear). MoE layers (Mixtral's, Qwen3-MoE's: routed experts without a shared one)
are served where their experts run on the grouped bf16 kernel (cpu_grouped_moe) or are kept
quantized (model/quantized.QuantExperts): the router, its softmax and top-k through the same ATen
calls, then that kernel, or fused_moe.fused_experts' sort and each expert's quantized projections;
other MoE layers take the modules.
PAGODA_NO_FUSED_DECODE=1 turns it off.

The plan holds the tensors it was built with; weight updates copy into them in place, but a packed
weight or a KV cache may be replaced by a new tensor (weight_tensors, sleep and wake), so each step
first checks that the modules still hold the plan's tensors and rebuilds it when not; sleep calls
`release` so that the packed weights it drops are freed.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from pagoda.cpp_build import build_cpu_extension
from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.cpu_grouped_moe import GroupedExperts, grouped_fused_experts, grouped_kernel
from pagoda.exec.cpu_kernels import load_cpu_kernels, load_gemm_int8, load_prefill_attention
from pagoda.exec.cpu_linear import PackedLinear, block_rows, gemm_kernel
from pagoda.exec.paged_attention import TorchPagedAttention
from pagoda.exec.quant_linear import TILE_ROWS, Int8Rows, int8_gemm, load_quant_kernels, quant_matmul, w8a8_gemm
from pagoda.model.cpu_layer_ops import FUSED_DTYPES, load_layer_ops
from pagoda.model.fused_moe import fused_experts
from pagoda.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagoda.model.moe import FusedMoE
from pagoda.model.quantized import QuantExperts, QuantLinear

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_decode.cpp"
QUANT_MAX_ROWS = 8  # the quantized kernels' few-rows path (quant_linear.FUSED_ROWS); beyond it they dequantize


@lru_cache(maxsize=1)
def load_fused_decode() -> ModuleType | None:
    """The compiled module, or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_fused_decode", _SOURCE, "fused CPU decode step")


class _NotServed(Exception):
    """The model has a part the fused step does not serve; the reason is logged."""


class FusedCPUDecoder:
    """Runs pure-decode steps through the C++ plan; see the module doc."""

    def __init__(self, model: LlamaForCausalLM, backend: TorchPagedAttention, ops: ModuleType) -> None:
        self.model, self.backend, self.ops = model, backend, ops
        self._held: list[tuple[Any, str, Any]] = []  # (owner, attribute, the tensor the plan holds)
        self.plan = self._build()
        self.quantized = self.plan.quantized()
        # A prompt's step is served where the modules give its attention to the prefill kernel.
        self.prompts = backend.prefill_kernel_takes(model.model.layers[0].self_attn.head_dim)

    @classmethod
    def create(cls, model: nn.Module, backend: Any, device: torch.device) -> FusedCPUDecoder | None:
        """The decoder for `model`, or None where it does not apply (the step then takes the modules)."""
        if device.type != "cpu" or os.environ.get("PAGODA_NO_FUSED_DECODE") == "1":
            return None
        if not isinstance(model, LlamaForCausalLM) or not isinstance(backend, TorchPagedAttention):
            return None
        if backend.decode_kernel is None or backend.write_kernel is None:
            return None
        ops = load_fused_decode()
        if ops is None:
            return None
        try:
            return cls(model, backend, ops)
        except _NotServed as why:
            logger.debug("fused decode step not used: %s", why)
            return None

    def can_run(self, meta: PagedAttentionMetadata, num_tokens: int) -> bool:
        if meta.num_actual_tokens is not None:
            return False
        if meta.num_decodes != num_tokens and not self._one_prompt(meta, num_tokens):
            return False
        return num_tokens <= QUANT_MAX_ROWS or not self.quantized

    def _one_prompt(self, meta: PagedAttentionMetadata, num_tokens: int) -> bool:
        """The step is one prompt with no earlier context (no cached prefix, its first chunk): its
        attention is the prefill kernel's over its own K/V, which the plan calls as the modules do."""
        return (self.prompts and meta.num_decodes == 0 and meta.num_reqs == 1
                and int(meta.seq_lens_cpu[0]) == num_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """The step's hidden states (a few rows read a linear's GGUF blocks: cpu_linear.block_rows)."""
        if self.plan is None or any(getattr(owner, attr) is not held for owner, attr, held in self._held):
            self.plan = self._build()
        inner = self.model.model
        nd = meta.num_decodes
        table = inner.rotary.table(max(meta.seq_lens_cpu))  # a decode's position is its length - 1
        h, residual = self.plan.run(inner.embed_tokens(input_ids), positions, table, meta.slot_mapping,
                                    meta.block_tables[:nd], meta.seq_lens[:nd], nd == 0, *block_rows())
        return inner.norm.add_forward(h, residual)[0]

    def release(self) -> None:
        """Let go of the plan's tensors (sleep drops packed weights, which the plan would keep
        alive); the next step builds it again."""
        self.plan, self._held = None, []

    # -- building the plan ------------------------------------------------------------------------
    def _build(self):
        model, ops = self.model, self.ops
        inner = model.model
        if model.tp.size != 1 or model.pp.size != 1:
            raise _NotServed("tensor or pipeline parallel")
        layers = list(inner.layers)
        dtype = inner.norm.weight.dtype
        if dtype not in FUSED_DTYPES or load_layer_ops() is None:
            raise _NotServed(f"{dtype} has no fused layer ops")
        if inner.embed_tokens(torch.zeros(1, dtype=torch.long)).dtype != dtype:
            raise _NotServed("embeddings in another dtype than the layers")
        self._held = [(self.backend.kv_cache, "tensor", self.backend.kv_cache.tensor)]
        plan = ops.DecodePlan(self._addresses())
        for i, layer in enumerate(layers):
            mlp = layer.mlp
            if type(layer) is not LlamaDecoderLayer or type(mlp) not in (LlamaMLP, FusedMoE):
                raise _NotServed(f"layer {i} is not a Llama layer with a dense MLP or routed experts")
            experts, kernel = getattr(mlp, "packed_experts", None), getattr(mlp, "experts_kernel", None)
            if type(mlp) is FusedMoE and not (isinstance(experts, GroupedExperts) and kernel is grouped_fused_experts
                                              or isinstance(experts, QuantExperts) and kernel is fused_experts):
                raise _NotServed(f"layer {i}'s experts are neither on the grouped kernel nor quantized")
            attn = layer.self_attn
            qk_norms = attn.q_norm is not None
            if qk_norms and (attn.q_norm.eps != attn.k_norm.eps or attn.q_norm.weight.dtype != dtype):
                raise _NotServed("q and k norms that differ")
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if norm.weight.dtype != dtype:
                    raise _NotServed("norm weights in another dtype")
            k_cache, v_cache = self.backend.kv_cache.layer(attn.layer_idx)
            if type(mlp) is FusedMoE:  # set_experts below replaces the MLP; the router stands in for it
                gate_up = down = router = self._linear(mlp.gate)
            else:
                gate_up, down = self._linear(mlp.gate_up_proj), self._linear(mlp.down_proj)
            plan.add_layer(
                layer.input_layernorm.weight, layer.input_layernorm.eps,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                self._linear(attn.qkv_proj), self._linear(attn.o_proj), gate_up, down,
                k_cache, v_cache, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
            )
            if qk_norms:
                plan.set_qk_norms(attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
            if type(mlp) is FusedMoE:
                self._experts(plan, mlp, router)
        return plan

    def _experts(self, plan, mlp: FusedMoE, router) -> None:
        experts = mlp.packed_experts
        self._held += [(mlp, "packed_experts", experts), (experts, "w13", experts.w13), (experts, "w2", experts.w2)]
        if isinstance(experts, QuantExperts):
            kernel = experts.kernel
            plan.set_quantized_experts(router, [self._quantized(parts, None, kernel) for parts in experts.w13],
                                       [self._quantized([w], None, kernel) for w in experts.w2],
                                       mlp.top_k, mlp.renormalize)
            return
        plan.set_experts(router, experts.w13, experts.w2, mlp.top_k, mlp.renormalize, mlp.expert_start)

    def _addresses(self) -> dict[str, int]:
        addresses = {**load_layer_ops()._addresses(), **load_cpu_kernels()._addresses()}
        if self.backend.prefill_kernel is not None:
            addresses.update(load_prefill_attention()._addresses())
        if gemm_kernel() is not None:
            addresses.update(gemm_kernel()._addresses())
        quantized = [m for m in self.model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
        quant = load_quant_kernels() if quantized else None
        if quant is not None:
            addresses.update(quant._addresses())
        if any(m.kernel is w8a8_gemm for m in quantized):
            addresses.update(load_gemm_int8()._addresses())
        if any(isinstance(m, FusedMoE) for m in self.model.modules()) and grouped_kernel() is not None:
            addresses.update(grouped_kernel()._addresses())
        return addresses

    def _linear(self, module: nn.Module):
        ops = self.ops
        if isinstance(module, PackedLinear):
            if module.fuses_silu:  # the plan then skips its silu_and_mul
                self._held += [(module, "paired", module.paired), (module, "blocks", module.blocks)]
                return ops.gemm_silu_linear(module.paired, module.out_features // 2, module.blocks)
            self._held += [(module, "packed", module.packed), (module, "blocks", module.blocks)]
            if module.gemm:
                return ops.gemm_linear(module.packed, module.bias, module.out_features, module.blocks)
            return ops.packed_linear(module.packed, module.bias, module.blocks, module.out_features)
        if isinstance(module, QuantLinear):
            self._held.append((module, "parts", module.parts))
            return self._quantized(module.parts, None if module.bias is None else module.bias.detach(), module.kernel)
        raise _NotServed(f"a {type(module).__name__} linear")

    def _quantized(self, parts: list, bias: torch.Tensor | None, kernel):
        """The plan's projection for weights kept quantized (a QuantLinear's or an expert's), calling
        what `kernel` calls for the plan's rows."""
        ops = self.ops
        if kernel in (int8_gemm, w8a8_gemm):
            weight = parts[0]
            if kernel is int8_gemm:
                return ops.int8_gemm_linear(weight.data.view(torch.int8), weight.scale, bias, weight.rows)
            return ops.w8a8_linear(weight.data, weight.scale, bias, weight.rows)
        # Int8Rows: the rows serve the plan's few rows, as they serve the module's.
        if kernel is quant_matmul or isinstance(kernel, Int8Rows):
            return ops.quant_linear([p.data for p in parts], [p.type_id for p in parts], [p.scale for p in parts],
                                    bias, TILE_ROWS)
        raise _NotServed("quantized weights without a CPU kernel")
