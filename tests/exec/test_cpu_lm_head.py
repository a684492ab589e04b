"""The packed oneDNN LM head gives the model's logits, and is used exactly where it applies."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_lm_head import PackedLMHead, logits_fn


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def lm_head_weight(self) -> torch.Tensor:
        return self.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.t()


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_head_equals_matmul(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 96, generator=g)
    hidden = torch.randn(rows, 96, generator=g)
    head = PackedLMHead(weight)
    torch.testing.assert_close(head(hidden), hidden @ weight.t(), atol=1e-4, rtol=1e-5)
    # A gathered (non-contiguous) row selection, as the runner passes for prefill chunks.
    picked = torch.randn(2 * rows, 96, generator=g)[::2]
    torch.testing.assert_close(head(picked), picked @ weight.t(), atol=1e-4, rtol=1e-5)


def test_used_for_fp32_on_cpu_only(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(logits_fn(_Head(torch.randn(50, 8)), cpu), PackedLMHead)
    bf16 = _Head(torch.randn(50, 8, dtype=torch.bfloat16))
    assert logits_fn(bf16, cpu) == bf16.compute_logits
    monkeypatch.setenv("PAGODA_NO_ONEDNN", "1")
    fp32 = _Head(torch.randn(50, 8))
    assert logits_fn(fp32, cpu) == fp32.compute_logits
