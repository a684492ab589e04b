"""CPU kernels for weights kept quantized (csrc/quant_matmul.cpp), given to the model's quantized
layers (model/quantized.py) the way cpu_linear gives its linears oneDNN's packed path.

For up to 8 rows (decode, small batches) each weight row's blocks are multiplied into every
activation row at once: the weights are read once per step in their packed size. For Q8_0, Q4_0,
Q4_1 and int8 the activations are rounded to int8 per 32-block and the dot products taken in
integers (AVX512-VNNI or AVX2, as llama.cpp does; csrc/quant_dot.h states the bound), the other
types dequantize each block in cache. For more rows the weight is dequantized (whole, or in tiles
for a large head) to the activations' dtype and multiplied by oneDNN's GEMM, whose cost the
dequantization barely adds to. int8 weights on a CPU with AVX512-VNNI (K a multiple of 32) take
the W8A8 GEMM above the few rows instead (csrc/gemm_int8.cpp, `w8a8_gemm`: the activations rounded
to int8 per 32 values as the few-rows path rounds them, integer dot products; 1.16x the unquantized
path's batch throughput in bf16, 1.6x in float32, docs/benchmarks.md). Without VNNI, int8 weights
of a bf16 model on a CPU with AVX512-BF16 take the bf16 GEMM (csrc/gemm_bf16.cpp: reordered once,
widened to bf16 in cache; `int8_gemm`). The few-rows integer path reads a weight's rows, the GEMMs
their own order: both are kept while the int8 weights take at most an eighth of the machine's
memory (`Int8Rows`: one stream decodes ~1.45x faster on the rows than on the bf16 GEMM's widening,
~1.15x faster than on the W8A8 GEMM, docs/perf-notes.md); else the GEMM's order alone serves every
row count (W8A8, or the bf16 GEMM's tasks), or, in float32 without VNNI, the rows do, dequantized
for oneDNN above the few rows.

The path is picked at run time from the CPU (avx512_vnni, else avx2_int8, else scalar);
PAGODA_QUANT_ISA forces another: avx512 or avx2 (the float paths, dot products in fp32 over
dequantized blocks), avx2_int8, scalar. In a build for PAGODA_CPU_ISA=avx2 (cpp_build) the AVX-512 ones
are refused, as on an AVX2-only CPU.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from pagoda.cpp_build import build_cpu_extension
from pagoda.exec.cpu_kernels import load_gemm_int8
from pagoda.exec.cpu_kv_sizing import mem_total_bytes
from pagoda.exec.cpu_linear import bucket_rows, gemm_kernel, pack_gemm
from pagoda.model.loader import cpu_has_bf16
from pagoda.model.quantized import (
    QuantEmbedding, QuantExperts, QuantizedTensor, QuantLinear, map_tensors, module_tensors, quantized_modules,
)

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "quant_matmul.cpp"
# Up to this many rows the fused kernel (weights read once, in their packed size) is the fast one.
FUSED_ROWS = 8
# For more rows, a weight is dequantized for the GEMM whole, or in tiles of at most this many bytes
# (SmolLM2's largest linear is 7 MB in float32; its tied head, 113 MB, goes in four tiles).
_GEMM_TILE_BYTES = 32 << 20
# The C++ kernel's own GEMM path (torch.mm over dequantized tiles of this many rows): for callers
# that hand it many rows directly, such as the kernel tests.
TILE_ROWS = 256


@lru_cache(maxsize=1)
def load_quant_kernels() -> ModuleType | None:
    """The compiled module, or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    ops = build_cpu_extension("pagoda_quant_matmul", _SOURCE, "quantized matmul kernels")
    if ops is not None and os.environ.get("PAGODA_QUANT_ISA"):
        ops.set_isa(os.environ["PAGODA_QUANT_ISA"])
    return ops


def quant_matmul(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T -> [M, N] in x's dtype."""
    ops = load_quant_kernels()
    x = x.contiguous()
    if x.shape[0] <= FUSED_ROWS:
        return ops.quant_matmul(x, weight.data, weight.type_id, weight.scale, TILE_ROWS)
    rows = max(1, _GEMM_TILE_BYTES // (4 * weight.cols))
    if rows >= weight.rows:
        return _gemm(x, ops.dequantize_rows(weight.data, weight.type_id, weight.cols, weight.scale, 0, weight.rows))
    out = x.new_empty((x.shape[0], weight.rows))
    for start in range(0, weight.rows, rows):
        count = min(rows, weight.rows - start)
        tile = ops.dequantize_rows(weight.data, weight.type_id, weight.cols, weight.scale, start, count)
        out[:, start:start + count] = _gemm(x, tile)
    return out


def _gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN where it serves x's dtype (2x torch.mm's speed on SmolLM2's shapes
    with prompts of 64-512 tokens, even from a plain, unpacked weight), rows padded as cpu_linear
    pads them so that the primitives oneDNN builds stay few."""
    weight = weight.to(x.dtype)
    if not _onednn_serves(x.dtype):
        return torch.nn.functional.linear(x, weight)
    m = x.shape[0]
    padded = bucket_rows(m)
    if padded != m:
        x = torch.cat([x, x.new_zeros((padded - m, x.shape[1]))])
    out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return out[:m] if padded != m else out


@lru_cache(maxsize=4)
def _onednn_serves(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or os.environ.get("PAGODA_NO_ONEDNN") == "1":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_bf16()
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_gemm(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [M, K] bf16 @ dequantize(weight).T for an int8 weight in the "tasks" layout (`to_tasks`)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return gemm_kernel().gemm_i8_bf16(x, weight.data.view(torch.int8), weight.scale, None, weight.rows)


def to_tasks(weight: QuantizedTensor) -> QuantizedTensor:
    """A copy of an int8 row-layout weight in the bf16 GEMM's task order (whether the rows stay is
    the caller's choice: install_quant_kernels)."""
    packed = pack_gemm(weight.data.view(torch.int8)).view(torch.uint8)
    return QuantizedTensor("int8", weight.rows, weight.cols, packed, weight.scale, layout="tasks")


def w8a8_gemm(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [M, K] float32 or bf16 @ dequantize(weight).T for an int8 weight in the "w8a8" layout
    (`to_w8a8`): the activations rounded to int8 per 32 values, integer dot products (csrc/gemm_int8.cpp)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return load_gemm_int8().gemm_int8(x, weight.data, weight.scale, None, weight.rows)


def to_w8a8(weight: QuantizedTensor) -> QuantizedTensor:
    """A copy of an int8 row-layout weight in the W8A8 GEMM's order: per 64 output columns
    [K/4][4][16][4] bytes, each int8 value + 128 (zero rows padding N)."""
    packed = pack_gemm(weight.data.view(torch.int8), group=4).view(torch.uint8) ^ 0x80
    return QuantizedTensor("int8", weight.rows, weight.cols, packed, weight.scale, layout="w8a8")


class Int8Rows:
    """The kernel of int8 weights held in two orders: their rows (the layer's parts) for the
    few-rows integer path, a copy of each in `gemm`'s order (w8a8_gemm or int8_gemm) above FUSED_ROWS."""

    def __init__(self, copies: dict[int, QuantizedTensor], gemm) -> None:
        self.copies = copies  # id(part) -> its copy; the layer holds the parts, so the ids stay theirs
        self.gemm = gemm

    @classmethod
    def of(cls, module: nn.Module, to_copy, gemm) -> "Int8Rows":
        return cls({id(p): to_copy(p) for p in module_tensors(module)}, gemm)

    def __call__(self, x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
        return quant_matmul(x, weight) if x.shape[0] <= FUSED_ROWS else self.gemm(x, self.copies[id(weight)])


def _int8_widths(module: nn.Module) -> list[int] | None:
    """The row lengths of a layer whose weights are all int8 rows (one part for a linear); else None."""
    parts = module_tensors(module)
    if isinstance(module, QuantLinear) and len(parts) != 1:
        return None
    if not isinstance(module, (QuantLinear, QuantExperts)) or not all(p.qtype == "int8" for p in parts):
        return None
    return [p.cols for p in parts]


def _int8_gemm_serves(module: nn.Module, dtype: torch.dtype | None) -> bool:
    widths = _int8_widths(module)
    return (dtype == torch.bfloat16 and gemm_kernel() is not None and widths is not None
            and all(w % 2 == 0 for w in widths))


def w8a8_kernel() -> ModuleType | None:
    """The W8A8 module where the CPU has AVX512-VNNI and it builds (PAGODA_NO_W8A8=1: never)."""
    if os.environ.get("PAGODA_NO_W8A8") == "1":
        return None
    ops = load_gemm_int8()
    return ops if ops is not None and ops.has_vnni() else None


def _w8a8_serves(module: nn.Module, dtype: torch.dtype | None) -> bool:
    widths = _int8_widths(module)
    return (dtype in (torch.float32, torch.bfloat16) and widths is not None and all(w % 32 == 0 for w in widths)
            and w8a8_kernel() is not None)


def _install_gpu_kernels(model: nn.Module, device: torch.device, count: int) -> int:
    move_quantized(model, device)
    try:
        from pagoda.exec.triton_quant import install_gpu_quant_kernels
    except ImportError as exc:
        logger.warning("triton unavailable (%s): %d quantized layers dequantize on every call", exc, count)
        return 0
    return install_gpu_quant_kernels(model)


def move_quantized(model: nn.Module, device: torch.device) -> None:
    """Every quantized layer's packed weight on `device` (a GGUF's blocks are read on the host);
    a tensor two layers share (a tied head reads the embedding's blocks) is moved once."""
    moved: dict[int, QuantizedTensor] = {}

    def on_device(weight: QuantizedTensor) -> QuantizedTensor:
        if weight.data.device == device:
            return weight
        if id(weight) not in moved:
            scale = None if weight.scale is None else weight.scale.to(device)
            moved[id(weight)] = QuantizedTensor(weight.qtype, weight.rows, weight.cols, weight.data.to(device),
                                                scale, weight.layout)
        return moved[id(weight)]

    for module in quantized_modules(model):
        map_tensors(module, on_device)


def quant_gather(weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the dequantized weight, float32."""
    return load_quant_kernels().gather_rows(weight.data, weight.type_id, weight.cols, weight.scale, ids)


def install_quant_kernels(model: nn.Module, device: torch.device) -> int:
    """Give every quantized layer of `model` the CPU kernels (on CUDA the Triton ones,
    exec/triton_quant.py); returns how many. Without a build the layers keep their (slow)
    dequantize-everything fallback, with a warning."""
    modules = quantized_modules(model)
    if modules and device.type == "cuda":
        return _install_gpu_kernels(model, device, len(modules))
    if not modules or device.type != "cpu":
        return 0
    if load_quant_kernels() is None:
        logger.warning("quantized matmul kernels unavailable: %d quantized layers dequantize on every call", len(modules))
        return 0
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)  # the activations'
    w8a8 = {id(m) for m in modules if _w8a8_serves(m, dtype)}
    gemm = {id(m) for m in modules if _int8_gemm_serves(m, dtype)} - w8a8
    # Int8Rows' second copies (an MoE's experts among them: a token's expert sees few rows, a
    # batch's many, and the GEMM serves the latter ~4x faster than dequantizing the expert)
    second = sum(t.nbytes for m in modules if id(m) in w8a8 | gemm for t in module_tensors(m))
    memory = mem_total_bytes()
    keep_rows = memory is not None and second <= memory // 8
    for module in modules:
        if id(module) in w8a8 | gemm:
            to_copy, kernel = (to_w8a8, w8a8_gemm) if id(module) in w8a8 else (to_tasks, int8_gemm)
            if keep_rows:
                module.kernel = Int8Rows.of(module, to_copy, kernel)
            else:  # one copy, in the GEMM's order, for every row count
                map_tensors(module, to_copy)
                module.kernel = kernel
        elif isinstance(module, (QuantLinear, QuantExperts)):  # an expert's few rows read its packed bytes once
            module.kernel = quant_matmul
        elif isinstance(module, QuantEmbedding):
            module.gather = quant_gather
    return len(modules)
