"""oneDNN-packed experts (pagoda/exec/cpu_moe.py) compute what the stacked weights compute, and the
runner packs an MoE's experts."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_linear import _native_bf16
from pagoda.exec.cpu_moe import PackedExperts, pack_experts
from pagoda.model.fused_moe import StackedExperts, fused_experts, select_experts
from pagoda.model.loader import load_model
from tests.tiny_models import save_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_packed_experts_equal_stacked(dtype, tokens):
    if dtype == torch.bfloat16 and not _native_bf16():
        pytest.skip("bf16 is packed only on CPUs with native bf16 (AVX512-BF16 or AMX)")
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(8, 64, 48, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(8, 48, 32, generator=g) * 0.2).to(dtype)
    x = torch.randn(tokens, 48, generator=g).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, 8, generator=g), 2, True)
    want = fused_experts(x, StackedExperts(w13, w2), weights, ids)
    got = fused_experts(x, PackedExperts(w13, w2), weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_runner_packing_replaces_the_stacked_weights(tmp_path):
    save_tiny_model("mixtral", tmp_path)
    model = load_model(str(tmp_path), dtype="float32").model
    layer = model.model.layers[0].mlp
    x = torch.randn(5, 64)
    with torch.no_grad():
        want = layer(x)
        assert pack_experts(model, torch.device("cpu")) == 2
        assert layer.w13_weight.numel() == 0 and isinstance(layer.packed_experts, PackedExperts)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
