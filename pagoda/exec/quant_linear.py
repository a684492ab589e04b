"""CPU kernels for weights kept quantized (csrc/quant_matmul.cpp), given to the model's quantized
layers (model/quantized.py) the way cpu_linear gives its linears oneDNN's packed path.

For up to 8 rows (decode, small batches) each weight row's blocks are dequantized in cache and
multiplied into every activation row at once: the weights are read once per step in their packed
size. For more rows, tiles of TILE_ROWS weight rows are dequantized to the activations' dtype and
multiplied by torch's GEMM. The instruction set (AVX-512, AVX2, scalar) is picked at run time from
the CPU; PAGODA_QUANT_ISA=avx2|scalar forces a narrower one.
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
from pagoda.model.quantized import QuantEmbedding, QuantizedTensor, QuantLinear, quantized_modules

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "quant_matmul.cpp"
# Dequantized tile for the GEMM path: 256 rows of a 576-wide float32 matrix are 0.6 MB (L2-sized);
# a larger model's rows take more, still far below a whole dequantized matrix.
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
    return ops.quant_matmul(x.contiguous(), weight.data, weight.type_id, weight.scale, TILE_ROWS)


def quant_gather(weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the dequantized weight, float32."""
    return load_quant_kernels().gather_rows(weight.data, weight.type_id, weight.cols, weight.scale, ids)


def install_quant_kernels(model: nn.Module, device: torch.device) -> int:
    """Give every quantized layer of `model` the CPU kernels; returns how many. Without a build
    the layers keep their (slow) dequantize-everything fallback, with a warning."""
    modules = quantized_modules(model)
    if not modules or device.type != "cpu":
        return 0
    if load_quant_kernels() is None:
        logger.warning("quantized matmul kernels unavailable: %d quantized layers dequantize on every call", len(modules))
        return 0
    for module in modules:
        if isinstance(module, QuantLinear):
            module.kernel = quant_matmul
        elif isinstance(module, QuantEmbedding):
            module.gather = quant_gather
    return len(modules)
