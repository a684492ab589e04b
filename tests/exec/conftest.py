"""Fixtures shared by the execution layer's kernel tests."""

from __future__ import annotations

import pytest

from pagoda.exec.quant_linear import load_quant_kernels


@pytest.fixture
def our_bf16_gemm(monkeypatch):
    """Tests of our bf16 GEMM's paths ask for it: a CPU whose oneDNN has AMX leaves bf16 linears to
    oneDNN otherwise (cpu_linear.gemm_applies)."""
    monkeypatch.setenv("PAGODA_BF16_GEMM", "1")


@pytest.fixture(scope="module")
def ops():
    """The quantized-matmul kernels (exec/csrc/quant_matmul.cpp), their instruction set reset after the module."""
    ops = load_quant_kernels()
    assert ops is not None, "the quantized matmul kernels must build here"
    yield ops
    ops.set_isa("auto")
