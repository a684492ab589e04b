"""The error bound the quantized matmul kernels are held to, CPU (test_quant_matmul.py) and GPU
(test_triton_quant.py) alike: float32 rounding relative to the sum of |x| |w| over the row."""

from __future__ import annotations

import torch


def assert_within_fp32_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    magnitude = x.abs().double() @ w.abs().double().t()
    bound = 4 * x.shape[1] * torch.finfo(torch.float32).eps * magnitude + 1e-30
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"error above float32 rounding by {excess}"
