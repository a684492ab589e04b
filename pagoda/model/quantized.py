"""Weights kept quantized in memory: the packed tensor (plain data) and the layers that hold it.

A `QuantizedTensor` is a weight matrix in one of the block formats the CPU kernels read (GGUF's
Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K as they lie in the file, or int8 or fp8 (e4m3) rows with a
float32 scale per output channel). `QuantLinear` and `QuantEmbedding` stand in for nn.Linear and
nn.Embedding, `QuantExperts` for an MoE layer's stacked experts (fused_moe.StackedExperts). Their
matmul and row lookup are supplied by the execution layer (`exec/quant_linear.py` sets `kernel`),
which picks the kernel by the weight's format and the device; without one they fall back to
dequantizing the whole matrix on every call (correct, slow: only for builds without the C++ kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from pagoda.config import QUANTIZATION_METHODS as QUANTIZATIONS  # `--quantization`, vLLM's flag

# GGUF types with kernels: kept quantized under --quantization gguf. (ggml's type ids, which the
# kernels are keyed by.)
GGUF_KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
INT8_TYPE_ID = 24  # ggml's I8: int8 rows; here with a per-row scale
# weights per block and bytes per block
BLOCK_LAYOUT = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
                "Q6_K": (256, 210), "int8": (32, 32)}


@dataclass
class QuantizedTensor:
    """A [rows, cols] weight as packed bytes: `data` is uint8 [rows, bytes per row] (int8 and fp8
    weights viewed as bytes); `scale`, int8 and fp8 only, float32 [rows].

    `layout` (int8 only), where the execution layer has reordered the int8 values for a GEMM: "tasks",
    [ceil(rows / 64), cols / 2, 4, 16, 2] for the bf16 GEMM (exec/cpu_linear.pack_gemm); "w8a8",
    [ceil(rows / 64), cols / 4, 4, 16, 4] bytes of value + 128 (exec/quant_linear.to_w8a8).
    `dequantize` undoes either."""

    qtype: str
    rows: int
    cols: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    layout: str = "rows"

    @property
    def type_id(self) -> int:
        return INT8_TYPE_ID if self.qtype == "int8" else GGUF_KERNEL_TYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.scale is None else self.scale.numel() * 4)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix: gguf-py's dequantization, or int8/fp8 values times their scales."""
        if self.qtype == "fp8":
            return self.data.view(torch.float8_e4m3fn).float() * self.scale[:, None]
        if self.qtype == "int8":
            q = self.data.view(torch.int8)
            if self.layout == "w8a8":
                q = (self.data ^ 0x80).view(torch.int8)
            if self.layout in ("tasks", "w8a8"):  # [B, K/2, 4, 16, 2] or [B, K/4, 4, 16, 4] -> [B * 64, K]
                q = q.permute(0, 2, 3, 1, 4).reshape(-1, self.cols)[: self.rows]
            return q.float() * self.scale[:, None]
        import gguf
        from gguf.quants import dequantize

        array = dequantize(self.data.numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(self.rows, self.cols)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """One tensor of the parts' rows in order (they share a format and a row length)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    scale = None if first.scale is None else torch.cat([p.scale for p in parts])
    data = torch.cat([p.data for p in parts])
    return QuantizedTensor(first.qtype, sum(p.rows for p in parts), first.cols, data, scale)


def row_slice(weight: QuantizedTensor, start: int, count: int) -> QuantizedTensor:
    """Rows [start, start + count) of a row-layout tensor, sharing its storage."""
    scale = None if weight.scale is None else weight.scale[start : start + count]
    return QuantizedTensor(weight.qtype, count, weight.cols, weight.data[start : start + count], scale)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 per output channel: scale = max |w| / 127 over each row (1 for a zero row)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", w.shape[0], w.shape[1], q.view(torch.uint8).contiguous(), scale.contiguous())


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def e4m3_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (float8_e4m3fn values, float32 scale [R]), w ~= values * scale row by row:
    scale = max |w| / 448 over each row (1 for a zero row). Weights at load, and activations on the
    GPU (exec/triton_quant.py) alike."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8(weight: torch.Tensor) -> QuantizedTensor:
    """e4m3 per output channel (`e4m3_rows`)."""
    q, scale = e4m3_rows(weight)
    return QuantizedTensor("fp8", q.shape[0], q.shape[1], q.view(torch.uint8).contiguous(), scale.contiguous())


class MatmulKernel(Protocol):
    def __call__(self, x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor: ...


def reference_matmul(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    return x @ weight.dequantize().to(x.dtype).t()


class QuantLinear(nn.Module):
    """y = x W^T + b with W held quantized: one QuantizedTensor, or several (a merged projection
    whose parts came in different formats), their outputs side by side."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts: list[QuantizedTensor] = []
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.kernel: MatmulKernel | None = None

    def set_parts(self, parts: list[QuantizedTensor]) -> None:
        """The weight's row blocks in order; runs of one format are merged into one tensor."""
        merged: list[list[QuantizedTensor]] = []
        for part in parts:
            if merged and merged[-1][0].qtype == part.qtype:
                merged[-1].append(part)
            else:
                merged.append([part])
        self.parts = [concat_rows(run) for run in merged]
        rows = sum(p.rows for p in self.parts)
        if rows != self.out_features or any(p.cols != self.in_features for p in self.parts):
            raise ValueError(f"quantized weight is {rows}x{self.parts[0].cols}, expected {self.out_features}x{self.in_features}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel or reference_matmul
        flat = x.reshape(-1, self.in_features)
        outs = [kernel(flat, part) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = "+".join(p.qtype for p in self.parts) or "unloaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


class RowKernel(Protocol):
    def __call__(self, weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor: ...


class QuantEmbedding(nn.Module):
    """Token embeddings held quantized; each lookup dequantizes only the rows it reads (to `dtype`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.weight_q: QuantizedTensor | None = None
        self.gather: RowKernel | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gather is not None:
            rows = self.gather(self.weight_q, ids.reshape(-1))
        else:
            rows = self.weight_q.dequantize()[ids.reshape(-1).long()]
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


class QuantExperts(nn.Module):
    """An MoE layer's experts held quantized, with fused_moe.StackedExperts' members: per expert its
    gate-up weight [2I, H] (gate rows, then up rows; two parts where the file gave them in two
    formats) and its down weight [H, I]. `kernel` as QuantLinear's. A module, so that the execution
    layer finds it among the model's quantized layers."""

    def __init__(self, gate_up: list[list[QuantizedTensor]], down: list[QuantizedTensor]) -> None:
        super().__init__()
        self.w13, self.w2 = gate_up, down
        self.num_experts, self.inter = len(down), down[0].cols
        self.kernel: MatmulKernel | None = None

    @classmethod
    def from_stacked(cls, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
                     num_experts: int) -> "QuantExperts":
        """From [E * I, H] gate and up and [E * H, I] down tensors, experts one after another (a
        GGUF's `ffn_*_exps`): each expert's rows are views into them."""
        inter, hidden = gate.rows // num_experts, down.rows // num_experts
        gate_up, downs = [], []
        for e in range(num_experts):
            g, u = row_slice(gate, e * inter, inter), row_slice(up, e * inter, inter)
            gate_up.append([concat_rows([g, u])] if g.qtype == u.qtype else [g, u])
            downs.append(row_slice(down, e * hidden, hidden))
        return cls(gate_up, downs)

    def tensors(self) -> list[QuantizedTensor]:
        return [t for parts in self.w13 for t in parts] + self.w2

    def gate_up(self, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        kernel = self.kernel or reference_matmul
        col = 0
        for part in self.w13[expert]:
            out[:, col : col + part.rows] = kernel(rows, part)
            col += part.rows

    def down(self, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_((self.kernel or reference_matmul)(rows, self.w2[expert]))


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding, QuantExperts))]


def module_tensors(module: nn.Module) -> list[QuantizedTensor]:
    """The packed tensors a quantized layer holds."""
    if isinstance(module, QuantLinear):
        return module.parts
    if isinstance(module, QuantExperts):
        return module.tensors()
    return [] if module.weight_q is None else [module.weight_q]


def map_tensors(module: nn.Module, fn) -> None:
    """Replace each packed tensor a quantized layer holds by `fn(tensor)` (moved, or reordered)."""
    if isinstance(module, QuantLinear):
        module.parts = [fn(p) for p in module.parts]
    elif isinstance(module, QuantExperts):
        module.w13 = [[fn(p) for p in parts] for parts in module.w13]
        module.w2 = [fn(p) for p in module.w2]
    elif module.weight_q is not None:
        module.weight_q = fn(module.weight_q)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights, each tensor once (a tied head shares the embedding's)."""
    seen: dict[int, int] = {}
    for module in quantized_modules(model):
        for t in module_tensors(module):
            seen[t.data.data_ptr()] = t.nbytes
    return sum(seen.values())

