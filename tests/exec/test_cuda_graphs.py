"""CUDA-graph decode: capture sizes, padding (docs/testing.md C.5: padding rows write no KV and their
outputs are ignored), and, on a GPU only, capture and replay against eager execution."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.attn_metadata import PagedAttentionMetadata
from pagoda.exec.cuda_graphs import DecodeBuffers, capture_sizes, padded_batch_size
from pagoda.exec.paged_attention import PagedKVCache, TorchPagedAttention
from pagoda.model.attention import AttentionContext
from pagoda.model.loader import load_model
from tests.tiny_models import save_tiny_model

BS = 16


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = capture_sizes(256)
    assert sizes[:11] == capture_sizes(64) and sizes[11:] == list(range(80, 257, 16))
    assert capture_sizes(100)[-2:] == [96, 100]  # max_num_seqs itself always has a graph


def test_padded_batch_size():
    sizes = capture_sizes(40)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 40)] == [1, 2, 4, 8, 8, 16, 24, 40]
    assert padded_batch_size(41, sizes) is None  # beyond the largest graph: eager


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_graphs")
    save_tiny_model("qwen3", folder)  # GQA: 4 query heads over 2 KV heads, head_dim 32
    return folder


def _prefilled(loaded, ctx_lens: list[int], device: torch.device, backend_cls):
    """A KV cache holding each sequence's prompt, plus the decode step that follows (eager inputs)."""
    cfg = loaded.config
    cache = PagedKVCache(cfg.num_hidden_layers, 32, BS, cfg.num_key_value_heads, cfg.head_dim, torch.float32, device)
    backend = backend_cls(cache)
    g = torch.Generator().manual_seed(0)
    tables, next_block = [], 3  # blocks in no particular order, away from the null block
    for n in ctx_lens:
        nb = (n + 1 + BS - 1) // BS
        tables.append(list(range(next_block + nb - 1, next_block - 1, -1)))
        next_block += nb
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)

    def slot(i: int, p: int) -> int:
        return tables[i][p // BS] * BS + p % BS

    for i, n in enumerate(ctx_lens):  # one prefill per sequence
        meta = PagedAttentionMetadata(
            num_decodes=0,
            slot_mapping=torch.tensor([slot(i, p) for p in range(n)], device=device),
            query_start_loc=torch.tensor([0, n], device=device),
            seq_lens=torch.tensor([n], device=device),
            block_tables=bt[i : i + 1],
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n],
            max_seq_len=n,
            block_size=BS,
            max_query_len=n,
        )
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).to(device)
        loaded.model(ids, torch.arange(n, device=device), AttentionContext(backend, meta))
    lens = [n + 1 for n in ctx_lens]
    meta = PagedAttentionMetadata(
        num_decodes=len(ctx_lens),
        slot_mapping=torch.tensor([slot(i, n) for i, n in enumerate(ctx_lens)], device=device),
        query_start_loc=torch.arange(len(ctx_lens) + 1, device=device),
        seq_lens=torch.tensor(lens, device=device),
        block_tables=bt,
        query_start_loc_cpu=list(range(len(ctx_lens) + 1)),
        seq_lens_cpu=lens,
        max_seq_len=max(lens),
        block_size=BS,
        max_query_len=1,
    )
    ids = torch.randint(0, cfg.vocab_size, (len(ctx_lens),), generator=g).to(device)
    return cache, backend, ids, torch.tensor(ctx_lens, device=device), meta


@pytest.mark.parametrize("cpp_decode", [True, False])
@pytest.mark.parametrize("ctx_lens,size", [([5, 16, 9], 4), ([30], 8), ([3, 7], 2)])
@torch.inference_mode()
def test_padded_decode_equals_unpadded_and_writes_only_real_slots(tiny_qwen3, ctx_lens, size, cpp_decode):
    loaded = load_model(str(tiny_qwen3), dtype="float32")
    cache, backend, ids, pos, meta = _prefilled(loaded, ctx_lens, torch.device("cpu"), TorchPagedAttention)
    if not cpp_decode:
        backend.decode_kernel = None
    before = cache.tensor.clone()
    ref = loaded.model(ids, pos, AttentionContext(backend, meta))
    after_ref = cache.tensor.clone()

    cache.tensor.copy_(before)
    # Stale rows from an earlier, larger batch must not leak into the padding.
    buffers = DecodeBuffers(8, 4, BS, torch.device("cpu"))
    buffers.block_tables.fill_(7)
    buffers.slot_mapping.fill_(5)
    pids, ppos, pmeta = buffers.fill(ids, pos, meta, size)
    assert pmeta.num_decodes == size and pids.shape[0] == size
    assert pmeta.slot_mapping[len(ctx_lens) :].eq(-1).all()
    assert pmeta.seq_lens[len(ctx_lens) :].eq(1).all() and pmeta.block_tables[len(ctx_lens) :, 0].eq(0).all()
    out = loaded.model(pids, ppos, AttentionContext(backend, pmeta))
    torch.testing.assert_close(out[: len(ctx_lens)], ref, atol=1e-5, rtol=1e-5)
    # The KV cache changed exactly where the unpadded step wrote: the real rows' slots (their values
    # equal up to rounding, as a matmul of 4 rows may round differently from one of 3).
    torch.testing.assert_close(cache.tensor, after_ref, atol=1e-5, rtol=1e-5)
    changed = (cache.tensor != before).flatten(4).any(-1)  # [layers, 2, blocks, block_size]
    slots = set(changed.flatten(2).any(0).any(0).nonzero().flatten().tolist())
    assert slots == set(meta.slot_mapping.tolist())


def test_cpu_runner_never_uses_graphs(tiny_qwen3):
    from pagoda.exec.model_runner import ModelRunner

    loaded = load_model(str(tiny_qwen3), dtype="float32")
    cfg = loaded.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, BS, cfg.num_key_value_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, cache, cfg.vocab_size, 4, 64, torch.device("cpu"), enforce_eager=False)
    assert runner.graphs is None and isinstance(runner.backend, TorchPagedAttention)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda
@torch.inference_mode()
def test_graph_replay_equals_eager_on_cuda(tiny_qwen3):
    from pagoda.exec.cuda_graphs import CUDAGraphDecoder
    from pagoda.exec.triton_attention import TritonPagedAttention

    dev = torch.device("cuda")
    loaded = load_model(str(tiny_qwen3), dtype="float32", device=dev)
    for ctx_lens in ([5, 16, 9], [300, 2, 17, 64, 1, 33, 90, 8]):
        cache, backend, ids, pos, meta = _prefilled(loaded, ctx_lens, dev, TritonPagedAttention)
        before = cache.tensor.clone()
        ref = loaded.model(ids, pos, AttentionContext(backend, meta))
        after_ref = cache.tensor.clone()
        cache.tensor.copy_(before)
        graphs = CUDAGraphDecoder(loaded.model, backend, max_num_seqs=8, max_model_len=512, block_size=BS, device=dev)
        graphs.capture()
        assert torch.equal(cache.tensor, before)  # capturing wrote nothing
        assert graphs.can_run(len(ctx_lens), len(ctx_lens))
        out = graphs.run(ids, pos, meta)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(cache.tensor, after_ref)


@cuda
def test_engine_greedy_same_with_and_without_graphs(tiny_qwen3):
    from pagoda import SamplingParams
    from pagoda.config import EngineArgs
    from pagoda.engine.llm import LLM
    from pagoda.engine.llm_engine import LLMEngine

    loaded = load_model(str(tiny_qwen3), dtype="float32", device="cuda")
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for eager in (True, False):
        args = EngineArgs(device="cuda", num_gpu_blocks_override=64, max_num_seqs=8, max_model_len=256, enforce_eager=eager)
        llm = LLM.from_engine(LLMEngine(args, loaded=loaded, tokenizer=None))
        assert (llm.engine.core.runner.graphs is None) == eager
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
