"""The fp8 (e4m3) KV cache of the Triton attention kernels (`--kv-cache-dtype fp8`): values are
stored divided by their layer's scale and clamped to e4m3's range, and decode and prefill over such
a cache equal the reference attention over the same rounded K/V multiplied back. Under Triton's
interpreter without a GPU (set up in test_triton_kernels.py), compiled on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from tests.exec import test_triton_kernels as tk  # noqa: F401  (TRITON_INTERPRET before triton)
from pagoda.exec import triton_attention as ta  # noqa: E402  (reloaded by tk when needed)
from pagoda.exec.paged_attention import PagedKVCache, TorchPagedAttention  # noqa: E402
from tests.exec.test_paged_attention import BS, D, HKV, build_batch  # noqa: E402

FP8 = torch.float8_e4m3fn


def _rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache gives back for x: x / scale clamped, rounded to e4m3, times scale."""
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def test_write_stores_scaled_clamped_e4m3():
    num_blocks, hkv, d = 4, 3, 12
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, num_blocks, BS, hkv, d, FP8, torch.device("cpu"))
    k = torch.randn(5, hkv, d, generator=g) * 30
    v = torch.randn(5, hkv, d, generator=g)
    k[0, 0, 0], v[2, 1, 1] = 5000.0, -900.0  # past 448 once scaled: clamped, never NaN
    slots = torch.tensor([3, -1, 10, 5, 15])  # of num_blocks * BS slots
    cache = tk._cache_on(cache, tk.DEVICE)
    kc, vc = cache.layer(0)
    ta.write_kv(kc, vc, *tk._to(tk.DEVICE, k, v, slots), k_scale=2.0, v_scale=0.5)
    kc, vc = kc.cpu(), vc.cpu()
    real = slots >= 0
    got_k = kc.view(-1, hkv, d)[slots[real]].float()
    got_v = vc.view(-1, hkv, d)[slots[real]].float()
    assert torch.equal(got_k, (k[real] / 2.0).clamp(-448, 448).to(FP8).float())
    assert torch.equal(got_v, (v[real] / 0.5).clamp(-448, 448).to(FP8).float())
    assert got_k[0, 0, 0] == 448 and got_v[1, 1, 1] == -448
    assert not got_k.isnan().any() and not got_v.isnan().any()
    written = kc.view(-1, hkv, d).float().abs().sum((1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [3, 5, 10, 15]  # slot -1's row is nowhere


@pytest.mark.parametrize("seed", range(3))
def test_backend_over_an_fp8_cache_equals_the_reference_over_its_values(seed):
    """Ragged decodes and prefills (some after a cached prefix) in one step, per-layer scales not 1."""
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 40), 1) for _ in range(rng.randint(1, 3))]
    prefills = [(rng.choice([0, rng.randint(1, 20)]), rng.randint(2, 30)) for _ in range(rng.randint(1, 2))]
    reqs = decodes + prefills
    cache32, meta, q, k, v, _ = build_batch(reqs, num_blocks=48, seed=200 + seed)
    k_scale, v_scale = 0.25, 3.0
    cache = PagedKVCache(1, cache32.num_blocks, BS, HKV, D, FP8, torch.device("cpu"))
    cache.kv_scales = [(k_scale, v_scale)]
    cache.tensor[0, 0] = (cache32.tensor[0, 0] / k_scale).to(FP8)  # the cached context, as written
    cache.tensor[0, 1] = (cache32.tensor[0, 1] / v_scale).to(FP8)
    cache32.tensor[0, 0] = cache.tensor[0, 0].float() * k_scale
    cache32.tensor[0, 1] = cache.tensor[0, 1].float() * v_scale
    backend = TorchPagedAttention(cache32)
    backend.decode_kernel = None
    want = backend.forward(0, q, _rounded(k, k_scale), _rounded(v, v_scale), meta, scale=D**-0.5)
    cache = tk._cache_on(cache, tk.DEVICE)
    meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = tk._to(
        tk.DEVICE, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    meta.max_query_len = max(n for _, n in reqs)
    got = ta.TritonPagedAttention(cache).forward(0, *tk._to(tk.DEVICE, q, k, v), meta, scale=D**-0.5)
    torch.testing.assert_close(got.cpu(), want, **tk.TOL)
    # This step's K/V went in as the reference rounded them.
    assert torch.equal(cache.tensor.cpu()[0, 0].float() * k_scale, cache32.tensor[0, 0])


def test_split_decode_applies_the_value_scale_once():
    """Four context parts merged by the reduce kernel: each part's output carries the V scale, so
    the merge (a weighted mean) must not apply it again."""
    cache32, meta, q, k, v, _ = build_batch([(70, 1), (9, 1)], num_blocks=32, seed=9)
    cache = PagedKVCache(1, 32, BS, HKV, D, FP8, torch.device("cpu"))
    backend = TorchPagedAttention(cache32)
    backend.decode_kernel = None
    backend.forward(0, q, k, v, meta, scale=D**-0.5)  # only to write this step's K/V rows into cache32
    cache.tensor[0, 0] = (cache32.tensor[0, 0] / 2.0).to(FP8)
    cache.tensor[0, 1] = (cache32.tensor[0, 1] / 0.5).to(FP8)
    ref = cache32.tensor.clone()
    ref[0, 0] = cache.tensor[0, 0].float() * 2.0
    ref[0, 1] = cache.tensor[0, 1].float() * 0.5
    cache32.tensor = ref
    want = backend.forward(0, q, ref[0, 0].view(-1, HKV, D)[meta.slot_mapping], ref[0, 1].view(-1, HKV, D)[meta.slot_mapping],
                           meta, scale=D**-0.5)
    kc, vc = tk._cache_on(cache, tk.DEVICE).layer(0)
    qd, bt, sl = tk._to(tk.DEVICE, q, meta.block_tables, meta.seq_lens)
    got = ta.paged_decode(qd, kc, vc, bt, sl, D**-0.5, 4, k_scale=2.0, v_scale=0.5)
    torch.testing.assert_close(got.cpu(), want, **tk.TOL)


def test_the_torch_backend_refuses_an_fp8_cache():
    cache = PagedKVCache(1, 4, BS, HKV, D, FP8, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs the Triton kernels"):
        TorchPagedAttention(cache)
