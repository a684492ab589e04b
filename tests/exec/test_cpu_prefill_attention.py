"""The C++ prefill attention (csrc/prefill_attention.cpp) equals causal SDPA, and the CPU backend
uses it for prefills of every dtype (fresh prompts and chunks over cached context): float32, and
bf16 with the scores' exact products summed in float32 and p.v over the probabilities rounded to bf16."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_kernels import load_gemm_bf16, load_prefill_attention
from pagoda.exec.paged_attention import PagedKVCache, TorchPagedAttention, causal_sdpa

kernel = load_prefill_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ prefill attention did not build (see the warning)")


def _assert_bf16_attention(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """bf16 attention within one rounding of its output and one of each probability of the float32
    attention `want` (the p.v takes the probabilities in bf16, as torch's flash attention and
    transformers' eager attention do): |got - want| <= 2^-8 (|want| + sum_j p_j |v_j|), the second
    term `magnitude`. NaN where `want` is NaN, and only there."""
    assert got.dtype == torch.bfloat16
    got = got.float()
    assert torch.equal(got.isnan(), want.isnan())
    ok = want.isfinite()
    bound = 2.0**-8 * (want[ok].abs() + magnitude[ok]) + 1e-5
    assert ((got[ok] - want[ok]).abs() <= bound).all()


def _fused_qkv(n: int, seq_len: int, hq: int, hkv: int, d: int, g: torch.Generator):
    """q [n, hq, d] for the last n positions, k and v [seq_len, hkv, d]: row-strided views of one
    fused projection, as the model hands them over."""
    qkv = torch.randn(seq_len, (hq + 2 * hkv) * d, generator=g)
    q = qkv[seq_len - n :, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(seq_len, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(seq_len, hkv, d)
    return q, k, v


# Query counts around the kernel's 32-position blocks and its 6-row tiles, contexts that put the
# diagonal mid-way through a 64-key block, one to four query heads per KV head, head sizes 16-128.
@pytest.mark.parametrize(
    "n,seq_len,hq,hkv,d",
    [
        (1, 1, 4, 4, 16),
        (7, 7, 9, 3, 64),
        (33, 33, 4, 1, 32),
        (272, 272, 9, 3, 64),
        (1, 300, 9, 3, 64),
        (50, 110, 8, 2, 128),
        (100, 613, 6, 3, 48),
        (40, 8192, 8, 4, 128),  # K and V packed a group of heads at a time (over 16 MiB for all four)
    ],
)
def test_equals_causal_sdpa(n, seq_len, hq, hkv, d):
    g = torch.Generator().manual_seed(n * 1000 + seq_len)
    q, k, v = _fused_qkv(n, seq_len, hq, hkv, d, g)
    scale = d**-0.5
    want = causal_sdpa(q, k, v, scale)
    got = kernel.prefill_attention(q, k, v, scale)
    assert got.shape == (n, hq, d)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "n,seq_len,hq,hkv,d",
    [(7, 7, 9, 3, 64), (33, 33, 4, 1, 32), (272, 272, 9, 3, 64), (1, 300, 9, 3, 64), (50, 110, 8, 2, 128),
     (100, 613, 6, 3, 48), (20, 90, 2, 2, 16), (40, 8192, 8, 4, 128)],
)
@pytest.mark.parametrize("tiles", [True, False])
def test_bf16_is_the_float32_attention_within_its_roundings(n, seq_len, hq, hkv, d, tiles):
    """bf16 in, bf16 out: the float32 attention over the bf16 values within one rounding of the
    output and of each probability, on AMX tiles where the CPU has them (`tiles`), the vdpbf16ps
    path (head sizes of whole 32s) and the widened one (48, 16)."""
    g = torch.Generator().manual_seed(n * 1000 + seq_len + 7)
    q, k, v = (t.bfloat16() for t in _fused_qkv(n, seq_len, hq, hkv, d, g))
    scale = d**-0.5
    got = kernel.prefill_attention(q, k, v, scale, tiles=tiles)
    assert got.shape == (n, hq, d)
    _assert_bf16_attention(got, causal_sdpa(q.float(), k.float(), v.float(), scale),
                           causal_sdpa(q.float(), k.float(), v.float().abs(), scale))


def test_large_scores_keep_the_softmax_finite():
    # Scores of several hundred: exp without the running max would overflow to inf/NaN.
    g = torch.Generator().manual_seed(5)
    q, k, v = _fused_qkv(70, 200, 4, 2, 32, g)
    q, k = q * 30, k * 30
    got = kernel.prefill_attention(q, k, v, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, causal_sdpa(q, k, v, 1.0), atol=1e-4, rtol=1e-4)


def _attention_over_visible_keys(q, k, v, scale):
    """Each query against exactly the keys it sees (a slice, not a mask): a later key, whatever its
    value, cannot reach it. [n, Hq, D] from q [n, Hq, D] and k, v [S, Hkv, D], in float32."""
    n, hq, _ = q.shape
    seq_len, hkv = k.shape[0], k.shape[1]
    keys, values = (t.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1) for t in (k, v))  # [Hq, S, D]
    out = torch.empty(q.shape)
    for i in range(n):
        visible = seq_len - n + i + 1
        p = torch.softmax((keys[:, :visible] @ q[i].float().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)
        out[i] = (p.unsqueeze(1) @ values[:, :visible]).squeeze(1)
    return out


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("n,seq_len", [(70, 70), (70, 200)])
def test_inf_and_nan_equal_attention_over_each_querys_keys(n, seq_len, dtype, tiles):
    """NaN and +inf scores make their rows NaN and a -inf score weighs 0, as torch's softmax has it;
    a key past a query's position contributes nothing to it, even a NaN value (causal SDPA lets that
    NaN into every row of the block: 0 * NaN)."""
    g = torch.Generator().manual_seed(n + seq_len)
    hq, hkv, d = 4, 2, 32
    q, k, v = (t.clone() for t in _fused_qkv(n, seq_len, hq, hkv, d, g))
    q[..., 0] = q[..., 0].abs() + 0.5  # an inf in a key's dim 0 gives a score of the inf's sign
    ctx = seq_len - n

    def pos(i: int) -> int:  # the key position of query i
        return ctx + i

    v[pos(40), 0, 5] = float("nan")  # KV head 0: rows from query 40 on are NaN, 32-39 (its block) not
    k[pos(10), 0, 0] = float("-inf")  # KV head 0: that key weighs 0 for every later row
    k[pos(60), 1, 0] = float("inf")  # KV head 1: an inf score, NaN rows from query 60 on
    q[20, 3, 2] = float("nan")  # one query head of one row
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    want = _attention_over_visible_keys(q, k, v, d**-0.5)
    got = kernel.prefill_attention(q, k, v, d**-0.5, tiles=tiles)
    nan_rows = want.isnan().any(-1)  # [n, Hq]
    assert nan_rows[:, :2].nonzero()[:, 0].unique().tolist() == list(range(40, n))
    assert nan_rows[:, 2:].nonzero()[:, 0].unique().tolist() == [20, *range(60, n)]
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, equal_nan=True)
    else:
        _assert_bf16_attention(got, want, _attention_over_visible_keys(q, k, v.abs(), d**-0.5))
    # Every score -inf (each key's dim 0): no weight left, NaN, as torch's softmax gives.
    k[:, 1, 0] = float("-inf")
    assert kernel.prefill_attention(q, k, v, d**-0.5, tiles=tiles)[:, 2:].isnan().all()


def test_bad_inputs_are_refused_with_a_message():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16, the same for q, k and v"):
        kernel.prefill_attention(q.bfloat16(), k, k, 1.0)
    with pytest.raises(RuntimeError, match="takes float32 or bfloat16"):
        kernel.prefill_attention(q.half(), k.half(), k.half(), 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.prefill_attention(torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), 1.0)
    with pytest.raises(RuntimeError, match="S >= the query count"):
        kernel.prefill_attention(torch.randn(5, 2, 16), k, k, 1.0)


def test_backend_routes_cpu_prefills_of_each_dtype_to_the_kernel(monkeypatch):
    from pagoda.exec.attn_metadata import PagedAttentionMetadata

    cache = PagedKVCache(1, 8, 16, 1, 16, torch.float32, torch.device("cpu"))
    backend = TorchPagedAttention(cache)
    assert backend.prefill_kernel is not None
    calls = []
    backend.prefill_kernel = lambda *a: calls.append(("kernel", a[0].dtype)) or kernel.prefill_attention(*a)
    monkeypatch.setattr("pagoda.exec.paged_attention.causal_sdpa", lambda *a: calls.append("sdpa") or causal_sdpa(*a))
    meta = PagedAttentionMetadata.__new__(PagedAttentionMetadata)
    meta.block_size, meta.block_tables = 16, torch.tensor([[0, 1]])
    g = torch.Generator().manual_seed(0)
    for dtype, d in ((torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 8)):
        cache = PagedKVCache(1, 8, 16, 1, d, dtype, torch.device("cpu"))
        k_cache, v_cache = cache.layer(0)
        q, k, v = (t.to(dtype) for t in _fused_qkv(10, 10, 2, 1, d, g))
        out = backend._prefill(q, k, v, k_cache, v_cache, meta, 0, 10, 0.25)  # fresh prompt
        assert out.dtype == dtype
        k_cache.view(-1, 1, d)[:20] = torch.randn(20, 1, d).to(dtype)
        v_cache.view(-1, 1, d)[:20] = torch.randn(20, 1, d).to(dtype)
        backend._prefill(q, k, v, k_cache, v_cache, meta, 0, 20, 0.25)  # a chunk over 10 cached tokens
    # float32 and bf16 reach the kernel as they are; head_dim 8 is not the kernel's.
    assert calls == [("kernel", torch.float32)] * 2 + [("kernel", torch.bfloat16)] * 2 + ["sdpa", "sdpa"]


def test_bf16_prefill_depends_only_on_the_keys_each_position_sees():
    """bf16 through the backend: a prompt's rows are the same bits whether more tokens follow or not
    (bf16 SDPA, which blocks by length, moved them), and within bf16's roundings of float32 math."""
    g = torch.Generator().manual_seed(6)
    backend = TorchPagedAttention(PagedKVCache(1, 8, 16, 3, 64, torch.bfloat16, torch.device("cpu")))
    seq_len = 300
    q, k, v = (t.to(torch.bfloat16) for t in _fused_qkv(seq_len, seq_len, 9, 3, 64, g))
    whole = backend._prefill(q, k, v, None, None, None, 0, seq_len, 0.125)
    for n in (5, 40, 290):
        part = backend._prefill(q[:n], k[:n], v[:n], None, None, None, 0, n, 0.125)
        assert torch.equal(part, whole[:n])
    _assert_bf16_attention(whole, causal_sdpa(q.float(), k.float(), v.float(), 0.125),
                           causal_sdpa(q.float(), k.float(), v.float().abs(), 0.125))


@pytest.mark.parametrize("tiles", [True, False])
def test_bf16_kernel_rows_depend_only_on_the_keys_they_see(tiles):
    """Both bf16 kernels (AMX tiles where the CPU has them, and vdpbf16ps): a prompt's rows are the
    same bits whether more tokens follow or not, and a chunk over earlier context gives the rows the
    whole prompt gives them."""
    g = torch.Generator().manual_seed(8)
    seq_len = 300
    q, k, v = (t.to(torch.bfloat16) for t in _fused_qkv(seq_len, seq_len, 9, 3, 64, g))
    whole = kernel.prefill_attention(q, k, v, 0.125, tiles=tiles)
    for n in (5, 31, 40, 129, 290):
        assert torch.equal(kernel.prefill_attention(q[:n], k[:n], v[:n], 0.125, tiles=tiles), whole[:n])
    for start, end in ((100, 164), (37, 300)):  # a chunk of queries over the keys before it
        chunk = kernel.prefill_attention(q[start:end], k[:end], v[:end], 0.125, tiles=tiles)
        assert torch.equal(chunk, whole[start:end])


@pytest.mark.skipif(not load_gemm_bf16() or not load_gemm_bf16().amx_block_rows(), reason="no AMX tiles here")
def test_on_amx_bf16_prefill_runs_on_the_tiles():
    """Where the CPU has AMX, bf16 prefill takes the tiles (their sums round otherwise than vdpbf16ps',
    so some outputs differ from the vdpbf16ps kernel's, each within bf16's roundings)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (t.bfloat16() for t in _fused_qkv(272, 272, 9, 3, 64, g))
    tiles, vdp = (kernel.prefill_attention(q, k, v, 0.125, tiles=t) for t in (True, False))
    assert torch.equal(kernel.prefill_attention(q, k, v, 0.125), tiles)
    assert not torch.equal(tiles, vdp)
