"""The fused CPU layer ops equal the PyTorch layers they replace, and are used where they apply.

float32: within float rounding. bfloat16: rotary and SiLU-and-multiply bit for bit on every ISA torch
dispatches to (AVX-512, AVX2 under ATEN_CPU_CAPABILITY=avx2, scalar under =default), RMSNorm within a
bf16 step for the rare element its summation order moves. Both dtypes: inf and NaN come out where
the PyTorch path puts them (NaN bits aside: torch's vector and scalar bf16 conversions write
different NaNs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import cpp_build
from pagoda.model import layers
from pagoda.model.cpu_layer_ops import _SOURCE, load_layer_ops
from pagoda.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, rms_norm_reference, silu_and_mul_reference

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
    x = _rows(50, 2 * 80, g, stride_pad=16) * 30  # past +-88 too, where exp(-gate) overflows
    gate, up = x.chunk(2, dim=-1)
    # exp_f32 is within 2 ulp of exp, so silu within a few float ulp of torch's.
    torch.testing.assert_close(layers.silu_and_mul(x), F.silu(gate) * up, atol=1e-30, rtol=1e-6)


def test_float32_and_bf16_on_cpu_take_the_fused_path_float16_does_not(monkeypatch):
    rotary = RotaryEmbedding(16, {"rope_theta": 10000.0})
    positions = torch.arange(5)
    for dtype in (torch.float32, torch.bfloat16):
        assert rotary.for_step(positions, dtype).table is not None
    fp16 = rotary.for_step(positions, torch.float16)
    assert fp16.table is None and fp16.cos.dtype == torch.float16
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    layers_ops = layers.fused_ops_for
    monkeypatch.setattr(layers, "fused_ops_for", lambda x: Spy() if layers_ops(x) is not None else None)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = RMSNorm(32).to(dtype)
        x = torch.randn(4, 32, dtype=dtype)
        norm(x), layers.silu_and_mul(torch.randn(4, 64, dtype=dtype))
    assert calls == ["rms_norm", "silu_and_mul"] * 2


# bf16: the kernels round where the PyTorch path rounds, so they agree bit for bit; RMSNorm's sum of
# squares adds up in another order, which can move a normalised value across a bf16 rounding
# boundary, one bf16 step, and the product with the weight rounds again (measured: 0-6 elements in a
# million, at most two steps, i.e. within 2**-6 relatively).
def _bf16_rounding_differences(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many elements differ; asserts that each is within two bf16 steps (2**-6 relatively)."""
    got, want = got.float(), want.float()
    differ = got != want
    close = (got - want).abs() <= want.abs() * 2.0**-6
    assert bool(close[differ].all()), "a bf16 result is more than two rounding steps off"
    return int(differ.sum())


def test_bf16_norms_round_as_the_pytorch_path():
    g = torch.Generator().manual_seed(3)
    t, h = 512, 576
    x = (torch.randn(t, h + 32, generator=g) * 3).to(torch.bfloat16)[:, :h]  # strided rows
    res = torch.randn(t, h, generator=g).to(torch.bfloat16)
    norm = RMSNorm(h, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(h, generator=g) + 0.5).to(torch.bfloat16)

    assert _bf16_rounding_differences(norm(x), rms_norm_reference(x, norm.weight, 1e-5)) <= t * h // 10_000

    x = x.contiguous()
    want_res = x + res
    want = rms_norm_reference(want_res, norm.weight, 1e-5)
    out, new_res = norm.add_forward(x, res)
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    assert torch.equal(new_res, want_res)
    assert _bf16_rounding_differences(out, want) <= t * h // 10_000


def test_bf16_rotary_and_silu_equal_the_pytorch_path_bitwise():
    """Bit for bit, on AVX-512, AVX2 and scalar torch alike: rotary (each product and sum rounded to
    bf16 where apply_rotary rounds) and SiLU-and-multiply (silu(gate) rounded, then the product)."""
    g = torch.Generator().manual_seed(4)
    rotary = RotaryEmbedding(64, {"rope_theta": 100000.0})
    t, hq, hkv, d = 300, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    positions = torch.randint(0, 5000, (t,), generator=g)
    cos, sin = rotary.cos_sin(positions, torch.bfloat16)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = rotary.for_step(positions, torch.bfloat16).apply(q, k)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)

    x = (torch.randn(t, 2 * 1536 + 16, generator=g) * 3).to(torch.bfloat16)[:, : 2 * 1536]
    assert torch.equal(layers.silu_and_mul(x), silu_and_mul_reference(x))


def _all_bf16() -> torch.Tensor:
    """Every bf16 value once: +-0, subnormals, normals, +-inf and the NaNs."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _assert_same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN where the reference has none, or the reverse"
    differ = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} differ, e.g. at {want[differ][:5].tolist()}"


def test_bf16_silu_and_mul_equals_torch_for_every_gate():
    """All 65,536 bf16 gates: the kernel's silu is bf16(g / (1 + e)), e = exp(-g) rounded once to float
    (the reference below, in double), and so is torch's F.silu on this ISA, bit for bit."""
    gate = _all_bf16()
    gf = gate.float()
    e = torch.exp(-gf.double()).float()  # exp(-g) rounded once to float (inf past float's range)
    reference = (gf / (1 + e)).to(torch.bfloat16)
    _assert_same_bits_or_both_nan(F.silu(gate), reference)  # torch's own path, this ISA
    for up in (torch.ones_like(gate), torch.full_like(gate, -3.5), gate.flip(0)):
        x = torch.cat([gate, up]).view(1, -1)  # one row: [gate | up]
        got = ops.silu_and_mul(x).view(-1)
        _assert_same_bits_or_both_nan(got, reference * up)
        _assert_same_bits_or_both_nan(got, F.silu(gate) * up)
    # Where exp(-g) overflows, silu is -0 (the vectorised fast-math build gave NaN there).
    big = torch.tensor([-89.0, -100.0, -1e30]).to(torch.bfloat16)
    out = ops.silu_and_mul(torch.cat([big.repeat(40), torch.ones(120, dtype=torch.bfloat16)]).view(1, -1))
    assert torch.equal(out, torch.zeros_like(out)) and bool(out.signbit().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inf_and_nan_come_out_where_the_pytorch_path_puts_them(dtype):
    g = torch.Generator().manual_seed(5)
    t, h = 6, 96
    special = {(0, 3): float("nan"), (1, 7): float("inf"), (2, 0): float("-inf"), (3, 50): 1e30}
    x = torch.randn(t, h, generator=g)
    for (i, j), v in special.items():
        x[i, j] = v
    x = x.to(dtype)
    weight = (torch.rand(h, generator=g) + 0.5).to(dtype)

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        if dtype == torch.bfloat16:
            _assert_same_bits_or_both_nan(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)

    # A row with NaN is NaN; one with +-inf is NaN there (inf * 0) and 0 elsewhere; the rest as usual.
    want = rms_norm_reference(x, weight, 1e-5)
    assert bool(want[0].isnan().all()) and bool(want[1, 7].isnan()) and not want[4:].isnan().any()
    same(ops.rms_norm(x, weight, 1e-5), want)
    res = torch.randn(t, h, generator=g).to(dtype)
    want_res = x + res
    xc, rc = x.clone(), res.clone()
    ops.add_rms_norm_(xc, rc, weight, 1e-5)
    same(rc, want_res)
    same(xc, rms_norm_reference(want_res, weight, 1e-5))

    rotary = RotaryEmbedding(16, {"rope_theta": 10000.0})
    positions = torch.arange(t) * 7
    q, k = x.view(t, 6, 16).clone(), x.view(t, 6, 16)[:, 2:4].clone()
    cos, sin = rotary.cos_sin(positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert want_q.isnan().any() and want_q.isinf().any()
    got_q, got_k = rotary.for_step(positions, dtype).apply(q, k)
    same(got_q, want_q)
    same(got_k, want_k)

    gate_up = torch.cat([x, x.flip(0)], dim=1)  # inf, -inf and NaN in both halves
    same(ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


def test_an_avx2_build_gives_the_native_builds_bits(monkeypatch):
    """Results do not hang on the vector width the compiler picked: built for AVX2 (-march=haswell),
    the ops give the native build's bits (AVX-512 on an AVX-512 machine), float32 and bf16, row
    lengths with and without a tail past the vector lanes. The first run compiles (~30 s)."""
    if not {"avx2", "fma", "f16c"} <= set(cpp_build.cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    haswell = tuple("-march=haswell" if f == "-march=native" else f for f in cpp_build.CFLAGS)
    monkeypatch.setattr(cpp_build, "CFLAGS", haswell)
    avx2 = cpp_build.build_cpu_extension("pagoda_layer_ops", _SOURCE, "the layer ops built for AVX2")
    assert avx2 is not None
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.bfloat16):
        for h in (576, 581, 5):
            x = (torch.randn(64, h + 3, generator=g) * 3).to(dtype)[:, :h]
            w = (torch.rand(h, generator=g) + 0.5).to(dtype)
            assert torch.equal(avx2.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
            res = torch.randn(64, h, generator=g).to(dtype)
            pairs = [(x.contiguous(), res.clone()) for _ in range(2)]
            avx2.add_rms_norm_(*pairs[0], w, 1e-5)
            ops.add_rms_norm_(*pairs[1], w, 1e-5)
            assert torch.equal(pairs[0][0], pairs[1][0]) and torch.equal(pairs[0][1], pairs[1][1])
        gate_up = (torch.randn(64, 2 * 1536, generator=g) * 4).to(dtype)
        assert torch.equal(avx2.silu_and_mul(gate_up), ops.silu_and_mul(gate_up))
        q = torch.randn(64, 9, 64, generator=g).to(dtype)
        positions, table = torch.randint(0, 600, (64,), generator=g), torch.randn(600, 64, generator=g)
        q_avx2, q_native = q.clone(), q.clone()
        avx2.rotary_(q_avx2, positions, table)
        ops.rotary_(q_native, positions, table)
        assert torch.equal(q_avx2, q_native)


def test_mixed_dtypes_are_refused():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be contiguous, of x's dtype"):
        ops.rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="same shape and dtype"):
        ops.add_rms_norm_(x, torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        ops.silu_and_mul(torch.randn(2, 8, dtype=torch.float16))
