"""The integer dot products of the few-rows quantized matmul (exec/csrc/quant_dot.h): activations
rounded to int8 per 32-block, each weight block's dot product in integers (AVX512-VNNI, AVX2).

Two bounds, on ragged shapes (odd N, one to many blocks per row, M = 1..8) and inf/NaN-free data:
- against a numpy model of the same arithmetic (x rounded as the kernel rounds it, then a float64
  matmul with the dequantized weight): within float32 rounding, so the integer sums are exact;
- against the float path (the dequantized weight times the unrounded x): within the int8 rounding,
  sum over blocks of (|x|max / 127 / 2) * sum |w|, and outside float32 rounding somewhere (the
  integer path really ran).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.cpp_build import cpu_flags
from pagoda.exec.quant_linear import TILE_ROWS
from pagoda.model.quantized import GGUF_KERNEL_TYPES, quantize_int8
from tests.exec.test_quant_matmul import make_blocks, reference

gguf = pytest.importorskip("gguf")

FLAGS = set(cpu_flags().split())
INT_ISAS = (["avx2_int8"] if {"avx2", "fma", "f16c"} <= FLAGS else []) + (
    ["avx512_vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS else [])
FLOAT_OF = {"avx2_int8": "avx2", "avx512_vnni": "avx512"}
INT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "int8"]
EPS32 = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.skipif(not INT_ISAS, reason="this CPU has neither AVX2 nor AVX512-VNNI")


def round_like_the_kernel(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] as the kernel holds it: (x^ = d * q in float64, the per-element bound d / 2)."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    xhat = (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)
    half_step = np.broadcast_to(d.astype(np.float64) / 2, xb.shape).reshape(x.shape)
    return xhat, half_step


def weights(name: str, rows: int, cols: int, rng: np.random.Generator):
    """(packed bytes, type id, per-row scale or None, the dequantized float weight)."""
    if name == "int8":
        q = quantize_int8(torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)))
        return q.data, q.type_id, q.scale, q.dequantize()
    blocks = make_blocks(name, rows, cols, rng)
    return torch.from_numpy(np.ascontiguousarray(blocks)), GGUF_KERNEL_TYPES[name], None, reference(name, blocks, rows, cols)


@pytest.mark.parametrize("isa", INT_ISAS)
@pytest.mark.parametrize("name", INT_TYPES)
def test_integer_dots_equal_the_int8_model_and_stay_within_its_rounding(ops, isa, name):
    rng = np.random.default_rng(abs(hash((isa, name))) % 2**32)
    seen_rounding = False
    for rows, nblocks in ((1, 1), (37, 3), (301, 18), (7, 48)):  # 48 blocks: SmolLM2's 1536-wide down_proj
        cols = 32 * nblocks
        data, tid, scale, w = weights(name, rows, cols, rng)
        w64 = w.double().numpy()
        for m in range(1, 9):
            # Rows of very different sizes, and a block of zeros (its scale is 0).
            x = torch.randn(m, cols) * torch.logspace(-3, 2, m)[:, None]
            x[0, :32] = 0
            ops.set_isa(isa)
            got = ops.quant_matmul(x, data, tid, scale, TILE_ROWS).double().numpy()
            xhat, half_step = round_like_the_kernel(x)
            exact = xhat @ w64.T
            fp32 = 4 * cols * EPS32 * (np.abs(xhat) @ np.abs(w64).T) + 1e-30
            excess = (np.abs(got - exact) - fp32).max()
            assert excess <= 0, f"{name} {rows}x{cols} M={m}: off the int8 model by {excess} beyond float32 rounding"
            # Against the float path on the unrounded x: the int8 rounding bounds the difference.
            ops.set_isa(FLOAT_OF[isa])
            want = ops.quant_matmul(x, data, tid, scale, TILE_ROWS).double().numpy()
            x64 = x.double().numpy()
            magnitude = np.abs(x64) @ np.abs(w64).T
            bound = half_step @ np.abs(w64).T + 8 * cols * EPS32 * magnitude + 1e-30
            excess = (np.abs(got - want) - bound).max()
            assert excess <= 0, f"{name} {rows}x{cols} M={m}: off the float path by {excess} beyond the int8 rounding"
            seen_rounding |= bool((np.abs(got - want) > 4 * cols * EPS32 * magnitude).any())
    assert seen_rounding, "the integer path gave the float path's results: it did not run"


@pytest.mark.parametrize("isa", INT_ISAS)
def test_other_types_keep_the_float_path(ops, isa):
    """Q4_K, Q5_K and Q6_K have no integer kernel: under an integer path they give the float
    path's results bit for bit; so does the many-rows path (prefill) of every type."""
    rng = np.random.default_rng(7)
    for name in ("Q4_K", "Q5_K", "Q6_K", "Q4_1"):
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]
        data, tid, scale, _ = weights(name, 21, 2 * block, rng)
        for m in ((1, 8, 9, 40) if name.endswith("_K") else (9, 40)):
            x = torch.randn(m, 2 * block)
            ops.set_isa(isa)
            got = ops.quant_matmul(x, data, tid, scale, TILE_ROWS)
            ops.set_isa(FLOAT_OF[isa])
            assert torch.equal(got, ops.quant_matmul(x, data, tid, scale, TILE_ROWS)), (name, m)


@pytest.mark.parametrize("isa", INT_ISAS)
def test_non_finite_activations_give_nan_not_a_finite_lie(ops, isa):
    ops.set_isa(isa)
    data, tid, scale, _ = weights("Q4_1", 5, 64, np.random.default_rng(3))
    x = torch.randn(3, 64)
    x[1, 40] = float("inf")
    x[2, 3] = float("nan")
    got = ops.quant_matmul(x, data, tid, scale, TILE_ROWS)
    assert torch.isfinite(got[0]).all()
    assert torch.isnan(got[1:]).all()


def test_auto_picks_the_integer_path_and_names_are_checked(ops):
    ops.set_isa("auto")
    assert ops.isa() == INT_ISAS[-1]
    for name in ("scalar", *INT_ISAS, *(FLOAT_OF[i] for i in INT_ISAS)):
        ops.set_isa(name)
        assert ops.isa() == name
    with pytest.raises(RuntimeError, match="auto, avx512_vnni, avx2_int8, avx512, avx2 or scalar; got vnni"):
        ops.set_isa("vnni")
    if "avx512_vnni" not in INT_ISAS:
        with pytest.raises(RuntimeError, match="this CPU cannot run avx512_vnni"):
            ops.set_isa("avx512_vnni")
    ops.set_isa("auto")


def test_pagoda_quant_isa_picks_the_path_of_a_fresh_process():
    """PAGODA_QUANT_ISA, read when the kernels load, names the float paths and the integer ones."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = "from pagoda.exec.quant_linear import load_quant_kernels; print(load_quant_kernels().isa())"
    for name in (None, FLOAT_OF[INT_ISAS[-1]], INT_ISAS[0]):
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_QUANT_ISA"}
        env["PYTHONPATH"] = str(root)
        if name:
            env["PAGODA_QUANT_ISA"] = name
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == (name or INT_ISAS[-1])
