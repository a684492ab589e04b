"""The C++ paged-cache kernels equal the PyTorch path (they are built on every machine with g++)."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_kernels import load_cpu_kernels
from pagoda.exec.paged_attention import TorchPagedAttention, write_kv
from tests.exec.test_paged_attention import D, build_batch


def _kernels():
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
