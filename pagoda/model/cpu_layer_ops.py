"""The fused CPU layer ops (csrc/layer_ops.cpp): RMSNorm with or without the residual add, rotary in
place, SiLU-and-multiply. The layers use them for float32 and bfloat16 tensors on the CPU when the
extension builds; everything else (float16, GPU, PAGODA_NO_CPP=1, no compiler) takes the PyTorch path.

What equals what: in bf16, rotary and SiLU-and-multiply give the PyTorch path's bits on every ISA
torch dispatches to (AVX-512, AVX2, scalar; SiLU checked for all 65,536 gates against bf16(g / (1 +
exp(-g))) with exp rounded once to float, which torch's F.silu also gives); RMSNorm sums its squares
in another, ISA-independent order and may differ by a bf16 step in rare elements. float32 agrees
within float rounding. inf and NaN come out where the PyTorch path puts them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

from pagoda.cpp_build import build_cpu_extension

# bf16 rounds where the PyTorch path rounds (see the kernel's header), so both dtypes keep its results.
FUSED_DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = Path(__file__).parent / "csrc" / "layer_ops.cpp"


@lru_cache(maxsize=1)
def load_layer_ops() -> ModuleType | None:
    """The compiled module, or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_layer_ops", _SOURCE, "fused CPU layer ops")


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The fused ops if they apply to `x` (float32 or bfloat16 on the CPU), else None."""
    if x.dtype not in FUSED_DTYPES or not x.is_cpu:  # is_cpu: cheaper than building x.device
        return None
    return load_layer_ops()
