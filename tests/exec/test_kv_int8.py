"""The int8 KV cache (`kv_cache_dtype=int8`, exec/csrc/kv_int8.h): its rows hold each token's K/V
within half a quantization step, written alike whatever the calls' split; decode over it equals
decode over the float values it holds, bit for bit, in both the kernel's layouts; the PyTorch
reading path (prefill context, the decode fallback) reads the same values; non-finite rows read as
NaN; a block is about half a 16-bit one's bytes; and the fused decode step and the second KV tier
work over it."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.exec.paged_attention import INT8_GROUP, PagedKVCache, TorchPagedAttention, dequantize_int8_blocks
from pagoda.model.loader import load_model
from tests.conftest import hf_greedy, make_engine
from tests.exec.test_cpu_decode_kernel import _kernels
from tests.exec.test_paged_attention import build_batch
from tests.tiny_models import save_tiny_model

NB, BS, H, D = 12, 16, 3, 64


@pytest.fixture(scope="module")
def kernels():
    return _kernels()


def _cache() -> PagedKVCache:
    return PagedKVCache(1, NB, BS, H, D, torch.int8, torch.device("cpu"))


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Tokens of growing size and a few outlier channels, as real K rows have.
    k = torch.randn(n, H, D, generator=g) * torch.linspace(0.2, 4.0, n).view(n, 1, 1)
    k[:, :, 5] *= 20
    return k, torch.randn(n, H, D, generator=g)


def test_rows_hold_each_value_within_half_a_step_whatever_the_split(kernels):
    n = 40
    k, v = _rows(n)
    slots = torch.arange(n) + BS  # blocks 1-3, the last one partly
    whole = _cache()
    kernels.write_kv(*whole.layer(0), k, v, slots)
    split = _cache()
    for lo, hi in ((0, 1), (1, 17), (17, 18), (18, 40)):  # a prefill chunk, decodes, another chunk
        kernels.write_kv(*split.layer(0), k[lo:hi], v[lo:hi], slots[lo:hi])
    assert torch.equal(whole.tensor, split.tensor)
    for cache, want in zip(whole.layer(0), (k, v)):
        got = dequantize_int8_blocks(cache, D)[slots]
        groups = want.view(n, H, D // INT8_GROUP, INT8_GROUP)
        step = (groups.abs().amax(-1, keepdim=True) / 127).expand_as(groups).reshape(n, H, D)
        assert ((got - want).abs() <= 0.5 * step * 1.01 + 1e-6).all()  # fp16 scales: ~0.05 % looser


def test_bf16_rows_and_strided_views_are_written_alike(kernels):
    k, v = _rows(20, seed=1)
    fused = torch.cat([k, v], dim=1).bfloat16()  # rows of [K heads, V heads], as the fused QKV gives them
    slots = torch.arange(20) * 3 % (NB * BS)
    strided = _cache()
    kernels.write_kv(*strided.layer(0), fused[:, :H], fused[:, H:], slots)
    plain = _cache()
    kernels.write_kv(*plain.layer(0), k.bfloat16().contiguous(), v.bfloat16().contiguous(), slots)
    assert torch.equal(strided.tensor, plain.tensor)


@pytest.mark.parametrize("ctx_lens", [(1, 7, 16, 33, 64, 5), (1, 7, 16, 33, 64, 5, 2, 9, 40, 3, 17, 31)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_decode_over_the_values_it_holds(kernels, ctx_lens, dtype):
    """Each (sequence, KV head) an item (6 sequences) or each sequence one (12): both read the rows
    the kernel dequantizes, as a float cache of those values gives them."""
    ref, meta, q, _, _, _ = build_batch([(c, 1) for c in ctx_lens], num_blocks=256, seed=3)
    fk, fv = ref.layer(0)
    nb, bs, hkv, d = fk.shape
    cache = PagedKVCache(1, nb, bs, hkv, d, torch.int8, torch.device("cpu"))
    slots = torch.arange(nb * bs)
    kernels.write_kv(*cache.layer(0), fk.reshape(-1, hkv, d), fv.reshape(-1, hkv, d), slots)
    kc, vc = cache.layer(0)
    held_k = dequantize_int8_blocks(kc, d).view(nb, bs, hkv, d).contiguous()
    held_v = dequantize_int8_blocks(vc, d).view(nb, bs, hkv, d).contiguous()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernels.paged_decode(q.to(dtype), kc, vc, meta.block_tables, meta.seq_lens, d**-0.5)
        want = kernels.paged_decode(q.to(dtype), held_k, held_v, meta.block_tables, meta.seq_lens, d**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)
    # The PyTorch decode (gathering the int8 blocks through dequantize_int8_blocks) reads the same values.
    backend = TorchPagedAttention.__new__(TorchPagedAttention)
    backend.decode_kernel = None
    torch_path = backend._decode(q.float(), kc, vc, meta, d**-0.5)
    assert torch.allclose(torch_path, want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_a_non_finite_row_reads_as_nan_and_leaves_its_neighbours(kernels):
    cache = _cache()
    k, v = _rows(3, seed=2)
    k[1, 0, 3] = float("inf")
    v[1, 2, 40] = float("nan")
    kernels.write_kv(*cache.layer(0), k, v, torch.tensor([0, 1, 2]))
    kc, vc = cache.layer(0)
    got_k, got_v = dequantize_int8_blocks(kc, D), dequantize_int8_blocks(vc, D)
    assert got_k[1, 0, :INT8_GROUP].isnan().all() and not got_k[1, 0, INT8_GROUP:].isnan().any()
    assert got_v[1, 2, INT8_GROUP:].isnan().all() and not got_v[1, 2, :INT8_GROUP].isnan().any()
    assert not got_k[[0, 2]].isnan().any() and not got_v[[0, 2]].isnan().any()


def test_a_block_is_about_half_a_16bit_one():
    for head_dim in (64, 128):
        ratio = (PagedKVCache.bytes_per_block(30, 16, 3, head_dim, torch.int8)
                 / PagedKVCache.bytes_per_block(30, 16, 3, head_dim, torch.bfloat16))
        assert ratio == (head_dim + 2 * head_dim // INT8_GROUP) / (2 * head_dim)  # 0.531 at 64, 0.516 at 128
    cache = PagedKVCache(2, 4, 16, 3, 64, torch.int8, torch.device("cpu"))
    assert cache.tensor.numel() == 4 * PagedKVCache.bytes_per_block(2, 16, 3, 64, torch.int8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama3_int8_kv")
    hf = save_tiny_model("llama3", folder)
    return folder, hf


PROMPTS = [[1, 2, 3, 4] * 6 + [(i * 37 + j * 11) % 500 + 5 for j in range(26)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _clear_greedy(hf, prompt: list[int], n: int) -> list[int] | None:
    """transformers' n greedy tokens, or None if a choice among them is a near-tie (top-2 logits
    within 0.05: a tie that any rounding of K/V may flip)."""
    out = hf_greedy(hf, prompt, n)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
    top2 = torch.topk(logits, 2, dim=-1).values
    return out if float((top2[:, 0] - top2[:, 1]).min()) >= 0.05 else None


def test_engine_over_int8_kv_keeps_transformers_greedy_under_chunks_swap_and_a_second_tier(kernels, tiny):
    """Where a tiny random model's greedy choices are not near-ties the int8 cache keeps them, with
    chunked prefill, prefix caching, swap preemption and a host-memory tier all at work."""
    folder, hf = tiny
    loaded = load_model(str(folder), dtype="float32")
    clear = [(p, want) for p in PROMPTS if (want := _clear_greedy(hf, p, 10)) is not None]
    assert len(clear) >= 4
    llm = make_engine(loaded, kv_cache_dtype="int8", kv_offloading_size=0.01, preemption_mode="swap",
                      num_gpu_blocks_override=25, block_size=4, max_num_seqs=3, max_num_batched_tokens=32,
                      long_prefill_token_threshold=20)
    assert llm.engine.core.kv_cache.tensor.dtype == torch.int8
    for _ in range(2):  # the second round reads its prompts' blocks from the prefix cache and the tier
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in clear], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want for _, want in clear]
    s = llm.engine.core.stats()
    assert s.num_swaps_out > 0 and s.num_swaps_in > 0 and s.kv_offload_hits > 0


def test_fused_decode_over_int8_kv_equals_the_modules(kernels, tiny, monkeypatch):
    from tests.exec.test_fused_decode import _assert_fused_equals_modules, skip_bf16_without_packed_linears

    skip_bf16_without_packed_linears("bfloat16")
    folder, _ = tiny
    _assert_fused_equals_modules(lambda: load_model(str(folder), dtype="bfloat16"), monkeypatch,
                                 kv_cache_dtype="int8")


def test_int8_kv_is_refused_off_the_cpu_with_one_line(tiny):
    from pagoda.config import EngineArgs
    from pagoda.engine.kv_layout import kv_cache_dtype

    folder, _ = tiny
    loaded = load_model(str(folder), dtype="float32")
    with pytest.raises(ValueError, match="CPU only"):
        kv_cache_dtype(EngineArgs(model=str(folder), kv_cache_dtype="int8"), loaded, torch.device("cuda"))
