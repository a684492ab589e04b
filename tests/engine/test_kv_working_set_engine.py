"""The engine's KV working set on the CPU: the memory of free blocks goes back to the OS after a
burst, and requests that reuse those blocks afterwards compute exactly what they would have."""

from __future__ import annotations

import time

from pagoda.exec.cpu_kv_sizing import max_cached_free_blocks
from pagoda.kv.invariants import check_kv_invariants
from pagoda.sampling_params import SamplingParams
from tests.conftest import make_engine


def _greedy(llm, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_released_blocks_are_reused_without_changing_greedy_output(tiny_llama3_fp32):
    # Prefix caching on: the cached prompt blocks must survive a release of the reusable ones (a
    # release of the wrong pages would change the second run, which hits them).
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=256, block_size=16)
    core = llm.engine.core
    prompts = [[(7 * i + j) % 200 + 3 for j in range(40 + 5 * i)] for i in range(12)]
    first = _greedy(llm, prompts)
    pool = core.kv_manager.block_pool
    cap = pool.max_cached_free_blocks
    assert pool.cached_free.num_free_blocks > cap and pool.num_reusable_blocks > 0
    # Long after the burst, the trimmer evicts the cached blocks beyond the cap and gives every
    # reusable block's pages back, and only those.
    released = core.trim_kv_memory(time.monotonic() + 3600)
    assert released > 0 and pool.num_reusable_blocks == 0
    assert pool.cached_free.num_free_blocks == cap and pool.num_touched_blocks == cap
    check_kv_invariants(core.kv_manager)
    # The same requests again: hits on the kept prefixes, new KV on released (zero-read) memory.
    assert _greedy(llm, prompts) == first
    assert core.kv_manager.prefix_cache_stats.hits > 0
    check_kv_invariants(core.kv_manager)


def test_release_while_a_request_runs_leaves_it_unchanged(tiny_llama3_fp32):
    long_prompt = [(5 * j) % 190 + 4 for j in range(70)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=128, block_size=16)
    expected = reference.generate([{"prompt_token_ids": long_prompt}], params)[0].outputs[0].token_ids
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=128, block_size=16, enable_prefix_caching=False)
    eng, core = llm.engine, llm.engine.core
    _greedy(llm, [[(3 * i + j) % 150 + 3 for j in range(50)] for i in range(8)], n=4)  # leaves reusable blocks
    eng.add_request({"prompt_token_ids": long_prompt}, params, request_id="long")
    for _ in range(3):
        eng.step()
    assert core.trim_kv_memory(time.monotonic() + 3600) > 0
    outputs = []
    while eng.has_unfinished_requests():
        outputs += [o for o in eng.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == expected


def test_cpu_engine_bounds_the_cached_free_blocks(tiny_llama3_fp32):
    # Two at a time: at most 8 blocks in use (3 full prompt blocks and a partial one each).
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=80, block_size=16, max_num_seqs=2)
    core = llm.engine.core
    cap = max_cached_free_blocks(80)
    assert core.kv_manager.block_pool.max_cached_free_blocks == cap == 10
    # 30 unique prompts of 3 full blocks each: far more cached content than the cap keeps.
    _greedy(llm, [[(i * 31 + j) % 200 + 3 for j in range(49)] for i in range(30)], n=2)
    pool = core.kv_manager.block_pool
    # Cached blocks beyond the cap were evicted rather than fresh ones written: not the whole pool.
    assert pool.num_touched_blocks <= 8 + cap + 1
    core.trim_kv_memory(time.monotonic() + 3600)
    assert pool.cached_free.num_free_blocks == cap
    check_kv_invariants(core.kv_manager)
