"""The bf16 GEMM (exec/csrc/gemm_bf16.cpp) computes x @ w.T (+ bias) to one bf16 rounding of the
float32 sum for any row count and shape, its int8 form x @ q.T * scale the same way, and the packed
linears and head use it exactly where the CPU has AVX512-BF16 and oneDNN no AMX (or
PAGODA_BF16_GEMM=1 asks for it)."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec import cpu_linear
from pagoda.exec.cpu_linear import PackedLinear, PackedLMHead, gemm_kernel, pack_gemm

needs_gemm = pytest.mark.skipif(gemm_kernel() is None, reason="the CPU has no AVX512-BF16 (the bf16 GEMM is not used)")


def _assert_bf16_rounding_of_exact(y: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    # One bf16 rounding (half an ulp, 2^-9 relative) plus float32 summation error over k terms.
    bound = exact.abs() * 2.0**-8 + magnitude * k * 2.0**-23 + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all()


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    y = gemm_kernel().gemm_bf16(x, pack_gemm(w), bias, w.shape[0])
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact = exact + bias.double()
    _assert_bf16_rounding_of_exact(y, exact, x.double().abs() @ w.double().abs().t(), x.shape[1])


@needs_gemm
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 97, 300])
@pytest.mark.parametrize("n,k", [(1, 2), (5, 30), (64, 576), (961, 578), (130, 1536)])
def test_gemm_equals_exact_product_rounded(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    _check(x, w, None)
    _check(x, w, torch.randn(n, generator=g).to(torch.bfloat16))


@needs_gemm
def test_gemm_rows_do_not_depend_on_their_neighbours():
    """A row's result is the same whichever pass, chunk or task split carries it (a decode step and
    a prefill give a token the same logits)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=g).to(torch.bfloat16)
    packed = pack_gemm(torch.randn(200, 576, generator=g).to(torch.bfloat16))
    whole = gemm_kernel().gemm_bf16(x, packed, None, 200)
    for lo, hi in ((0, 1), (5, 9), (17, 113), (250, 300)):
        assert torch.equal(gemm_kernel().gemm_bf16(x[lo:hi], packed, None, 200), whole[lo:hi])


@needs_gemm
@pytest.mark.parametrize("rows", [1, 8, 64, 400])
def test_gemm_gives_the_same_bits_on_any_number_of_threads(rows):
    """Each thread takes a contiguous range of the tasks, the plan's count of which need not divide
    among them: every task must still run once, and a column's sum not depend on the thread."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    w = torch.randn(15 * 64 + 7, 576, generator=g).to(torch.bfloat16)  # 16 column blocks, the last partial
    packed, before = pack_gemm(w), torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.append(gemm_kernel().gemm_bf16(x, packed, None, w.shape[0]))
    finally:
        torch.set_num_threads(before)
    exact = x.double() @ w.double().t()
    _assert_bf16_rounding_of_exact(outs[0], exact, x.double().abs() @ w.double().abs().t(), x.shape[1])
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@needs_gemm
def test_gemm_reads_strided_rows_and_propagates_inf_and_nan():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(16, 100, generator=g).to(torch.bfloat16)[::2]  # gathered rows, as the LM head gets them
    w = torch.randn(70, 100, generator=g).to(torch.bfloat16)
    _check(x, w, None)
    x = x.contiguous()
    x[0, 3], x[1, 99] = float("nan"), float("inf")
    y = gemm_kernel().gemm_bf16(x, pack_gemm(w), None, 70).float()
    ref = x.float() @ w.float().t()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))


@needs_gemm
@pytest.mark.parametrize("rows", [1, 9, 64, 200])
@pytest.mark.parametrize("n,k", [(100, 64), (576, 1536)])
def test_gemm_over_int8_weights_equals_exact_scaled_product(rows, n, k):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    y = gemm_kernel().gemm_i8_bf16(x, pack_gemm(q), scale, bias, n)
    exact = (x.double() @ q.double().t()) * scale.double() + bias.double()
    magnitude = (x.double().abs() @ q.double().abs().t()) * scale.double()
    _assert_bf16_rounding_of_exact(y, exact, magnitude, k)


@needs_gemm
def test_gemm_refuses_what_it_cannot_compute():
    kernel = gemm_kernel()
    packed = pack_gemm(torch.zeros(70, 8, dtype=torch.bfloat16))
    for x, n in ((torch.zeros(1, 8), 70), (torch.zeros(1, 6, dtype=torch.bfloat16), 70),
                 (torch.zeros(1, 8, dtype=torch.bfloat16), 129), (torch.zeros(1, 8, dtype=torch.bfloat16), 64)):
        with pytest.raises(RuntimeError, match="gemm_bf16"):
            kernel.gemm_bf16(x, packed, None, n)
    with pytest.raises(RuntimeError, match="gemm_bf16"):  # bf16 weights handed to the int8 entry
        kernel.gemm_i8_bf16(torch.zeros(1, 8, dtype=torch.bfloat16), packed, torch.ones(70), None, 70)


@pytest.mark.usefixtures("our_bf16_gemm")  # the AMX policy is test_amx_leaves_bf16_linears_to_onednn's
def test_packed_linears_and_head_take_the_gemm_exactly_where_it_applies():
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(64, 40).to(torch.bfloat16)
    odd = torch.nn.Linear(63, 40).to(torch.bfloat16)  # K odd: no pairs of k, oneDNN keeps it
    fp32 = torch.nn.Linear(64, 40)
    assert not PackedLinear(fp32).gemm and PackedLinear(fp32).packed.is_mkldnn
    if not cpu_linear._native_bf16():
        return  # bf16 is not packed at all there (test_cpu_linear)
    packed, head = PackedLinear(linear), PackedLMHead(linear.weight)
    assert packed.gemm == head.gemm == (gemm_kernel() is not None)
    assert not PackedLinear(odd).gemm
    if packed.gemm:
        assert not packed.packed.is_mkldnn and not head.packed.is_mkldnn
        for rows in (1, 4, 5, 64):
            x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
            expected = gemm_kernel().gemm_bf16(x, pack_gemm(linear.weight), linear.bias, 40)
            assert torch.equal(packed(x), expected)
            assert torch.equal(head(x), gemm_kernel().gemm_bf16(x, pack_gemm(linear.weight), None, 40))
        assert packed(torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)).shape == (2, 3, 40)


def test_the_off_switch_gives_bf16_linears_back_to_onednn(monkeypatch):
    cpu_linear.gemm_kernel.cache_clear()
    monkeypatch.setenv("PAGODA_NO_BF16_GEMM", "1")
    try:
        assert gemm_kernel() is None
        if cpu_linear._native_bf16():
            assert PackedLinear(torch.nn.Linear(64, 40).to(torch.bfloat16)).packed.is_mkldnn
    finally:
        monkeypatch.delenv("PAGODA_NO_BF16_GEMM")
        cpu_linear.gemm_kernel.cache_clear()


@needs_gemm
@pytest.mark.parametrize("amx", [False, True])
def test_amx_leaves_bf16_linears_to_onednn(monkeypatch, amx):
    monkeypatch.setattr(cpu_linear, "cpu_has_amx", lambda: amx)
    weight = torch.nn.Linear(64, 40).to(torch.bfloat16).weight
    assert cpu_linear.gemm_applies(weight) is not amx
    assert PackedLinear(torch.nn.Linear(64, 40).to(torch.bfloat16)).packed.is_mkldnn is amx
    monkeypatch.setenv("PAGODA_BF16_GEMM", "1")
    assert cpu_linear.gemm_applies(weight)


@pytest.mark.parametrize(("flags", "limit", "amx"), [
    ("avx2 avx512_bf16 amx_bf16 amx_tile", None, True),
    ("avx2 avx512_bf16", None, False),
    ("avx2 avx512_bf16 amx_bf16 amx_tile", "AVX512_CORE_AMX", True),
    ("avx2 avx512_bf16 amx_bf16 amx_tile", "avx512_core_bf16", False),
    ("avx2 avx512_bf16 amx_bf16 amx_tile", "AVX2", False),
])
def test_amx_is_what_the_cpu_has_and_onednn_may_use(monkeypatch, flags, limit, amx):
    from pagoda.model import loader

    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    if limit is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert loader.cpu_has_amx() is amx


@needs_gemm
@pytest.mark.usefixtures("our_bf16_gemm")
def test_packing_keeps_one_copy_of_each_layer_weight():
    from pagoda.exec.cpu_linear import pack_linears

    model = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 32).to(torch.bfloat16))
    assert pack_linears(model, torch.device("cpu")) == 2
    for layer in model:
        assert layer.gemm and sorted(k for k, v in vars(layer).items() if isinstance(v, torch.Tensor)) == ["bias", "packed"]
        assert not list(layer.parameters())  # the unpacked weight is gone


@needs_gemm
def test_int8_weights_reordered_for_the_gemm_dequantize_as_before_and_multiply_exactly():
    from pagoda.exec.quant_linear import int8_gemm, to_tasks
    from pagoda.model.quantized import quantize_int8

    g = torch.Generator().manual_seed(11)
    weight = quantize_int8(torch.randn(100, 64, generator=g))
    tasks = to_tasks(weight)
    assert tasks.layout == "tasks" and torch.equal(tasks.dequantize(), weight.dequantize())
    x = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    exact = x.double() @ weight.dequantize().double().t()
    magnitude = x.double().abs() @ weight.dequantize().double().abs().t()
    _assert_bf16_rounding_of_exact(int8_gemm(x, tasks), exact, magnitude, 64)


@needs_gemm
def test_int8_layers_keep_their_rows_for_few_rows_while_memory_allows(monkeypatch):
    """Few rows take the integer path over the weight's rows (1.45x the GEMM's one-stream rate),
    more rows the GEMM over the task order; where the int8 weights exceed an eighth of the memory
    only the task order is kept, for every row count. (With the W8A8 GEMM off: where the CPU has
    VNNI it takes the place of the task order while memory allows, test_cpu_gemm_int8.py.)"""
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    from pagoda.exec import quant_linear
    from pagoda.exec.quant_linear import FUSED_ROWS, Int8Rows, install_quant_kernels, int8_gemm
    from pagoda.model.quantized import QuantLinear, quantize_int8

    def model():
        layer = QuantLinear(64, 100)
        layer.set_parts([quantize_int8(torch.randn(100, 64, generator=torch.Generator().manual_seed(2)))])
        return torch.nn.Sequential(torch.nn.LayerNorm(64).to(torch.bfloat16), layer)

    kept = model()
    install_quant_kernels(kept, torch.device("cpu"))
    layer = kept[1]
    assert isinstance(layer.kernel, Int8Rows) and layer.kernel.gemm is int8_gemm and layer.parts[0].layout == "rows"
    (copy,) = layer.kernel.copies.values()
    calls = []
    monkeypatch.setattr(quant_linear, "quant_matmul", lambda x, w: calls.append(("rows", x.shape[0])) or int8_gemm(x, copy))
    monkeypatch.setattr(layer.kernel, "gemm", lambda x, w: calls.append(("tasks", x.shape[0])) or torch.zeros(x.shape[0], 100, dtype=x.dtype))
    for rows in (1, FUSED_ROWS, FUSED_ROWS + 1):
        layer(torch.zeros(rows, 64, dtype=torch.bfloat16))
    assert calls == [("rows", 1), ("rows", FUSED_ROWS), ("tasks", FUSED_ROWS + 1)]
    monkeypatch.undo()
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    monkeypatch.setattr(quant_linear, "mem_total_bytes", lambda: 8 * 100 * 64 - 1)
    short = model()
    install_quant_kernels(short, torch.device("cpu"))
    assert short[1].kernel is int8_gemm and short[1].parts[0].layout == "tasks"
