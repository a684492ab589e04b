"""Consistency checks of the KV state, for tests and debugging (O(num_blocks): not for the hot path)."""

from __future__ import annotations

from collections import Counter

from pagoda.kv.block_pool import NULL_BLOCK_ID
from pagoda.kv.manager import KVCacheManager


def check_kv_invariants(kv: KVCacheManager) -> None:
    """Raise AssertionError unless every block is in exactly one consistent place."""
    pool = kv.block_pool
    free = pool.free_block_ids()
    free_set = set(free)
    assert len(free) == len(free_set) == pool.get_num_free_blocks(), "free lists corrupt"
    cached_free = [b for b in pool.cached_free.get_all_free_blocks()]
    assert all(b.block_hash is not None for b in cached_free), "a block without a hash among the cached free"
    cached_ids = {b.block_id for b in cached_free}
    assert NULL_BLOCK_ID not in free_set, "null block in the free queue"
    null = pool.null_block
    assert null.ref_cnt == 0 and null.block_hash is None

    assert kv.req_to_blocks.keys() == kv.req_to_block_ids.keys() == kv.num_cached_blocks.keys()
    refs: Counter[int] = Counter()
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert ids == kv.req_to_block_ids[rid], f"{rid}: block id list out of sync"
        assert len(set(ids)) == len(ids), f"{rid}: a block twice in one table"
        assert NULL_BLOCK_ID not in ids, f"{rid}: null block in a table"
        assert 0 <= kv.num_cached_blocks[rid] <= len(ids)
        refs.update(ids)

    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0, f"negative ref count: {block}"
        assert block.ref_cnt == refs[block.block_id], f"ref count != table references: {block}"
        assert (block.ref_cnt == 0) == (block.block_id in free_set), f"free xor used broken: {block}"
        if block.ref_cnt == 0 and block.block_id not in cached_ids:
            assert block.block_hash is None, f"a hashed free block outside the cached queue: {block}"
        if block.ref_cnt > 1:
            # Blocks are only shared through prefix-cache hits.
            assert block.block_hash is not None, f"shared block without a hash: {block}"
    assert len(free_set) + len(refs) == pool.num_usable_blocks, "free + in use != total"

    table = pool.cached_block_hash_to_block
    for h, block in table.items():
        assert block.block_hash == h, f"map entry {h} points at {block}"
    assert sum(b.block_hash is not None for b in pool.blocks) == len(table)
    if not kv.enable_prefix_caching:
        assert not table
