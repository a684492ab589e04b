"""The W8A8 GEMM (exec/csrc/gemm_int8.cpp): int8 weights times activations rounded to int8 per 32
values, the way the few-rows path (quant_dot.h) rounds them, for any row count and ragged shapes;
and the int8 layers of a float32 or bf16 model use it above the few rows where the CPU has VNNI.

The claims: the integer sums are exact, so against a float64 model of the same arithmetic (x rounded
as the kernel rounds it, times the dequantized weight) the result is within float32 summation over
the blocks (and one bf16 rounding for bf16); it equals the few-rows path within that same bound; a
row's result does not depend on the rows beside it (bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.exec import quant_linear
from pagoda.exec.quant_linear import FUSED_ROWS, Int8Rows, install_quant_kernels, int8_gemm, quant_matmul
from pagoda.exec.quant_linear import to_w8a8, w8a8_gemm, w8a8_kernel
from pagoda.model.quantized import QuantLinear, quantize_int8
from tests.exec.test_quant_dot import round_like_the_kernel

needs_w8a8 = pytest.mark.skipif(w8a8_kernel() is None, reason="the CPU has no AVX512-VNNI (the W8A8 GEMM is not used)")
EPS32 = 2.0**-23


def _model_of(x: torch.Tensor, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's arithmetic in float64, a float32 summation bound for it)."""
    xhat, _ = round_like_the_kernel(x.float())
    w = weight.dequantize().double()
    exact = torch.from_numpy(xhat) @ w.t()
    magnitude = torch.from_numpy(np.abs(xhat)) @ w.abs().t()
    return exact, magnitude * (x.shape[1] // 32 + 4) * EPS32


def _assert_close_to_model(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8  # one rounding to bf16
    assert y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound + 1e-30).all()


@needs_w8a8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 97, 300])
@pytest.mark.parametrize("n,k", [(1, 32), (64, 96), (100, 576), (130, 1536)])
def test_w8a8_is_the_rounded_activations_times_the_weight(dtype, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = w8a8_gemm(x, to_w8a8(weight))
    assert y.dtype == dtype
    _assert_close_to_model(y, *_model_of(x, weight))


@needs_w8a8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_equals_the_few_rows_path_within_float_rounding(dtype):
    """A prompt's rows (the GEMM) and a decode step's (the few-rows path) see the same int8 activations."""
    g = torch.Generator().manual_seed(5)
    weight = quantize_int8(torch.randn(200, 576, generator=g))
    x = torch.randn(40, 576, generator=g).to(dtype)
    y = w8a8_gemm(x, to_w8a8(weight)).double()
    few = torch.cat([quant_matmul(x[i:i + FUSED_ROWS], weight) for i in range(0, 40, FUSED_ROWS)]).double()
    _, bound = _model_of(x, weight)
    if dtype == torch.bfloat16:
        bound = bound * 2 + few.abs() * 2.0**-7  # each side rounded to bf16 once
    assert ((y - few).abs() <= bound).all()


@needs_w8a8
def test_w8a8_rows_do_not_depend_on_their_neighbours():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=g).to(torch.bfloat16)
    packed = to_w8a8(quantize_int8(torch.randn(200, 576, generator=g)))
    whole = w8a8_gemm(x, packed)
    for lo, hi in ((0, 1), (5, 9), (17, 113), (250, 300)):
        assert torch.equal(w8a8_gemm(x[lo:hi], packed), whole[lo:hi])


@needs_w8a8
def test_w8a8_adds_the_bias_reads_strided_rows_and_spreads_non_finite_blocks_to_their_row_only():
    ops = w8a8_kernel()
    g = torch.Generator().manual_seed(9)
    weight = quantize_int8(torch.randn(70, 128, generator=g))
    packed = to_w8a8(weight)
    x = torch.randn(24, 128, generator=g)
    bias = torch.randn(70, generator=g)
    plain = ops.gemm_int8(x, packed.data, weight.scale, None, 70)
    assert torch.allclose(ops.gemm_int8(x, packed.data, weight.scale, bias, 70), plain + bias, rtol=0, atol=1e-5)
    assert torch.equal(w8a8_gemm(x[::2], packed), plain[::2])  # gathered rows, as the LM head gets them
    bad = x.clone()
    bad[3, 40], bad[11, 100] = float("inf"), float("nan")
    y = w8a8_gemm(bad, packed)
    assert y[3].isnan().all() and y[11].isnan().all()
    rest = [i for i in range(24) if i not in (3, 11)]
    assert torch.equal(y[rest], plain[rest])


@needs_w8a8
def test_w8a8_refuses_what_it_cannot_multiply():
    ops = w8a8_kernel()
    weight = quantize_int8(torch.randn(64, 64))
    packed = to_w8a8(weight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gemm_int8(torch.randn(2, 48), packed.data[:, :12].contiguous(), weight.scale, None, 64)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        ops.gemm_int8(torch.randn(2, 64).half(), packed.data, weight.scale, None, 64)
    with pytest.raises(RuntimeError, match="columns"):
        ops.gemm_int8(torch.randn(2, 96), packed.data, weight.scale, None, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops.gemm_int8(torch.randn(2, 64), packed.data, weight.scale, None, 65)


def test_the_w8a8_order_dequantizes_as_before():
    weight = quantize_int8(torch.randn(100, 96, generator=torch.Generator().manual_seed(1)))
    packed = to_w8a8(weight)
    assert packed.layout == "w8a8" and packed.data.shape == (2, 24, 4, 16, 4)
    assert torch.equal(packed.dequantize(), weight.dequantize())


def _model(dtype: torch.dtype, k: int = 64):
    layer = QuantLinear(k, 100)
    layer.set_parts([quantize_int8(torch.randn(100, k, generator=torch.Generator().manual_seed(2)))])
    return torch.nn.Sequential(torch.nn.LayerNorm(k).to(dtype), layer)


@needs_w8a8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layers_take_w8a8_above_the_few_rows_while_memory_allows(monkeypatch, dtype):
    """Few rows on the weight's rows (one stream decodes ~1.15x faster there), more on the W8A8 GEMM;
    where a second copy would exceed an eighth of the memory, the W8A8 order alone, every row count."""
    net = _model(dtype)
    install_quant_kernels(net, torch.device("cpu"))
    layer = net[1]
    assert isinstance(layer.kernel, Int8Rows) and layer.kernel.gemm is w8a8_gemm
    (copy,) = layer.kernel.copies.values()
    assert copy.layout == "w8a8" and layer.parts[0].layout == "rows"
    calls = []
    monkeypatch.setattr(quant_linear, "quant_matmul", lambda x, w: calls.append(("rows", x.shape[0])) or w8a8_gemm(x, copy))
    monkeypatch.setattr(layer.kernel, "gemm", lambda x, w: calls.append(("w8a8", x.shape[0])) or w8a8_gemm(x, w))
    for rows in (1, FUSED_ROWS, FUSED_ROWS + 1):
        assert layer(torch.zeros(rows, 64, dtype=dtype)).dtype == dtype
    assert calls == [("rows", 1), ("rows", FUSED_ROWS), ("w8a8", FUSED_ROWS + 1)]
    monkeypatch.undo()
    monkeypatch.setattr(quant_linear, "mem_total_bytes", lambda: 8 * 100 * 64 - 1)
    short = _model(dtype)
    rows = short[1].parts[0]
    install_quant_kernels(short, torch.device("cpu"))
    layer = short[1]
    assert layer.kernel is w8a8_gemm and len(layer.parts) == 1 and layer.parts[0].layout == "w8a8"
    assert torch.equal(layer.parts[0].dequantize(), rows.dequantize())
    x = torch.randn(FUSED_ROWS + 3, 64).to(dtype)
    for n in (1, FUSED_ROWS, FUSED_ROWS + 3):
        assert torch.equal(layer(x[:n]), w8a8_gemm(x[:n], layer.parts[0]))


@needs_w8a8
def test_w8a8_is_off_where_switched_off_or_k_is_not_a_multiple_of_32(monkeypatch):
    odd = _model(torch.float32, k=48)
    install_quant_kernels(odd, torch.device("cpu"))
    assert odd[1].kernel is quant_matmul
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    off = _model(torch.float32)
    install_quant_kernels(off, torch.device("cpu"))
    assert off[1].kernel is quant_matmul
    off16 = _model(torch.bfloat16)
    install_quant_kernels(off16, torch.device("cpu"))
    if quant_linear.gemm_kernel() is not None:  # the bf16 GEMM over the task order, as before
        assert isinstance(off16[1].kernel, Int8Rows) and off16[1].kernel.gemm is int8_gemm
