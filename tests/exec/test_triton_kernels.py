"""The Triton attention kernels equal the PyTorch reference (issue: GPU execution path, C.10).

On a machine without a GPU the kernels run on CPU tensors under Triton's interpreter; TRITON_INTERPRET
is read when `triton.jit` decorates a kernel, so it is set before the kernel module is imported (and
the module is re-imported if something loaded it compiled). On CUDA the same tests run compiled.
Shapes are tiny: the interpreter executes every program in Python.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
import warnings

import pytest
import torch



def _install_numpy24_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int() of a 1-element array,
    which numpy >= 2.4 refuses (triton-lang/triton#9171): a loop bounded by a loaded value fails.
    Take the element explicitly instead, for the interpreter only."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagoda_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagoda_fixed = True
    interpreter._patch_lang_tensor = patched


def _install_fp8_rounding_fix() -> None:
    """Triton 3.6's interpreter rounds float32 -> e4m3 by adding the cut-off bit to the mantissa
    without carrying into the exponent: 31.5 becomes 16, not 32. A GPU rounds to nearest even, as
    torch does; take torch's conversion for that case, in the interpreter only."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_pagoda_fixed", False):
        return

    def patched(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == triton.language.float8e4nv and input_dtype in (triton.language.float32,
                                                                          triton.language.float16):
            wide = torch.from_numpy(np.ascontiguousarray(data).view(np.float32 if input_dtype.primitive_bitwidth == 32
                                                                    else np.float16).astype(np.float32))
            return wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    patched._pagoda_fixed = True
    interpreter._convert_float = patched


ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_CUDA:
    # Before triton itself is imported: its own library functions (tl.zeros, ...) are jit-decorated
    # at import and must be interpreted too.
    _late = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
if not ON_CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    # Fail loudly rather than skip: every kernel must be checked wherever triton imports.
    assert isinstance(triton.language.zeros, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1"
        + (" (it was already imported when this module loaded)" if _late else "")
    )
    if "pagoda.exec.triton_attention" in sys.modules:
        importlib.reload(sys.modules["pagoda.exec.triton_attention"])
    _install_numpy24_index_fix()
    _install_fp8_rounding_fix()

from pagoda.exec import triton_attention as ta  # noqa: E402
from pagoda.exec.paged_attention import TorchPagedAttention  # noqa: E402
from tests.exec.test_paged_attention import BS, HKV, D, HQ, build_batch  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
TOL = dict(atol=2e-5, rtol=2e-5)


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def reference(cache, meta, q, k, v) -> torch.Tensor:
    """TorchPagedAttention on CPU with its pure PyTorch decode path (no C++ kernel)."""
    backend = TorchPagedAttention(cache)
    backend.decode_kernel = None
    return backend.forward(0, q, k, v, meta, scale=D**-0.5)


def test_write_kv_skips_padding_slots():
    g = torch.Generator().manual_seed(0)
    num_blocks, hkv, d = 6, 3, 12  # head count and head dim not powers of two: masked lanes
    k_cache = torch.randn(num_blocks, BS, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, BS, hkv, d, generator=g)
    slots = torch.tensor([5, -1, 17, 0, -1, 23])
    # Strided K/V rows, as the model hands them over (views into one qkv projection).
    kv = torch.randn(len(slots), 2, hkv, d, generator=g)
    k, v = kv[:, 0], kv[:, 1]
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    exp_k.view(-1, hkv, d)[slots[real]] = k[real]
    exp_v.view(-1, hkv, d)[slots[real]] = v[real]
    kc, vc, kd, vd, sd = _to(DEVICE, k_cache, v_cache, k, v, slots)
    ta.write_kv(kc, vc, kd, vd, sd)
    assert torch.equal(kc.cpu(), exp_k)
    assert torch.equal(vc.cpu(), exp_v)


def _cache_on(cache, device):
    cache.tensor = cache.tensor.to(device)
    return cache


@pytest.mark.parametrize(
    "ctx_lens,num_splits",
    [
        ([1, 5, 16, 23], 1),  # lengths below, at and past a block boundary
        ([40, 7, 33], 3),  # split-K: some parts of the short sequence are empty
        ([70], 4),
        ([2, 65], 16),  # more splits than tiles
    ],
)
def test_decode_equals_reference(ctx_lens, num_splits):
    reqs = [(c - 1, 1) for c in ctx_lens]  # seq_len c including this step's token
    cache, meta, q, k, v, _ = build_batch(reqs, num_blocks=32, seed=sum(ctx_lens) + num_splits)
    ref = reference(cache, meta, q, k, v)  # also writes this step's K/V into the cache
    cache = _cache_on(cache, DEVICE)
    kc, vc = cache.layer(0)
    qd, bt, sl = _to(DEVICE, q, meta.block_tables, meta.seq_lens)
    out = ta.paged_decode(qd, kc, vc, bt, sl, D**-0.5, num_splits)
    torch.testing.assert_close(out.cpu(), ref, **TOL)


def test_decode_reduce_never_reads_unwritten_partial_columns(monkeypatch):
    """Split-K partials are BLOCK_D wide (16 here) but hold head_dim (8) columns. The reduce must not
    read the others. Filled with inf here, they would be weighted by an empty part's zero weight:
    inf * 0, which the interpreter reports as a RuntimeWarning (an error in this test). On a GPU the
    NaN lanes are dropped unseen; uninitialised memory made the interpreter warn now and then."""
    real_empty = torch.empty

    def inf_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("inf")) if t.is_floating_point() else t

    ctx_lens, num_splits = [40, 7, 33], 3  # the 7-token sequence leaves parts empty
    assert ta._pow2(D, 16) > D
    cache, meta, q, k, v, _ = build_batch([(c - 1, 1) for c in ctx_lens], num_blocks=32, seed=5)
    ref = reference(cache, meta, q, k, v)
    cache = _cache_on(cache, DEVICE)
    kc, vc = cache.layer(0)
    qd, bt, sl = _to(DEVICE, q, meta.block_tables, meta.seq_lens)
    monkeypatch.setattr(torch, "empty", inf_empty)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = ta.paged_decode(qd, kc, vc, bt, sl, D**-0.5, num_splits)
    monkeypatch.undo()
    torch.testing.assert_close(out.cpu(), ref, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_backend_equals_reference_on_ragged_batches(seed):
    """Decodes and prefills in one step: new prompts, and chunks continuing a cached prefix."""
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 40), 1) for _ in range(rng.randint(0, 3))]
    prefills = [(rng.choice([0, rng.randint(1, 20)]), rng.randint(2, 37)) for _ in range(rng.randint(1, 3))]
    reqs = decodes + prefills
    cache, meta, q, k, v, _ = build_batch(reqs, num_blocks=64, seed=100 + seed)
    ref_cache = PagedKVCacheClone(cache)
    ref = reference(ref_cache, meta, q, k, v)
    cache = _cache_on(cache, DEVICE)
    meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = _to(
        DEVICE, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables
    )
    meta.max_query_len = max(n for _, n in reqs)
    out = ta.TritonPagedAttention(cache).forward(0, *_to(DEVICE, q, k, v), meta, scale=D**-0.5)
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    # The backend wrote this step's K/V exactly where the reference did.
    assert torch.equal(cache.tensor.cpu(), ref_cache.tensor)


def test_gqa_group_of_four_and_prefill_only():
    """Hq = 4 * Hkv with a cached prefix that ends mid-block; no decodes in the step."""
    hq, hkv, d, bs = 8, 2, 16, 16
    g = torch.Generator().manual_seed(7)
    from pagoda.exec.attn_metadata import PagedAttentionMetadata
    from pagoda.exec.paged_attention import PagedKVCache
    from pagoda.model.attention import dense_causal_attention

    cache = PagedKVCache(1, 8, bs, hkv, d, torch.float32, torch.device("cpu"))
    ctx, n = 19, 22
    table = [5, 2, 7]
    keys = torch.randn(ctx + n, hkv, d, generator=g)
    values = torch.randn(ctx + n, hkv, d, generator=g)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx + n)])
    kc, vc = cache.layer(0)
    kc.view(-1, hkv, d)[slots[:ctx]] = keys[:ctx]
    vc.view(-1, hkv, d)[slots[:ctx]] = values[:ctx]
    q = torch.randn(n, hq, d, generator=g)
    meta = PagedAttentionMetadata(
        num_decodes=0,
        slot_mapping=slots[ctx:],
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([ctx + n]),
        block_tables=torch.tensor([table]),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[ctx + n],
        max_seq_len=ctx + n,
        block_size=bs,
    )
    ref = dense_causal_attention(q, keys, values, d**-0.5)
    cache = _cache_on(cache, DEVICE)
    meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = _to(
        DEVICE, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables
    )
    out = ta.TritonPagedAttention(cache).forward(0, *_to(DEVICE, q, keys[ctx:], values[ctx:]), meta, d**-0.5)
    torch.testing.assert_close(out.cpu(), ref, **TOL)


def test_decode_num_splits_heuristic():
    assert ta.decode_num_splits(256, 8, 1000) == 1  # a full batch fills the GPU by itself
    assert ta.decode_num_splits(1, 8, 100) == 1  # too short to be worth a reduce
    assert ta.decode_num_splits(1, 8, 8192) == 16  # capped
    assert ta.decode_num_splits(4, 8, 2048) == 8  # by length: 2048 // 256


class PagedKVCacheClone:
    """A copy of a cache for the reference to write into (it has the same `layer` and `tensor`)."""

    def __init__(self, cache) -> None:
        self.tensor = cache.tensor.clone()
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks

    def layer(self, idx: int):
        return self.tensor[idx, 0], self.tensor[idx, 1]
