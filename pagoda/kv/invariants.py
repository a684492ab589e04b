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

    pins = kv.tier.pinned_blocks() if kv.tier is not None else {}
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0, f"negative ref count: {block}"
        expected = refs[block.block_id] + pins.get(block.block_id, 0)
        assert block.ref_cnt == expected, f"ref count != table references + copies in flight: {block}"
        assert (block.ref_cnt == 0) == (block.block_id in free_set), f"free xor used broken: {block}"
        if block.ref_cnt == 0 and block.block_id not in cached_ids:
            assert block.block_hash is None, f"a hashed free block outside the cached queue: {block}"
        if refs[block.block_id] > 1:
            # Blocks are only shared through prefix-cache hits.
            assert block.block_hash is not None, f"shared block without a hash: {block}"
    assert len(free_set) + len(set(refs) | set(pins)) == pool.num_usable_blocks, "free + in use != total"

    table = pool.cached_block_hash_to_block
    for h, block in table.items():
        assert block.block_hash == h, f"map entry {h} points at {block}"
    assert sum(b.block_hash is not None for b in pool.blocks) == len(table)
    if not kv.enable_prefix_caching:
        assert not table
    if kv.tier is not None:
        check_tier_invariants(kv)


def check_tier_invariants(kv: KVCacheManager) -> None:
    """The second tier: slots in one place each; a copy in flight has its block pinned and its entry
    unreadable; a load reads a ready, pinned entry into a block of a request's table; a swapped-out
    request's entries are pinned and it holds no blocks."""
    tm = kv.tier
    tier = tm.tier
    tier.check()
    table_blocks = {b for ids in kv.req_to_block_ids.values() for b in ids}
    save_slots, load_slots = [], []
    for orders in (tm.pending, tm.in_step):
        for transfer, entry, block in orders.saves:
            assert block.ref_cnt >= 1 and block.block_id == transfer.block_id
            assert not entry.ready and entry.slot == transfer.slot and entry.key == transfer.block_hash
            save_slots.append(transfer.slot)
        for transfer, entry in orders.saves_first:
            assert not entry.ready and entry.slot == transfer.slot and entry.key == transfer.block_hash
            save_slots.append(transfer.slot)
        for transfer, entry in orders.loads:
            assert entry.ready and entry.pins >= 1 and entry.slot == transfer.slot, f"load of {entry}"
            assert transfer.block_id in table_blocks, "a load into a block no request holds"
            load_slots.append(transfer.slot)
    assert len(set(save_slots)) == len(save_slots), "two copies into one slot"
    assert not set(save_slots) & set(load_slots), "a slot read while it is written"
    pins: Counter[int] = Counter()
    for rid, state in tm.swapped.items():
        assert rid not in kv.req_to_blocks, f"{rid} is swapped out but holds blocks"
        for entry in state.entries:
            assert tier.entries.get(entry.key) is entry, f"{rid}: swapped entry lost"
            pins[id(entry)] += 1
    for orders in (tm.pending, tm.in_step):
        for _, entry in orders.loads:
            pins[id(entry)] += 1
    for entry in tier.entries.values():
        assert entry.pins == pins[id(entry)], f"pins of {entry} != swaps + loads holding it"
