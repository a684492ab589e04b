"""The workload the parallel executors are held to: greedy outputs equal to one rank's under chunked
prefill, prefix caching and preemption; and how a test's own gloo rank process ends."""

from __future__ import annotations

import os

import torch

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


def end_rank(rank: int, queue, out) -> None:
    """A test's rank process: rank 0 sends `out`, then every rank leaves the group and exits at once.

    Skipping the interpreter's teardown: gloo's threads were seen to abort it now and then (SIGABRT,
    "terminate called without an active exception") after all the work was done and sent."""
    import torch.distributed as dist

    if rank == 0:
        queue.put(out)
        queue.close()
        queue.join_thread()  # sent before the process ends
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@torch.inference_mode()
def prompt_and_decode_logits(model) -> torch.Tensor:
    """[9, vocab] logits of `model` over a 7-token prompt and two decode steps after it, through the
    contiguous reference cache: what a rank's shard and the whole model are compared on."""
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata

    backend = ContiguousKVBackend()
    ids = [3, 17, 250, 9, 101, 44, 500]
    h = model(torch.tensor(ids), torch.arange(len(ids)), AttentionContext(backend, ContiguousMetadata([0], [len(ids)])))
    rows = [model.compute_logits(h)]
    for pos, tok in ((7, 12), (8, 480)):
        h = model(torch.tensor([tok]), torch.tensor([pos]), AttentionContext(backend, ContiguousMetadata([0], [1])))
        rows.append(model.compute_logits(h))
    return torch.cat(rows)
