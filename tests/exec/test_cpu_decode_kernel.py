"""The C++ paged decode kernel equals the PyTorch path (it is built on every machine with g++)."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_kernels import load_paged_decode
from tests.exec.test_paged_attention import D, build_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_equals_torch(dtype):
    kernel = load_paged_decode()
    assert kernel is not None, "the CPU decode kernel failed to build"
    reqs = [(c, 1) for c in (1, 7, 16, 33, 64, 5)]
    cache, meta, q, _, _, _ = build_batch(reqs, num_blocks=128, seed=3)
    kc, vc = (t.to(dtype).contiguous() for t in cache.layer(0))
    got = kernel(q.to(dtype), kc, vc, meta.block_tables, meta.seq_lens, D**-0.5)
    from pagoda.exec.paged_attention import TorchPagedAttention

    backend = TorchPagedAttention.__new__(TorchPagedAttention)
    backend.decode_kernel = None
    want = backend._decode(q.to(dtype), kc, vc, meta, D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
