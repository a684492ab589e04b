"""The fused float32 CPU layer ops equal the PyTorch layers they replace, and are used where they apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.model import layers
from pagoda.model.cpu_layer_ops import load_layer_ops
from pagoda.model.layers import RMSNorm, RotaryEmbedding, apply_rotary

ops = load_layer_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ layer ops did not build (see the warning)")


def _rows(t: int, h: int, g: torch.Generator, stride_pad: int = 0) -> torch.Tensor:
    """[t, h] float32 whose rows may sit `stride_pad` floats apart (a slice of a wider projection)."""
    return torch.randn(t, h + stride_pad, generator=g)[:, :h]


@pytest.mark.parametrize("t,pad", [(1, 0), (7, 0), (300, 64)])
def test_rms_norm_and_add_rms_norm(t, pad):
    g = torch.Generator().manual_seed(t)
    x, res = _rows(t, 96, g, pad), torch.randn(t, 96, generator=g)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.rand(96, generator=g) + 0.5
    ref = F.rms_norm(x, (96,), norm.weight, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), ref, atol=1e-5, rtol=1e-5)

    x = x.contiguous()
    ref_res = x + res
    ref_out = F.rms_norm(ref_res, (96,), norm.weight, 1e-5)
    out, new_res = norm.add_forward(x, res)
    # In place: the residual stream and the input buffer hold the results.
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    torch.testing.assert_close(new_res, ref_res, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [{"rope_theta": 10000.0}, {"rope_theta": 100000.0, "rope_type": "linear", "factor": 4.0}])
def test_rotary_in_place_equals_rotate_half(rope):
    g = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(64, rope)
    # Strided like q and k inside the fused QKV output: [T, Hq*D | Hkv*D | Hkv*D].
    t, hq, hkv, d = 37, 6, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    positions = torch.randint(0, 5000, (t,), generator=g)  # large angles: cos/sin's slow range
    cos, sin = rotary.cos_sin(positions, torch.float32)
    ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    step = rotary.for_step(positions, torch.float32)
    assert step.table is not None and step.table.shape[0] >= 5000
    out_q, out_k = step.apply(q, k)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place, inside qkv
    torch.testing.assert_close(out_q, ref_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_k, ref_k, atol=1e-4, rtol=1e-4)


def test_rotary_rejects_a_position_past_its_table():
    x = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="position out of the cos/sin table"):
        ops.rotary_(x, torch.tensor([0, 16]), torch.randn(16, 8))


def test_silu_and_mul():
    g = torch.Generator().manual_seed(1)
    x = _rows(50, 2 * 80, g, stride_pad=16)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(layers.silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_only_float32_on_cpu_takes_the_fused_path():
    rotary = RotaryEmbedding(16, {"rope_theta": 10000.0})
    positions = torch.arange(5)
    assert rotary.for_step(positions, torch.float32).table is not None
    bf16 = rotary.for_step(positions, torch.bfloat16)
    assert bf16.table is None and bf16.cos.dtype == torch.bfloat16
    x = torch.randn(4, 2 * 16, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(layers.silu_and_mul(x), F.silu(gate) * up)  # bitwise: the PyTorch path
