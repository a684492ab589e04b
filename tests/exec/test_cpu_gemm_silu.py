"""SiLU-and-multiply in the bf16 GEMM's epilogue (exec/csrc/gemm_bf16.cpp gemm_bf16_silu): an MLP's
gate_up packed in gate/up pairs gives silu(gate) * up with the very bits of the GEMM's [gate | up]
followed by layer_ops' silu_and_mul, and pack_linears pairs exactly the dense MLPs' gate_up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda.exec.cpu_linear import PackedLinear, gemm_kernel, pack_gemm, pack_linears, pair_gate_up
from pagoda.model.layers import silu_and_mul
from pagoda.model.llama import LlamaMLP

needs_gemm = pytest.mark.skipif(gemm_kernel() is None, reason="the CPU has no AVX512-BF16 (the bf16 GEMM is not used)")
pytestmark = pytest.mark.usefixtures("our_bf16_gemm")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaNs compared by their bits too


def _separate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The unfused path: the GEMM's [gate | up] in bf16, then silu_and_mul."""
    return silu_and_mul(gemm_kernel().gemm_bf16(x, pack_gemm(w), None, w.shape[0]))


@needs_gemm
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 130])
@pytest.mark.parametrize("inter,k", [(32, 64), (40, 64), (100, 96), (1536, 576)])
def test_fused_silu_gives_the_bits_of_the_gemm_then_silu_and_mul(rows, inter, k):
    g = torch.Generator().manual_seed(rows * 7 + inter + k)
    x = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(2 * inter, k, generator=g).to(torch.bfloat16)
    got = gemm_kernel().gemm_bf16_silu(x, pack_gemm(pair_gate_up(w)), inter)
    assert got.shape == (rows, inter) and torch.equal(_bits(got), _bits(_separate(x, w)))


@needs_gemm
def test_fused_silu_keeps_inf_and_nan_where_the_separate_ops_put_them():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(2 * 48, 64, generator=g).to(torch.bfloat16)
    x[0, 3], x[1, 10], x[2, 0] = float("nan"), float("inf"), float("-inf")
    w[5] = 1e30  # gate column 5 overflows to +-inf in some rows, so silu sees inf and -inf
    got = gemm_kernel().gemm_bf16_silu(x, pack_gemm(pair_gate_up(w)), 48)
    want = _separate(x, w)
    assert torch.isnan(want).any() and torch.isinf(want).any()
    assert torch.equal(_bits(got), _bits(want))


@needs_gemm
def test_fused_silu_gives_the_same_bits_on_any_number_of_threads():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    packed = pack_gemm(pair_gate_up(torch.randn(2 * 1000, 576, generator=g).to(torch.bfloat16)))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(gemm_kernel().gemm_bf16_silu(x, packed, 1000))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@needs_gemm
def test_a_paired_linear_still_gives_gate_then_up():
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(64, 2 * 40, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    plain, paired = PackedLinear(linear), PackedLinear(linear, gate_up=True)
    assert paired.fuses_silu and not plain.fuses_silu
    assert torch.equal(paired(x), plain(x))
    assert torch.equal(paired.silu_and_mul(x), silu_and_mul(plain(x)))
    with pytest.raises(RuntimeError, match="n does not match"):
        gemm_kernel().gemm_bf16_silu(x[0], paired.paired, 80)  # n counts the activation's columns, 40


def _mlp(bias: bool) -> LlamaMLP:
    config = SimpleNamespace(hidden_size=64, intermediate_size=72, num_attention_heads=4, num_key_value_heads=2,
                             mlp_bias=bias)
    torch.manual_seed(0)
    return LlamaMLP(config).to(torch.bfloat16)


@needs_gemm
def test_pack_linears_pairs_a_dense_mlps_gate_up_and_keeps_its_output():
    mlp, x = _mlp(bias=False), torch.randn(9, 64).to(torch.bfloat16)
    unfused = _mlp(bias=False)
    unfused.gate_up_proj, unfused.down_proj = PackedLinear(mlp.gate_up_proj), PackedLinear(mlp.down_proj)
    assert pack_linears(mlp, torch.device("cpu")) == 2
    assert mlp.gate_up_proj.fuses_silu and not mlp.down_proj.fuses_silu
    assert torch.equal(mlp(x), unfused(x))


@needs_gemm
def test_a_gate_up_with_a_bias_or_outside_an_mlp_is_not_paired():
    biased = _mlp(bias=True)
    pack_linears(biased, torch.device("cpu"))
    assert biased.gate_up_proj.gemm and not biased.gate_up_proj.fuses_silu
    other = torch.nn.Module()
    other.gate_up_proj = torch.nn.Linear(64, 80, bias=False).to(torch.bfloat16)
    pack_linears(other, torch.device("cpu"))
    assert not other.gate_up_proj.fuses_silu


@needs_gemm
def test_a_weight_update_between_paired_and_unpaired_gate_up_is_refused_by_name():
    """An unpaired gate_up copied into a paired one (the same shape for SmolLM2) would put gate
    values in up columns, so the two go by different names."""
    from pagoda.exec.weight_tensors import check_same_layout, weight_tensors

    paired, plain = _mlp(bias=False), _mlp(bias=False)
    pack_linears(paired, torch.device("cpu"))
    plain.gate_up_proj, plain.down_proj = PackedLinear(plain.gate_up_proj), PackedLinear(plain.down_proj)
    check_same_layout(weight_tensors(paired), weight_tensors(paired), "same")
    with pytest.raises(ValueError, match="gate_up_proj.paired"):
        check_same_layout(weight_tensors(paired), weight_tensors(plain), "unpaired")
