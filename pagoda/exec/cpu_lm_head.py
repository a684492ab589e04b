"""The LM head on CPU: logits through oneDNN with the head weight packed once, in its blocked layout.

For the few rows a step samples (1-64), torch's default F.linear (MKL) runs at half of oneDNN's
speed on this [vocab x hidden] shape (SmolLM2, 64 rows: 55 ms against 27 ms per step on 2 AVX2
cores), and the head is the largest single GEMM of a decode step. The packed copy costs one more
head-sized buffer (113 MB for SmolLM2 in fp32). Only fp32: that is what `dtype=auto` picks on CPUs
without native bf16, and the oneDNN bf16 path has not been measured.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

logger = logging.getLogger(__name__)

_ROWS_HINT = 64  # oneDNN picks its blocking for about this many rows; any count works


class PackedLMHead:
    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.packed, None, "none", [], "")


def logits_fn(model: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fastest way to compute `model`'s logits on `device`: the packed head on CPU in fp32 (unless
    PAGODA_NO_ONEDNN=1), else the model's own compute_logits."""
    weight = model.lm_head_weight()
    usable = (
        device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and os.environ.get("PAGODA_NO_ONEDNN") != "1"
    )
    if not usable:
        return model.compute_logits
    try:
        return PackedLMHead(weight)
    except (RuntimeError, AttributeError) as exc:  # a torch build without these oneDNN ops
        logger.warning("packed LM head unavailable (%s); using F.linear", exc)
        return model.compute_logits
