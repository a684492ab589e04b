"""The packed oneDNN LM head and layer linears compute what F.linear does, and are used exactly where they apply."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec import cpu_linear
from pagoda.exec.cpu_linear import PackedLinear, PackedLMHead, logits_fn, pack_linears
from pagoda.model.loader import cpu_has_bf16


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


def test_used_for_fp32_and_for_bf16_only_with_native_bf16(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(logits_fn(_Head(torch.randn(50, 8)), cpu), PackedLMHead)
    bf16 = _Head(torch.randn(50, 8, dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_linear, "_native_bf16", lambda: False)
    assert logits_fn(bf16, cpu) == bf16.compute_logits
    monkeypatch.setattr(cpu_linear, "_native_bf16", lambda: True)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert isinstance(logits_fn(bf16, cpu), PackedLMHead)
    else:  # told the CPU has native bf16 where oneDNN cannot pack bf16: the model's own head, no error
        assert logits_fn(bf16, cpu) == bf16.compute_logits
    fp16 = _Head(torch.randn(50, 8, dtype=torch.float16))
    assert logits_fn(fp16, cpu) == fp16.compute_logits
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
    assert pack_linears(Net(torch.bfloat16), cpu) == (2 if cpu_linear._native_bf16() else 0)
    monkeypatch.setenv("PAGODA_NO_ONEDNN", "1")
    assert pack_linears(Net(torch.float32), cpu) == 0
    assert pack_linears(Net(torch.bfloat16), cpu) == 0


def test_bf16_packing_follows_the_cpu_and_is_bitwise_where_it_applies(monkeypatch):
    """With native bf16 (AVX512-BF16 or AMX) oneDNN-packed bf16 linears and head equal F.linear bit for
    bit (both are oneDNN's bf16 GEMM with float32 accumulation; where the CPU has AVX512-BF16 our bf16
    GEMM takes them instead: tests/exec/test_cpu_gemm.py); without it bf16 keeps F.linear, which there
    is faster than oneDNN's emulation."""
    assert cpu_linear._native_bf16() == (cpu_has_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not cpu_linear._native_bf16():
        layer = torch.nn.Linear(96, 40).to(torch.bfloat16)
        assert not cpu_linear._onednn_usable(layer.weight, torch.device("cpu"))
        return
    monkeypatch.setattr(cpu_linear, "gemm_kernel", lambda: None)
    g = torch.Generator().manual_seed(5)
    for bias in (False, True):
        linear = torch.nn.Linear(576, 1728, bias=bias).to(torch.bfloat16)
        packed = PackedLinear(linear)
        assert packed.packed.is_mkldnn
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
            assert torch.equal(packed(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    weight = torch.randn(4000, 576, generator=g).to(torch.bfloat16)
    head = PackedLMHead(weight)
    hidden = torch.randn(2 * 64, 576, generator=g).to(torch.bfloat16)[::2]  # gathered rows, as the runner passes
    assert torch.equal(head(hidden), hidden @ weight.t())


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


def test_row_buckets_pad_little_and_stay_few():
    from pagoda.exec.cpu_linear import bucket_rows

    buckets = {bucket_rows(m) for m in range(1, 4097)}
    assert len(buckets) == 80
    for m in range(1, 4097):
        b = bucket_rows(m)
        assert m <= b <= m * 1.125 and bucket_rows(b) == b
    assert [bucket_rows(m) for m in (1, 16, 17, 100, 2048)] == [1, 16, 18, 104, 2048]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_give_the_unpadded_result(dtype):
    if dtype == torch.bfloat16 and not cpu_linear._native_bf16():
        pytest.skip("bf16 is packed only with native bf16 instructions")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=True).to(dtype)
    packed = PackedLinear(lin)
    x = torch.randn(3, 37, 64, dtype=dtype)  # 111 rows: padded to 112
    with torch.inference_mode():
        out = packed(x)
        assert out.shape == (3, 37, 96)
        rowwise = torch.cat([packed(x.reshape(-1, 64)[i : i + 16]) for i in range(0, 111, 16)])
    torch.testing.assert_close(out.reshape(-1, 96), rowwise, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:
        torch.testing.assert_close(out, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_many_row_counts_build_few_primitives():
    # oneDNN caches a primitive per input shape; a server's steps come in every row count. Without
    # the buckets, 200 row counts through one linear held ~100 MB more (cached primitives plus the
    # heap their churn fragments).
    from pagoda.exec.cpu_memory import heap_bytes

    if heap_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    packed = PackedLinear(torch.nn.Linear(576, 1536, bias=False))
    with torch.inference_mode():
        packed(torch.randn(8, 576))
        before = sum(heap_bytes())
        for m in range(17, 217):
            packed(torch.randn(m, 576))
        grown = sum(heap_bytes()) - before
    assert grown < 30 * 2**20, f"the heap grew {grown / 2**20:.0f} MiB over 200 row counts"
