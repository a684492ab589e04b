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
    cached = pool.cached_free.num_free_blocks
    assert cached == pool.max_cached_free_blocks and pool.num_reusable_blocks > 0
    # Long after the burst, the trimmer gives every reusable block's pages back, and only those.
    released = core.trim_kv_memory(time.monotonic() + 3600)
    assert released > 0 and pool.num_reusable_blocks == 0 and pool.num_touched_blocks == cached
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
    llm = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=80, block_size=16)
    core = llm.engine.core
    cap = max_cached_free_blocks(80)
    assert core.kv_manager.block_pool.max_cached_free_blocks == cap == 10
    # 30 unique prompts of 3 full blocks each: far more cached content than the cap keeps.
    _greedy(llm, [[(i * 31 + j) % 200 + 3 for j in range(49)] for i in range(30)], n=2)
    pool = core.kv_manager.block_pool
    assert pool.cached_free.num_free_blocks == cap
    assert pool.num_touched_blocks < 79
    check_kv_invariants(core.kv_manager)
