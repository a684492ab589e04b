"""The workload the parallel executors are held to: greedy outputs equal to one rank's under chunked
prefill, prefix caching and preemption."""

from __future__ import annotations

from pagoda import LLM
from pagoda.sampling_params import SamplingParams

# 24 blocks of 16 tokens for 8 requests of up to 114 tokens: some must be preempted; a 64-token
# budget chunks every prompt longer than that.
WORKLOAD_ENGINE_ARGS = dict(dtype="float32", num_gpu_blocks_override=24, max_num_batched_tokens=64, max_num_seqs=8)


def workload(llm: LLM) -> tuple[list[list[int]], int]:
    """Greedy outputs of prompts sharing a 48-token prefix and two others; and the preemptions."""
    shared = list(range(10, 58))
    prompts = [shared + [i, i + 1] for i in range(60, 66)] + [list(range(100, 190)), [7, 8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.core.stats()
    assert stats.prefix_cache_hits > 0  # the shared prefix was served from the cache
    return [o.outputs[0].token_ids for o in outs], stats.num_preemptions
