"""Fixtures shared by the execution layer's kernel tests."""

from __future__ import annotations

import pytest

from pagoda.exec.quant_linear import load_quant_kernels


@pytest.fixture(scope="module")
def ops():
    """The quantized-matmul kernels (exec/csrc/quant_matmul.cpp), their instruction set reset after the module."""
    ops = load_quant_kernels()
    assert ops is not None, "the quantized matmul kernels must build here"
    yield ops
    ops.set_isa("auto")
