"""Mixtures of experts with their experts kept quantized (`--quantization gguf | int8`): a GGUF's
`ffn_*_exps` blocks held as they lie in the file, int8 experts of a Hugging Face folder, against the
same weights dequantized; the fused layer over packed experts against the per-expert loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.exec import quant_linear
from pagoda.exec.quant_linear import Int8Rows, install_quant_kernels, quant_matmul, to_w8a8, w8a8_gemm, w8a8_kernel
from pagoda.model.fused_moe import fused_experts
from pagoda.model.loader import load_model
from pagoda.model.moe import FusedMoE
from pagoda.model.quantized import QuantExperts, QuantLinear, quantize_int8, quantized_bytes
from tests.model.test_moe import _experts, naive_moe
from tests.model.test_moe_gguf import GGUF_ARCH, PROMPTS, _logits, write_moe_gguf
from tests.model.test_quantized_models import _assert_same_output, _run, float_kernels  # noqa: F401 (a fixture)
from tests.tiny_models import save_tiny_model

gguf = pytest.importorskip("gguf")


def _moe_layers(net: nn.Module) -> list[FusedMoE]:
    return [m for m in net.modules() if isinstance(m, FusedMoE)]


def _int8_experts(w13: torch.Tensor, w2: torch.Tensor) -> QuantExperts:
    return QuantExperts([[quantize_int8(w)] for w in w13], [quantize_int8(w) for w in w2])


@pytest.mark.parametrize("tokens", [3, 40])  # few rows an expert (the fused kernel), and many (dequantized tiles)
def test_packed_experts_equal_the_per_expert_loop(tokens, float_kernels):
    w13, w2, g = _experts(num_experts=6, hidden=64, inter=32)
    experts = _int8_experts(w13, w2)
    experts.kernel = quant_matmul
    x = torch.randn(tokens, 64, generator=g)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(tokens)])  # expert 5 gets none
    weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    want = naive_moe(x, torch.stack([p[0].dequantize() for p in experts.w13]),
                     torch.stack([p.dequantize() for p in experts.w2]), weights, ids)
    torch.testing.assert_close(fused_experts(x, experts, weights, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,qtype,types", [
    ("qwen2_moe", "Q8_0", None),  # with its shared expert (kept packed too)
    ("mixtral", "Q4_0", {"ffn_up_exps": "Q8_0"}),  # gate and up in two formats: two parts an expert
    ("qwen3_moe", "Q4_1", None),
])
def test_gguf_experts_stay_packed_and_equal_the_dequantized_model(tmp_path, arch, qtype, types, float_kernels):
    hf = save_tiny_model(arch, tmp_path / "hf", **({"mlp_only_layers": []} if arch == "qwen3_moe" else {}))
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(hf, path, GGUF_ARCH[arch], qtype, types)
    packed = load_model(str(path), dtype="float32", quantization="gguf")
    layers = _moe_layers(packed.model)
    assert layers and all(isinstance(m.packed_experts, QuantExperts) for m in layers)
    assert all(m.w13_weight.numel() == 0 and m.w2_weight.numel() == 0 for m in layers)  # no float copy
    assert all(len(m.packed_experts.w13[0]) == (2 if types else 1) for m in layers)
    assert all(type(m.gate) is nn.Linear for m in layers)  # the router stays in float
    # Resident weights: the file's quantized blocks, experts included, each once.
    reader = gguf.GGUFReader(str(path))
    assert quantized_bytes(packed.model) == sum(int(t.n_bytes) for t in reader.tensors
                                                if t.tensor_type.name not in ("F32", "F16", "BF16"))
    want = _run(load_model(str(path), dtype="float32"))
    _assert_same_output(_run(packed), want, atol=1e-4)


def test_gguf_experts_through_the_integer_dots(tmp_path):
    """The default few-rows path rounds activations to int8 per 32 values: logits of a 5-token
    prompt (at most 5 rows an expert) stay near the dequantized model's (measured 0.11 of logits up
    to 5.7; a dense tiny Llama's Q8_0 layers on the same path part by 0.13; experts computed wrong
    part by whole units). A random tiny model's greedy tokens part at its many near-ties, so they
    are not compared here (float kernels: the test above)."""
    hf = save_tiny_model("mixtral", tmp_path / "hf")
    path = tmp_path / "mixtral.gguf"
    write_moe_gguf(hf, path, "llama", "Q8_0")
    packed = load_model(str(path), dtype="float32", quantization="gguf").model
    install_quant_kernels(packed, torch.device("cpu"))
    assert all(m.packed_experts.kernel is quant_matmul for m in _moe_layers(packed))
    want = _logits(load_model(str(path), dtype="float32").model, PROMPTS[0])
    got = _logits(packed, PROMPTS[0])
    assert 0 < (got - want).abs().max().item() < 0.25


def test_int8_experts_equal_the_rounded_float_model(tmp_path, float_kernels):
    folder = tmp_path / "qwen2_moe"
    save_tiny_model("qwen2_moe", folder)
    quant = load_model(str(folder), dtype="float32", quantization="int8")
    layers = _moe_layers(quant.model)
    assert all(isinstance(m.packed_experts, QuantExperts) and m.w13_weight.numel() == 0 for m in layers)
    assert all(type(m.gate) is nn.Linear and type(m.shared_expert_gate) is nn.Linear for m in layers)
    # A byte a weight and a float32 scale a row: each expert's gate-up [2I, H] and down [H, I].
    hidden, inter = 64, 32
    experts = sum(m.packed_experts.num_experts * (2 * inter * (hidden + 4) + hidden * (inter + 4)) for m in layers)
    linears = [m for m in quant.model.modules() if isinstance(m, QuantLinear)]
    assert quantized_bytes(quant.model) == experts + sum(m.out_features * (m.in_features + 4) for m in linears)
    got = _run(quant)
    rounded = load_model(str(folder), dtype="float32")
    with torch.no_grad():
        for name, m in rounded.model.named_modules():
            if (type(m) is nn.Linear and not name.endswith(("lm_head", ".gate", "shared_expert_gate"))
                    and m.in_features % 32 == 0):  # (the shared expert's down, 48 wide, stays float)
                m.weight.copy_(quantize_int8(m.weight).dequantize())
            if isinstance(m, FusedMoE):
                for w in (m.w13_weight, m.w2_weight):
                    w.copy_(torch.stack([quantize_int8(e).dequantize() for e in w]))
    _assert_same_output(got, _run(rounded), atol=1e-4)


@pytest.mark.skipif(w8a8_kernel() is None, reason="the CPU has no AVX512-VNNI (the W8A8 GEMM is not used)")
@pytest.mark.parametrize("tokens", [3, 20])
def test_int8_experts_on_the_w8a8_gemm_equal_the_few_rows_path(tokens):
    """Int8Rows over experts: more than 8 rows an expert on the W8A8 copy, fewer on the rows; the
    GEMM's order alone (memory short) for every row count. Both round the activations to int8 per
    32 values alike, so both give the rows path's output (token by token) within float32 rounding."""
    w13, w2, g = _experts(num_experts=4, hidden=64, inter=32)
    rows = _int8_experts(w13, w2)
    rows.kernel = quant_matmul
    both = QuantExperts(rows.w13, rows.w2)
    both.kernel = Int8Rows.of(both, to_w8a8, w8a8_gemm)
    short = QuantExperts([[to_w8a8(p[0])] for p in rows.w13], [to_w8a8(p) for p in rows.w2])
    short.kernel = w8a8_gemm
    x = torch.randn(tokens, 64, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    want = torch.cat([fused_experts(x[i : i + 1], rows, weights[i : i + 1], ids[i : i + 1]) for i in range(tokens)])
    for experts in (both, short):
        torch.testing.assert_close(fused_experts(x, experts, weights, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(w8a8_kernel() is None, reason="the CPU has no AVX512-VNNI (the W8A8 GEMM is not used)")
def test_int8_experts_take_the_w8a8_gemm_in_the_engine(tmp_path, monkeypatch):
    """The runner gives int8 experts Int8Rows on the W8A8 GEMM (a second copy while memory allows,
    the GEMM's order alone where it is short), and a prompt through it gives the first token of the
    few-rows path (prompts fed 8 tokens a step, PAGODA_NO_W8A8=1) within the int8 bound used for
    the dense layers (0.05). (Closer is not held: a float32-rounding difference in one layer can
    flip an activation's int8 rounding in the next.)"""
    folder = tmp_path / "mixtral"
    save_tiny_model("mixtral", folder)
    quant = load_model(str(folder), dtype="float32", quantization="int8")
    got = _run(quant)
    kernels = [m.packed_experts.kernel for m in _moe_layers(quant.model)]
    assert all(isinstance(k, Int8Rows) and k.gemm is w8a8_gemm for k in kernels)
    monkeypatch.setattr(quant_linear, "mem_total_bytes", lambda: 1 << 12)
    short = load_model(str(folder), dtype="float32", quantization="int8")
    short_out = _run(short)
    experts = _moe_layers(short.model)[0].packed_experts
    assert experts.kernel is w8a8_gemm and experts.w2[0].layout == "w8a8"
    monkeypatch.undo()
    monkeypatch.setenv("PAGODA_NO_W8A8", "1")
    want = _run(load_model(str(folder), dtype="float32", quantization="int8"), max_num_batched_tokens=8)
    for out in (got, short_out):
        assert all(g[0][0] == w[0][0] for g, w in zip(out, want))
        assert max(abs(g[1][0] - w[1][0]) for g, w in zip(out, want)) < 0.05
