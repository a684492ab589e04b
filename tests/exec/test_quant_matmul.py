"""The quantized matmul kernels (exec/csrc/quant_matmul.cpp) against gguf-py: every GGUF type and
int8, every instruction-set path this CPU has (AVX-512, AVX2, scalar), the fused few-rows path and
the tiled GEMM path, on ragged shapes (C10).

The reference is `gguf.quants.dequantize` followed by a float64 matmul; the kernels accumulate in
float32 (in another order than any reference), so the bound is float32 rounding: relative to the
sum of |x| |w| over the row, a few units of float32 epsilon times the row length. Q8_0, Q4_0 and
Q4_1 weights are made with `gguf.quants.quantize`; gguf-py cannot quantize the K types (it only
dequantizes them), so their blocks are random bytes with sane fp16 scales: every bit pattern of
their quants is a valid block.

The paths here are the float ones (`ISAS`); the few-rows integer paths, the default where the CPU
runs them, are tests/exec/test_quant_dot.py's, and the tests below that go through "auto" hold
them to the int8 rounding of the activations instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.cpp_build import cpu_flags
from pagoda.exec.quant_linear import TILE_ROWS
from pagoda.model.quantized import GGUF_KERNEL_TYPES, QuantizedTensor, quantize_int8
from tests.exec.matmul_bounds import assert_within_fp32_rounding

gguf = pytest.importorskip("gguf")

FLAGS = set(cpu_flags().split())
ISAS = ["scalar"] + (["avx2"] if {"avx2", "fma", "f16c"} <= FLAGS else []) + (
    ["avx512"] if {"avx512f", "avx512bw", "avx512vl"} <= FLAGS else [])


def make_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, cols // block, 2)) * 0.02).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        raw[:, :, 208:210] = scales[:, :, :2]  # d, at the block's end
    else:
        raw[:, :, 0:4] = scales  # d and dmin, at the block's start
    return raw.reshape(rows, -1)


def reference(name: str, blocks: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(rows, cols)


def assert_within_int8_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float = 0.0) -> None:
    """The bound of the few-rows integer path, the default where the CPU has AVX2 or AVX512-VNNI
    (exec/csrc/quant_dot.h): each activation moves by at most its 32-block's |x|max / 254, plus
    float32 rounding, plus `rtol` of the result (one bf16 rounding of the output)."""
    half_step = (x.abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    exact = x.double() @ w.double().t()
    magnitude = x.abs().double() @ w.abs().double().t()
    bound = (half_step.reshape(x.shape).double() @ w.abs().double().t() + rtol * exact.abs()
             + 8 * x.shape[1] * torch.finfo(torch.float32).eps * magnitude + 1e-30)
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"error above the int8 rounding by {excess}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", list(GGUF_KERNEL_TYPES))
def test_gguf_kernels_equal_dequantize_then_matmul(ops, isa, name):
    """Random ragged shapes: odd row counts, several blocks per row, 1..8 rows fused and more tiled."""
    ops.set_isa(isa)
    rng = np.random.default_rng(hash((isa, name)) % 2**32)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]
    for rows, nblocks in ((1, 1), (37, 3), (TILE_ROWS + 13, 2)):
        cols = block * nblocks
        blocks = make_blocks(name, rows, cols, rng)
        w = reference(name, blocks, rows, cols)
        data = torch.from_numpy(np.ascontiguousarray(blocks))
        tid = GGUF_KERNEL_TYPES[name]
        assert torch.equal(ops.dequantize_rows(data, tid, cols, None, 0, rows), w)
        for m in (1, 2, 5, 8, 9, 33):
            x = torch.randn(m, cols, dtype=torch.float32)
            assert_within_fp32_rounding(ops.quant_matmul(x, data, tid, None, TILE_ROWS), x, w)
        ids = torch.tensor([rows - 1, 0, rows // 2, 0])
        assert torch.equal(ops.gather_rows(data, tid, cols, None, ids), w[ids])


@pytest.mark.parametrize("isa", ISAS)
def test_int8_kernel_equals_scaled_matmul(ops, isa):
    ops.set_isa(isa)
    torch.manual_seed(0)
    weight = torch.randn(51, 96) * torch.linspace(0.01, 3, 51)[:, None]  # rows of very different sizes
    q = quantize_int8(weight)
    w = q.data.view(torch.int8).float() * q.scale[:, None]
    # Rounding to the nearest int8 step: no weight moves by more than half its row's step.
    assert ((w - weight).abs() <= q.scale[:, None] / 2 + 1e-6).all()
    assert torch.equal(q.dequantize(), w)
    for m in (1, 4, 8, 20):
        x = torch.randn(m, 96)
        assert_within_fp32_rounding(ops.quant_matmul(x, q.data, q.type_id, q.scale, TILE_ROWS), x, w)


def test_bf16_activations_take_the_gemm_path_in_bf16(ops):
    """bf16 activations: the fused path computes in float32 and rounds once (by default in integers,
    within the int8 rounding, then the one bf16 rounding); the tiled path's GEMM is bf16 over
    bf16-rounded weights, so it is compared with that."""
    rng = np.random.default_rng(1)
    blocks = make_blocks("Q4_1", 70, 64, rng)
    w = reference("Q4_1", blocks, 70, 64)
    data = torch.from_numpy(blocks)
    x = torch.randn(3, 64).bfloat16()
    ops.set_isa(ISAS[-1])  # the float path
    got = ops.quant_matmul(x, data, GGUF_KERNEL_TYPES["Q4_1"], None, TILE_ROWS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ w.t(), rtol=2**-8, atol=1e-3)  # one bf16 rounding
    ops.set_isa("auto")
    got = ops.quant_matmul(x, data, GGUF_KERNEL_TYPES["Q4_1"], None, TILE_ROWS)
    assert got.dtype == torch.bfloat16
    assert_within_int8_rounding(got, x.float(), w, rtol=2**-8)
    x = torch.randn(40, 64).bfloat16()
    got = ops.quant_matmul(x, data, GGUF_KERNEL_TYPES["Q4_1"], None, TILE_ROWS)
    torch.testing.assert_close(got, x @ w.bfloat16().t(), rtol=2e-2, atol=2e-2)


def test_malformed_weights_are_refused(ops):
    data = torch.zeros(4, 20, dtype=torch.uint8)  # Q4_1: 20 bytes hold one block of 32
    with pytest.raises(RuntimeError, match="a row of 64 weights takes 40 bytes"):
        ops.quant_matmul(torch.randn(1, 64), data, GGUF_KERNEL_TYPES["Q4_1"], None, TILE_ROWS)
    with pytest.raises(RuntimeError, match="unsupported quantization type id 6"):
        ops.quant_matmul(torch.randn(1, 32), data, 6, None, TILE_ROWS)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gather_rows(data, GGUF_KERNEL_TYPES["Q4_1"], 32, None, torch.tensor([4]))


def test_quantized_tensor_reference_matches_the_kernel(ops):
    """The model layer's fallback (no C++ build) and the kernel agree: within float32 rounding on
    the float path, within the int8 rounding on the default integer path."""
    from pagoda.model.quantized import reference_matmul

    blocks = make_blocks("Q8_0", 9, 64, np.random.default_rng(2))
    q = QuantizedTensor("Q8_0", 9, 64, torch.from_numpy(blocks))
    x = torch.randn(2, 64)
    ops.set_isa(ISAS[-1])
    torch.testing.assert_close(reference_matmul(x, q), ops.quant_matmul(x, q.data, q.type_id, None, TILE_ROWS))
    ops.set_isa("auto")
    assert_within_int8_rounding(ops.quant_matmul(x, q.data, q.type_id, None, TILE_ROWS), x, q.dequantize())


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "int8"])
def test_layer_matmul_many_rows_and_tiles(ops, name, monkeypatch):
    """The layers' entry point: the fused kernel for few rows, oneDNN over the dequantized weight for
    more, also when the weight goes in tiles. Few rows of Q4_1 and int8 take the default integer
    path, whose bound is the int8 rounding of the activations (loosened from float32 rounding when
    that path became the default); Q6_K and many rows stay within float32 rounding."""
    from pagoda.exec import quant_linear

    ops.set_isa("auto")
    rng = np.random.default_rng(3)
    if name == "int8":
        q = quantize_int8(torch.randn(301, 512))
        w = q.dequantize()
    else:
        blocks = make_blocks(name, 301, 512, rng)
        q = QuantizedTensor(name, 301, 512, torch.from_numpy(blocks))
        w = reference(name, blocks, 301, 512)
    for tile_bytes in (32 << 20, 100 * 512 * 4):  # whole; three tiles of 100 rows and one of 1
        monkeypatch.setattr(quant_linear, "_GEMM_TILE_BYTES", tile_bytes)
        for m in (1, 8, 9, 50):
            x = torch.randn(m, 512)
            if m <= quant_linear.FUSED_ROWS and name != "Q6_K":
                assert_within_int8_rounding(quant_linear.quant_matmul(x, q), x, w)
            else:
                assert_within_fp32_rounding(quant_linear.quant_matmul(x, q), x, w)
