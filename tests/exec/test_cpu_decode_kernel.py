"""The C++ paged-cache kernels equal the PyTorch path (they are built on every machine with g++)."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.exec.cpu_kernels import load_cpu_kernels
from pagoda.exec.paged_attention import TorchPagedAttention, write_kv
from tests.exec.test_paged_attention import D, build_batch


def _kernels():
    if os.environ.get("PAGODA_NO_CPP") == "1":
        pytest.skip("PAGODA_NO_CPP=1 turns the C++ kernels off")
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels failed to build"
    return kernels


# 6 sequences: one work item per (sequence, KV head); 12 on two threads: one item per sequence,
# reading whole cache rows. Both layouts must give the same answer.
@pytest.mark.parametrize("ctx_lens", [(1, 7, 16, 33, 64, 5), (1, 7, 16, 33, 64, 5, 2, 9, 40, 3, 17, 31)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_equals_torch(dtype, ctx_lens):
    kernel = _kernels().paged_decode
    cache, meta, q, _, _, _ = build_batch([(c, 1) for c in ctx_lens], num_blocks=256, seed=3)
    kc, vc = (t.to(dtype).contiguous() for t in cache.layer(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernel(q.to(dtype), kc, vc, meta.block_tables, meta.seq_lens, D**-0.5)
    finally:
        torch.set_num_threads(threads)
    backend = TorchPagedAttention.__new__(TorchPagedAttention)
    backend.decode_kernel = None
    want = backend._decode(q.to(dtype), kc, vc, meta, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_write_kv_equals_index_copy_on_strided_rows(dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, bs, hkv, d = 8, 4, 3, 12
    k_cache, v_cache = (torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    # K/V as the model hands them over: row-strided views into one fused projection.
    qkv = torch.randn(600, 5 * hkv * d, generator=g).to(dtype)
    k = qkv[:, hkv * d : 2 * hkv * d].view(-1, hkv, d)
    v = qkv[:, 3 * hkv * d : 4 * hkv * d].view(-1, hkv, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:20]
    k, v = k[:20], v[:20]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, k, v, slots)
    _kernels().write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        _kernels().write_kv(k_cache, v_cache, k[:1], v[:1], torch.tensor([num_blocks * bs]))
    with pytest.raises(RuntimeError, match="do not match"):  # rows of another head count
        _kernels().write_kv(k_cache, v_cache, k[:2, :2], v[:2, :2], slots[:2])


def _dense_decode(q, kc, vc, tables, lens, scale):
    """Reference decode attention in float32 over the cache's values, one sequence at a time."""
    hq, hkv = q.shape[1], kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n in enumerate(lens.tolist()):
        rows = torch.cat([kc[blk] for blk in tables[b]]).float()[:n]  # [n, Hkv, D]
        vals = torch.cat([vc[blk] for blk in tables[b]]).float()[:n]
        keys = rows.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, n, D]
        values = vals.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        p = torch.softmax((q[b].float().unsqueeze(1) @ keys.transpose(1, 2)).squeeze(1) * scale, dim=-1)
        out[b] = (p.unsqueeze(1) @ values).squeeze(1)
    return out


# Head sizes that take each vector path (64: eight registers, 40: four and one, 12: one and a scalar
# tail), 16-token blocks (eight tokens at once plus a tail), and a float32 model over each cache dtype.
@pytest.mark.parametrize("head_dim", [64, 40, 12])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs", [3, 9])  # per-KV-head items, then whole-row items on two threads
def test_cpp_decode_over_each_cache_dtype(head_dim, cache_dtype, num_seqs):
    g = torch.Generator().manual_seed(head_dim + num_seqs)
    hq, hkv, bs, num_blocks = 6, 2, 16, 64
    kc, vc = (torch.randn(num_blocks, bs, hkv, head_dim, generator=g).to(cache_dtype) for _ in range(2))
    lens = torch.randint(1, 90, (num_seqs,), generator=g)
    lens[0] = 1
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * 6].view(num_seqs, 6)
    q = torch.randn(num_seqs, hq, head_dim, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = _kernels().paged_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == torch.float32
    want = _dense_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_write_kv_converts_to_the_cache_dtype(cache_dtype):
    g = torch.Generator().manual_seed(2)
    num_blocks, bs, hkv, d = 8, 4, 3, 20
    caches = [torch.zeros(num_blocks, bs, hkv, d, dtype=cache_dtype) for _ in range(4)]
    qkv = torch.randn(10, 5 * hkv * d, generator=g) * 50  # large values: rounding shows
    k = qkv[:, hkv * d : 2 * hkv * d].view(-1, hkv, d)
    v = qkv[:, 3 * hkv * d : 4 * hkv * d].view(-1, hkv, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:10]
    write_kv(caches[0], caches[1], k, v, slots)  # the PyTorch path: index_copy_ of k.to(cache dtype)
    _kernels().write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    flat = caches[2].view(-1, hkv, d)
    assert torch.equal(flat[slots], k.to(cache_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_reads_q_in_place_from_the_fused_projection(dtype):
    # The model hands q over as a row-strided view of the QKV projection; the kernel must read it as
    # it stands (no copy), and give exactly what it gives for a dense copy.
    kernel = _kernels().paged_decode
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, bs, num_seqs = 6, 2, 64, 16, 5
    kc, vc = (torch.randn(32, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    qkv = torch.randn(num_seqs, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(num_seqs, hq, d)
    assert not q.is_contiguous()
    tables = torch.randperm(32, generator=g)[: num_seqs * 4].view(num_seqs, 4)
    lens = torch.tensor([1, 17, 40, 64, 33])
    got = kernel(q, kc, vc, tables, lens, d**-0.5)
    assert got.is_contiguous() and got.shape == q.shape
    assert torch.equal(got, kernel(q.contiguous(), kc, vc, tables, lens, d**-0.5))
    with pytest.raises(RuntimeError, match="contiguous heads"):
        kernel(q.transpose(1, 2), kc, vc, tables, lens, d**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_with_inf_and_nan_equals_the_reference(dtype):
    """NaN and +inf scores make their head NaN and a -inf score weighs 0, as torch's softmax over the
    context has it; cache rows past a sequence's length (NaN and inf here) contribute nothing."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, bs, num_blocks = 4, 2, 32, 16, 40
    kc, vc = (torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2))
    lens = torch.tensor([21, 30, 9, 40, 17, 33])
    tables = torch.randperm(num_blocks, generator=g)[:18].view(6, 3)
    q = torch.randn(6, hq, d, generator=g)
    q[:, :, 0] = q[:, :, 0].abs() + 0.5  # so that an inf in a key's dim 0 gives an inf score of its sign
    used = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        slots = torch.tensor([tables[b, p // bs] * bs + p % bs for p in range(n)])
        used[slots] = True
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    flat_k[~used], flat_v[~used] = float("nan"), float("inf")  # every row no sequence reads

    def at(b: int, pos: int) -> int:
        return int(tables[b, pos // bs] * bs + pos % bs)

    flat_k[at(0, 5), 0, 3] = float("nan")  # seq 0, KV head 0: its query heads 0-1 are NaN
    flat_k[at(1, 12), 1, 0] = float("-inf")  # seq 1, KV head 1: one key weighs 0
    flat_k[at(2, 8), 0, 0] = float("inf")  # seq 2, KV head 0: +inf score, NaN heads
    q[3, 2, 7] = float("nan")  # seq 3, query head 2 only
    for pos in range(int(lens[4])):  # seq 4, KV head 1: every score -inf, NaN as in torch
        flat_k[at(4, pos), 1, 0] = float("-inf")
    kc, vc, q = kc.to(dtype), vc.to(dtype), q.to(dtype)
    got = _kernels().paged_decode(q, kc, vc, tables, lens, d**-0.5)
    want = _dense_decode(q, kc, vc, tables, lens, d**-0.5)
    nan_heads = {(0, 0), (0, 1), (2, 0), (2, 1), (3, 2), (4, 2), (4, 3)}
    assert {tuple(i) for i in want.isnan().any(-1).nonzero().tolist()} == nan_heads
    assert not want.isinf().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, equal_nan=True)


def _on_two_threads(fn, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


# A bf16 model over a bf16 cache takes its own kernel where the CPU has AVX512-BF16 and head_dim is a
# multiple of 32 (exec/csrc/decode_bf16.h), the general one elsewhere; either must give the float32
# attention over the cached values, rounded once to bf16. Head sizes of half, one and a half and two
# 64-wide passes; query heads per KV head filling one to four accumulator rows and more than four;
# blocks shorter than, as long as and longer than the kernel's 16-token groups; contexts that end
# inside, at and just past a group.
@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 5, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_decode_is_the_float32_attention_rounded_once(head_dim, group, block_size):
    g = torch.Generator().manual_seed(head_dim * group + block_size)
    hkv, num_blocks = 2, 128
    kc, vc = (torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([1, 15, 16, 17, 33, 100, 64, 2, 47])
    per_seq = (int(lens.max()) + block_size - 1) // block_size
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=g).to(torch.bfloat16)
    scale = head_dim**-0.5
    kernel = _kernels().paged_decode
    got = _on_two_threads(kernel, q, kc, vc, tables, lens, scale)
    want = _dense_decode(q, kc, vc, tables, lens, scale)
    # one rounding to bf16 is at most half a step: 2^-8 of the value
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-5)
    # Three sequences on two threads are split into per-KV-head items, nine are not: the same bits.
    few = _on_two_threads(kernel, q[:3], kc, vc, tables[:3], lens[:3], scale)
    assert torch.equal(few, got[:3])


# Work goes to the threads by context length (csrc/balanced_for.h): one long context among many short
# ones, first or last, on two and three threads, must still give every sequence its own attention,
# and the same bits as on one thread (which thread computes an item does not change its arithmetic).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("long_first", [True, False])
def test_decode_split_by_context_length_covers_every_sequence(dtype, long_first):
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, bs, num_blocks = 6, 2, 64, 16, 128
    kc, vc = (torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([700] + [1, 3, 2, 5, 1, 4, 2, 1, 6, 3, 1, 2, 1, 9, 1])
    if not long_first:
        lens = lens.flip(0)
    tables = torch.randperm(num_blocks, generator=g)[:44].repeat(len(lens), 1)  # 44 blocks hold 700 tokens
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    kernel, threads = _kernels().paged_decode, torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(kernel(q, kc, vc, tables, lens, d**-0.5))
    finally:
        torch.set_num_threads(threads)
    want = _dense_decode(q, kc, vc, tables, lens, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(outs[0].float(), want, rtol=tol, atol=1e-5)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
