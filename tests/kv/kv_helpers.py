"""Helpers for KV-manager tests: requests and a stand-in for 'the forward pass computed them'."""

from __future__ import annotations

from pagoda.kv import KVCacheManager
from pagoda.sampling_params import SamplingParams
from pagoda.sched.request import Request


def make_request(rid: str, tokens: list[int], extra_keys: tuple = ()) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), extra_keys=extra_keys)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does at admission: look up, allocate, then the step computes the tokens."""
    hits, num_hit = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit
    new_ids = kv.allocate_slots(request, num_new, hits)
    if new_ids is None:
        return None
    request.num_computed_tokens = num_hit
    compute(kv, request, num_new)
    return new_ids


def compute(kv: KVCacheManager, request: Request, num_new: int) -> None:
    """The step ran: the KV of num_new more tokens is written, so newly full blocks are published."""
    request.num_computed_tokens += num_new
    kv.cache_blocks(request)


def free_ids(kv: KVCacheManager) -> list[int]:
    return kv.block_pool.free_block_ids()


def ref_counts(kv: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in kv.block_pool.blocks if b.ref_cnt}


def hashes(kv: KVCacheManager) -> dict[int, object]:
    return {b.block_id: b.block_hash for b in kv.block_pool.blocks if b.block_hash is not None}
