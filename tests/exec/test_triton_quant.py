"""The GPU kernels for quantized weights (pagoda/exec/triton_quant.py) against gguf-py and the fp32
matmul: every GGUF type with a kernel and int8, the fused few-rows kernel and the dequantize-for-
cuBLAS path, ragged shapes; and fp8 weights through torch._scaled_mm. Without a GPU the Triton
kernels run under the interpreter (set up as for the attention kernels, test_triton_kernels.py)
and `_scaled_mm` on the CPU; on CUDA compiled (benchmarks/gpu_check.sh runs this file).

The bound is the CPU kernels' (test_quant_matmul.py): float32 rounding relative to sum |x| |w|,
the reference being `gguf.quants.dequantize` followed by a float64 matmul.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch

from tests.exec import test_triton_kernels as triton_setup  # noqa: F401  (TRITON_INTERPRET before triton)

if "pagoda.exec.triton_quant" in sys.modules and not triton_setup.ON_CUDA:
    importlib.reload(sys.modules["pagoda.exec.triton_quant"])

from pagoda.exec import triton_quant as tq  # noqa: E402
from pagoda.exec.quant_linear import move_quantized  # noqa: E402
from pagoda.model.quantized import (  # noqa: E402
    GGUF_KERNEL_TYPES, QuantEmbedding, QuantizedTensor, QuantLinear, quantize_fp8, quantize_int8,
)
from tests.exec.matmul_bounds import assert_within_fp32_rounding  # noqa: E402

DEVICE = triton_setup.DEVICE


def _gguf_weight(name: str, rows: int, cols: int, seed: int = 0) -> tuple[QuantizedTensor, torch.Tensor]:
    """Blocks and their gguf-py dequantization (test_quant_matmul.make_blocks). gguf is asked for
    here, not at import: the GPU image lacks it, and the int8 and fp8 tests still run there."""
    pytest.importorskip("gguf")
    from tests.exec.test_quant_matmul import make_blocks, reference

    blocks = make_blocks(name, rows, cols, np.random.default_rng(seed))
    data = torch.from_numpy(np.ascontiguousarray(blocks)).to(DEVICE)
    return QuantizedTensor(name, rows, cols, data), reference(name, blocks, rows, cols)


def _int8_weight(rows: int, cols: int, seed: int = 0) -> tuple[QuantizedTensor, torch.Tensor]:
    w = quantize_int8(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))
    on = QuantizedTensor("int8", rows, cols, w.data.to(DEVICE), w.scale.to(DEVICE))
    return on, w.dequantize()


def _x(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


# K a multiple of each format's block (32, or 256 for the K types), N ragged against _BLOCK_N.
@pytest.mark.parametrize("name", sorted(GGUF_KERNEL_TYPES))
@pytest.mark.parametrize("m", [1, 5])
def test_fused_kernel_equals_gguf_dequantize_then_matmul(name, m):
    cols = 512 if name.endswith("_K") else 96
    weight, want_w = _gguf_weight(name, 70, cols)
    x = _x(m, cols)
    got = tq.fused_matmul(x.to(DEVICE), weight).cpu()
    assert_within_fp32_rounding(got, x, want_w)


@pytest.mark.parametrize("cols", [40, 77])  # int8 rows: any K, masked tails of a K tile
def test_fused_kernel_int8_rows_with_ragged_k(cols):
    weight, want_w = _int8_weight(67, cols)
    x = _x(3, cols)
    assert_within_fp32_rounding(tq.fused_matmul(x.to(DEVICE), weight).cpu(), x, want_w)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K", "int8"])
def test_many_rows_take_dequantized_tiles(name, monkeypatch):
    """Above FUSED_ROWS the weight is dequantized (here in several tiles) for torch's matmul."""
    cols = 256
    weight, want_w = _int8_weight(50, cols) if name == "int8" else _gguf_weight(name, 50, cols)
    monkeypatch.setattr(tq, "FUSED_ROWS", 2)
    monkeypatch.setattr(tq, "_TILE_BYTES", 4 * cols * 16)  # 16 rows a tile: 4 tiles, the last short
    calls = []
    monkeypatch.setattr(tq, "fused_matmul", lambda *a: calls.append(a))
    x = _x(7, cols)
    got = tq.quant_matmul(x.to(DEVICE), weight).cpu()
    assert not calls
    assert_within_fp32_rounding(got, x, want_w)


@pytest.mark.parametrize("name", ["Q8_0", "Q5_K", "int8"])
def test_dequantize_rows_picks_the_rows_asked(name):
    cols = 256
    weight, want_w = _int8_weight(30, cols) if name == "int8" else _gguf_weight(name, 30, cols)
    ids = torch.tensor([29, 0, 7, 7])
    got = tq.dequantize_rows(weight, ids.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want_w[ids], atol=0, rtol=1e-6)
    assert tq.dequantize_rows(weight, ids[:0].to(DEVICE)).shape == (0, cols)


# Triton 3.6's interpreter multiplies bf16 tiles wrongly in tl.dot (fp16 ones right): bf16 on CUDA only.
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if triton_setup.ON_CUDA else []))
def test_16_bit_activations_round_the_weight_once(dtype):
    weight, want_w = _gguf_weight("Q4_0", 64, 128)
    x = _x(4, 128).to(dtype)
    got = tq.fused_matmul(x.to(DEVICE), weight).cpu()
    assert got.dtype == dtype
    want = x.double() @ want_w.to(dtype).double().t()
    magnitude = x.abs().double() @ want_w.abs().double().t()
    # float32 sums of exact products, one rounding to `dtype` at the end
    assert ((got.double() - want).abs() <= want.abs() * torch.finfo(dtype).eps + 1e-5 * magnitude).all()


def test_fp8_weights_per_channel():
    """e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself (or, among the subnormals, half
    the smallest step times its row's scale); each row's largest |w| is exact; a zero row gets
    scale 1, not a division by zero."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    w[5] = 0
    q = quantize_fp8(w)
    back = q.dequantize()
    assert q.scale[5] == 1 and back[5].abs().max() == 0
    assert ((back - w).abs() <= w.abs() * 2**-4 + q.scale[:, None] * 2**-9).all()
    assert back.abs().amax(1)[:5].sub(w.abs().amax(1)[:5]).abs().max() < 1e-5  # each row's max is exact


def test_fp8_matmul_through_scaled_mm_and_weight_only():
    """bf16 activations go W8A8 through _scaled_mm (each row's activations rounded to e4m3, the
    error of one e4m3 rounding of x); float32 ones multiply the widened weight (exact up to fp32)."""
    w = quantize_fp8(torch.randn(80, 64, generator=torch.Generator().manual_seed(0)))
    w_on = QuantizedTensor("fp8", w.rows, w.cols, w.data.to(DEVICE), w.scale.to(DEVICE))
    x = _x(6, 64)
    exact = x.double() @ w.dequantize().double().t()
    magnitude = x.abs().double() @ w.dequantize().abs().double().t()
    got32 = tq.fp8_matmul(x.to(DEVICE), w_on).cpu()
    assert got32.dtype == torch.float32
    assert_within_fp32_rounding(got32, x, w.dequantize())
    x16 = x.bfloat16()
    got16 = tq.fp8_matmul(x16.to(DEVICE), w_on).cpu()
    assert got16.dtype == torch.bfloat16
    # One e4m3 rounding of x (2^-4 relative) and one of x to bf16, plus the bf16 output's rounding.
    err = (got16.double() - exact).abs()
    assert (err <= magnitude * (2**-4 + 2**-8) + exact.abs() * 2**-8 + 1e-6).all()
    assert err.max() > 0  # it did go through the 8-bit path, not the widened weight


def test_installed_layers_compute_on_the_device():
    """install: a GGUF linear and a tied embedding sharing one tensor move once and run the kernels."""
    weight, want_w = _gguf_weight("Q8_0", 40, 64)
    host = QuantizedTensor("Q8_0", 40, 64, weight.data.cpu())
    model = torch.nn.Module()
    model.embed = QuantEmbedding(40, 64, torch.float32)
    model.embed.weight_q = host
    model.head = QuantLinear(64, 40)
    model.head.set_parts([host])
    model.int8 = QuantLinear(64, 33)
    w8, want8 = _int8_weight(33, 64)
    model.int8.set_parts([QuantizedTensor("int8", 33, 64, w8.data.cpu(), w8.scale.cpu())])
    move_quantized(model, DEVICE)
    assert model.head.parts[0] is model.embed.weight_q  # moved once
    assert tq.install_gpu_quant_kernels(model) == 3
    ids = torch.tensor([3, 39])
    torch.testing.assert_close(model.embed(ids.to(DEVICE)).cpu(), want_w[ids], atol=0, rtol=1e-6)
    x = _x(2, 64)
    assert_within_fp32_rounding(model.head(x.to(DEVICE)).cpu(), x, want_w)
    assert_within_fp32_rounding(model.int8(x.to(DEVICE)).cpu(), x, want8)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_a_packed_gguf_model_on_the_kernels_gives_the_dequantized_logits(tmp_path, qtype):
    """A whole model (packed embedding and head, merged projections) from a GGUF: the layers on these
    kernels give the logits of the same model dequantizing on every call (model/quantized.py)."""
    pytest.importorskip("gguf")
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata
    from pagoda.model.loader import load_model
    from tests.model.test_quantized_models import _write_k_quant_gguf
    from tests.model.test_gguf_and_errors import write_tiny_gguf
    from tests.tiny_models import save_tiny_model

    hf = save_tiny_model("llama_linear", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64,
                         num_hidden_layers=1)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / f"tiny-{qtype}.gguf"
    (_write_k_quant_gguf if qtype.endswith("_K") else write_tiny_gguf)(hf, path, qtype)
    model = load_model(str(path), dtype="float32", quantization="gguf").model
    ids = torch.tensor([5, 17, 300, 42, 7])

    def logits():
        with torch.no_grad():
            on = ids.to(DEVICE)
            ctx = AttentionContext(ContiguousKVBackend(), ContiguousMetadata([0], [5]))
            return model.compute_logits(model(on, torch.arange(5, device=DEVICE), ctx)).cpu()

    want = logits()  # no kernels installed: reference_matmul over dequantize()
    model.to(DEVICE)
    move_quantized(model, DEVICE)
    assert tq.install_gpu_quant_kernels(model) == 4 + 2  # qkv, o, gate_up, down; the embedding, the head
    torch.testing.assert_close(logits(), want, atol=1e-4, rtol=1e-4)


def test_packed_moe_experts_on_the_kernels_give_the_dequantized_logits(tmp_path):
    """An MoE GGUF's experts kept as blocks (model/quantized.QuantExperts, gate and up in two formats)
    on these kernels, expert by expert: the logits of the same model dequantizing on every call."""
    pytest.importorskip("gguf")
    from pagoda.model.loader import load_model
    from pagoda.model.quantized import QuantExperts
    from tests.model.test_moe_gguf import PROMPTS, _logits, write_moe_gguf
    from tests.tiny_models import save_tiny_model

    hf = save_tiny_model("mixtral", tmp_path / "hf", num_hidden_layers=1)
    path = tmp_path / "mixtral.gguf"
    write_moe_gguf(hf, path, "llama", "Q8_0", {"ffn_up_exps": "Q4_0"})
    model = load_model(str(path), dtype="float32", quantization="gguf").model
    want = _logits(model, PROMPTS[0])  # no kernels installed: reference_matmul over dequantize()
    model.to(DEVICE)
    move_quantized(model, DEVICE)
    assert tq.install_gpu_quant_kernels(model) == 4 + 1  # qkv, o, the experts; the embedding, the head
    experts = model.model.layers[0].mlp.packed_experts
    assert isinstance(experts, QuantExperts) and experts.w2[0].data.device.type == DEVICE.type
    with torch.no_grad():
        ids = torch.tensor(PROMPTS[0], device=DEVICE)
        got = _logits_on(model, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _logits_on(model, ids: torch.Tensor) -> torch.Tensor:
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata

    ctx = AttentionContext(ContiguousKVBackend(), ContiguousMetadata([0], [len(ids)]))
    positions = torch.arange(len(ids), device=ids.device)
    return model.compute_logits(model(ids, positions, ctx)).cpu()
