"""The bf16 GEMV kernel computes x @ w.T (+ bias) to bf16 rounding of the float32 sum, on any shape,
and the packed linears and head use it for a few rows exactly where the CPU has AVX512-BF16."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec import cpu_linear
from pagoda.exec.cpu_linear import GEMV_MAX_ROWS, PackedLinear, PackedLMHead, gemv_kernel

needs_gemv = pytest.mark.skipif(gemv_kernel() is None, reason="the CPU has no AVX512-BF16 (the GEMV is not used)")


def _assert_bf16_rounding_of_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact = exact + bias.double()
    # One bf16 rounding (half an ulp, 2^-9 relative) plus float32 summation error over K terms.
    magnitude = x.double().abs() @ w.double().abs().t()
    bound = exact.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-23 + 1e-30
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= bound).all()


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 31), (7, 33), (64, 576), (961, 577), (130, 1536)])
def test_gemv_equals_exact_product_rounded(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    _assert_bf16_rounding_of_exact(gemv_kernel().gemv_bf16(x, w, None), x, w)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    _assert_bf16_rounding_of_exact(gemv_kernel().gemv_bf16(x, w, bias), x, w, bias.float())


@needs_gemv
def test_gemv_reads_strided_rows_and_propagates_inf_and_nan():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 100, generator=g).to(torch.bfloat16)[::2]  # gathered rows, as the LM head gets them
    w = torch.randn(9, 100, generator=g).to(torch.bfloat16)
    _assert_bf16_rounding_of_exact(gemv_kernel().gemv_bf16(x, w, None), x, w)
    x = x.contiguous()
    x[0, 3], x[1, 99] = float("nan"), float("inf")
    y = gemv_kernel().gemv_bf16(x, w, None).float()
    ref = x.float() @ w.float().t()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))


def test_gemv_refuses_what_it_cannot_compute():
    kernel = gemv_kernel()
    if kernel is None:
        pytest.skip("the CPU has no AVX512-BF16 (the GEMV is not used)")
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    for x in (torch.zeros(GEMV_MAX_ROWS + 1, 8, dtype=torch.bfloat16), torch.zeros(1, 8), torch.zeros(1, 7, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="gemv_bf16"):
            kernel.gemv_bf16(x, w, None)


def test_few_rows_use_the_gemv_where_it_applies(monkeypatch):
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(64, 40).to(torch.bfloat16)
    if cpu_linear._native_bf16():
        packed = PackedLinear(linear)
        assert (packed.plain is not None) == (gemv_kernel() is not None)
        head = PackedLMHead(linear.weight)
        assert (head.plain is not None) == (gemv_kernel() is not None)
        if packed.plain is not None:
            calls = []
            real = gemv_kernel()

            class Spy:
                def gemv_bf16(self, *args):
                    calls.append(args[0].shape[0])
                    return real.gemv_bf16(*args)

            monkeypatch.setattr(cpu_linear, "gemv_kernel", lambda: Spy())
            for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64):
                x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
                _assert_bf16_rounding_of_exact(packed(x), x, linear.weight, linear.bias.float())
            assert calls == [1, GEMV_MAX_ROWS]


def test_fp32_and_the_off_switch_keep_onednn_for_every_row_count(monkeypatch):
    assert PackedLinear(torch.nn.Linear(64, 40)).plain is None
    cpu_linear.gemv_kernel.cache_clear()
    monkeypatch.setenv("PAGODA_NO_GEMV", "1")
    try:
        assert gemv_kernel() is None
    finally:
        monkeypatch.delenv("PAGODA_NO_GEMV")
        cpu_linear.gemv_kernel.cache_clear()


@needs_gemv
def test_layers_keep_their_plain_weights_only_while_they_are_small_beside_the_machine(monkeypatch):
    from pagoda.exec.cpu_linear import pack_linears

    def net():
        return torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 32).to(torch.bfloat16))

    weight_bytes = (64 * 64 + 64 * 32) * 2
    cpu = torch.device("cpu")
    for memory, kept in ((8 * weight_bytes, True), (8 * weight_bytes - 1, False)):
        monkeypatch.setattr(cpu_linear, "mem_total_bytes", lambda memory=memory: memory)
        model = net()
        assert pack_linears(model, cpu) == 2
        assert all((layer.plain is not None) == kept for layer in model)
