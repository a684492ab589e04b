"""The fused float32 CPU layer ops (csrc/layer_ops.cpp): RMSNorm with or without the residual add,
rotary in place, SiLU-and-multiply. The layers use them for float32 tensors on the CPU when the
extension builds; everything else (bf16, GPU, PAGODA_NO_CPP=1, no compiler) takes the PyTorch path.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

from pagoda.cpp_build import build_cpu_extension

_SOURCE = Path(__file__).parent / "csrc" / "layer_ops.cpp"


@lru_cache(maxsize=1)
def load_layer_ops() -> ModuleType | None:
    """The compiled module, or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_layer_ops", _SOURCE, "fused CPU layer ops")


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The fused ops if they apply to `x` (float32 on the CPU), else None."""
    if x.dtype != torch.float32 or not x.is_cpu:  # is_cpu: cheaper than building x.device
        return None
    return load_layer_ops()
