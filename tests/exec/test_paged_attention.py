"""The paged attention backend equals dense reference attention on random ragged batches."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.paged_attention import PagedKVCache, TorchPagedAttention, write_kv
from pagoda.model.attention import dense_causal_attention

BS, HQ, HKV, D = 4, 4, 2, 8


def build_batch(reqs: list[tuple[int, int]], num_blocks: int, seed: int):
    """reqs: (context already cached, new query tokens), decodes (q=1) first as the runner orders them."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, BS, HKV, D, torch.float32, torch.device("cpu"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # block tables in shuffled block order
    tables, ctx_kv, slots, qsl, lens = [], [], [], [0], []
    for ctx, q in reqs:
        n_blocks = (ctx + q + BS - 1) // BS
        table = [free.pop() for _ in range(n_blocks)]
        tables.append(table)
        k = torch.randn(ctx, HKV, D, generator=g)
        v = torch.randn(ctx, HKV, D, generator=g)
        ctx_slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(ctx)], dtype=torch.long)
        kc, vc = cache.layer(0)
        write_kv(kc, vc, k, v, ctx_slots)
        ctx_kv.append((k, v))
        slots += [table[p // BS] * BS + p % BS for p in range(ctx, ctx + q)]
        qsl.append(qsl[-1] + q)
        lens.append(ctx + q)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = PagedAttentionMetadata(
        num_decodes=sum(1 for _, q in reqs if q == 1),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(lens),
        block_tables=bt,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        max_seq_len=max(lens),
        block_size=BS,
    )
    total = qsl[-1]
    q = torch.randn(total, HQ, D, generator=g)
    k = torch.randn(total, HKV, D, generator=g)
    v = torch.randn(total, HKV, D, generator=g)
    return cache, meta, q, k, v, ctx_kv


@pytest.mark.parametrize("seed", range(6))
def test_paged_equals_dense_on_ragged_batches(seed):
    rng = random.Random(seed)
    decodes = [(rng.randint(1, 30), 1) for _ in range(rng.randint(0, 5))]
    prefills = [(rng.choice([0, 0, rng.randint(1, 20)]), rng.randint(2, 17)) for _ in range(rng.randint(1, 4))]
    reqs = decodes + prefills
    cache, meta, q, k, v, ctx_kv = build_batch(reqs, num_blocks=128, seed=seed)
    out = TorchPagedAttention(cache).forward(0, q, k, v, meta, scale=D**-0.5)
    for i, ((ck, cv), (ctx, n)) in enumerate(zip(ctx_kv, reqs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        keys = torch.cat([ck, k[s:e]])
        values = torch.cat([cv, v[s:e]])
        ref = dense_causal_attention(q[s:e], keys, values, D**-0.5)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)
    # The new K/V landed at their slots.
    kc, _ = cache.layer(0)
    flat = kc.view(-1, HKV, D)
    torch.testing.assert_close(flat[meta.slot_mapping], k)


def test_cache_layer_views_follow_the_tensor():
    # layer() hands out views built once; a cache whose tensor is replaced (moved to another device,
    # say) must hand out views of the new one.
    cache = PagedKVCache(2, num_blocks=4, block_size=BS, num_kv_heads=HKV, head_dim=D, dtype=torch.float32, device="cpu")
    k1, v1 = cache.layer(1)
    assert k1.data_ptr() == cache.tensor[1, 0].data_ptr() and v1.data_ptr() == cache.tensor[1, 1].data_ptr()
    cache.tensor = cache.tensor.clone()
    k1, v1 = cache.layer(1)
    assert k1.data_ptr() == cache.tensor[1, 0].data_ptr() and v1.data_ptr() == cache.tensor[1, 1].data_ptr()
