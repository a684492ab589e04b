"""The Triton grouped GEMM for the fused routed experts (pagoda/exec/triton_moe.py) equals the
per-expert loop; on a machine without a GPU under Triton's interpreter (set up as for the attention
kernels, tests/exec/test_triton_kernels.py), compiled on CUDA."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from tests.exec import test_triton_kernels as triton_setup  # noqa: F401  (TRITON_INTERPRET before triton)

if "pagoda.exec.triton_moe" in sys.modules and not triton_setup.ON_CUDA:
    importlib.reload(sys.modules["pagoda.exec.triton_moe"])

from pagoda.exec.triton_moe import _BLOCK_M, triton_fused_experts, use_triton_experts  # noqa: E402
from pagoda.model.fused_moe import StackedExperts, select_experts  # noqa: E402
from tests.model.test_moe import naive_moe  # noqa: E402

DEVICE = triton_setup.DEVICE


def _case(tokens, num_experts=6, hidden=48, inter=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = select_experts(torch.randn(tokens, num_experts, generator=g), 2, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 3, 2 * _BLOCK_M + 5])
def test_grouped_gemm_equals_the_per_expert_loop(tokens):
    """Hidden and widths that are no multiple of the blocks; an expert's run over several tiles."""
    x, w13, w2, weights, ids = _case(tokens)
    want = naive_moe(x, w13, w2, weights, ids)
    on = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    got = triton_fused_experts(on[0], StackedExperts(on[1], on[2]), on[3], on[4]).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if tokens == 1:
        assert len(set(ids.flatten().tolist())) < 6  # experts without a token: no tile


def test_grouped_gemm_with_a_rank_s_experts_only():
    x, w13, w2, weights, ids = _case(9)
    whole = naive_moe(x, w13, w2, weights, ids)
    parts = []
    for start, end in ((0, 2), (2, 6)):
        on = [t.to(DEVICE) for t in (x, w13[start:end], w2[start:end], weights, ids)]
        parts.append(triton_fused_experts(on[0], StackedExperts(on[1], on[2]), on[3], on[4], start, 6).cpu())
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-4, rtol=1e-4)


def test_a_model_routed_through_the_kernel_gives_the_same_logits(tmp_path):
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata
    from pagoda.model.loader import load_model
    from tests.tiny_models import save_tiny_model

    save_tiny_model("qwen2_moe", tmp_path, num_hidden_layers=1)
    model = load_model(str(tmp_path), dtype="float32", device=DEVICE).model
    ids = torch.tensor([5, 17, 300, 42, 7], device=DEVICE)

    def logits():
        with torch.no_grad():
            meta = ContiguousMetadata([0], [5])
            return model.compute_logits(model(ids, torch.arange(5, device=DEVICE),
                                              AttentionContext(ContiguousKVBackend(), meta))).cpu()

    want = logits()
    assert use_triton_experts(model) == 1
    torch.testing.assert_close(logits(), want, atol=1e-4, rtol=1e-4)
