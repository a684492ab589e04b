"""The packed oneDNN LM head and layer linears compute what F.linear does, and are used exactly where they apply."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_linear import PackedLinear, PackedLMHead, logits_fn, pack_linears


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


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(bias):
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(96, 40, bias=bias)
    x = torch.randn(33, 96, generator=g)
    ref = linear(x)
    packed = PackedLinear(linear)
    torch.testing.assert_close(packed(x), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed(x[:1]), ref[:1], atol=1e-4, rtol=1e-5)


def test_pack_linears_swaps_layer_projections_but_not_the_head(monkeypatch):
    class Net(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8).to(dtype)
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 16).to(dtype), torch.nn.ReLU())
            self.lm_head = torch.nn.Linear(16, 5, bias=False).to(dtype)

    cpu = torch.device("cpu")
    net = Net(torch.float32)
    x = torch.randn(4, 8)
    ref = net.lm_head(net.block(net.proj(x)))
    assert pack_linears(net, cpu) == 2
    assert isinstance(net.proj, PackedLinear) and isinstance(net.block[0], PackedLinear)
    assert type(net.lm_head) is torch.nn.Linear
    torch.testing.assert_close(net.lm_head(net.block(net.proj(x))), ref, atol=1e-5, rtol=1e-5)
    assert pack_linears(Net(torch.bfloat16), cpu) == 0
    monkeypatch.setenv("PAGODA_NO_ONEDNN", "1")
    assert pack_linears(Net(torch.float32), cpu) == 0


def test_the_cpu_runner_packs_the_layer_linears(tmp_path):
    from pagoda.model.loader import load_model
    from tests.conftest import make_engine
    from tests.tiny_models import save_tiny_model

    save_tiny_model("qwen2", tmp_path)  # projections with biases, tied head
    loaded = load_model(str(tmp_path), dtype="float32")
    make_engine(loaded, None, num_gpu_blocks_override=16)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and layer.self_attn.qkv_proj.bias is not None
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    # The tied head's weight is still the embedding's, which the embedding lookup needs.
    assert loaded.model.lm_head_weight() is loaded.model.model.embed_tokens.weight
