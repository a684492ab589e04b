"""The second KV tier's bookkeeping with exact values: LRU slots that are never evicted or read while
a copy is in flight or a load needs them; freed published blocks copied down (pinned until the step
has run, or first when the step needs the room); a lookup that continues in the second tier where
the first tier's prefix ends, and its hit statistics in tokens."""

from __future__ import annotations

import pytest
from kv_helpers import admit, make_request

from pagoda.contracts.step import SchedulerOutput
from pagoda.kv import KVCacheManager
from pagoda.kv.invariants import check_kv_invariants
from pagoda.kv.offload import SecondTier


def test_lru_eviction_skips_entries_being_written_and_pinned():
    tier = SecondTier(3)
    a, b, c = tier.reserve(10), tier.reserve(11), tier.reserve(12)
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    assert tier.reserve(13) is None  # all three are being written: none can be evicted
    assert tier.lookup(10) is None  # nor read
    for e in (a, b, c):
        tier.complete(e)
    tier.pin(a)  # a load needs it
    tier.touch(b)  # b used last
    d = tier.reserve(13)
    assert d.slot == c.slot and 12 not in tier  # c: least recently used and unpinned
    tier.check()
    tier.drop(d)  # dropped while being written: its slot stays busy until the copy completes
    assert tier.num_free_slots == 0 and 13 not in tier
    tier.complete(d)
    assert tier.free_slot_ids() == [2]
    tier.unpin(a)
    tier.check()
    with pytest.raises(RuntimeError, match="unpinned more often"):
        tier.unpin(a)


def _step(kv: KVCacheManager, failed=()) -> SchedulerOutput:
    out = SchedulerOutput()
    kv.take_transfers(out)
    check_kv_invariants(kv)
    kv.transfers_done(list(failed))
    check_kv_invariants(kv)
    return out


def test_freed_blocks_are_copied_down_and_a_later_lookup_loads_what_the_first_tier_lost():
    kv = KVCacheManager(9, 4, offload=SecondTier(16))  # 8 usable blocks of 4 tokens, 16 slots
    a = make_request("a", list(range(100, 117)))  # 17 tokens: 4 full blocks and a partial one
    admit(kv, a)
    a_blocks = list(kv.get_block_ids("a"))
    kv.free(a)
    # The 4 published blocks are pinned for their copy; the partial one is free at once.
    assert kv.num_free_blocks == 4 and [b.ref_cnt for b in kv.block_pool.blocks[1:6]] == [1, 1, 1, 1, 0]
    out = _step(kv)
    assert [(t.block_id, t.slot) for t in out.kv_saves] == list(zip(a_blocks[:4], range(4)))
    assert out.kv_saves_first == [] and kv.num_free_blocks == 8 and kv.tier.stats.saved_blocks == 4
    # Another request takes every block: a's prefix is evicted from the first tier.
    filler = make_request("f", list(range(500, 532)))
    admit(kv, filler)
    kv.free(filler)
    assert not any(kv.block_pool.get_cached_block(h) for h in a.block_hashes)
    _step(kv)
    again = make_request("a2", list(range(100, 117)) + [1, 2])
    hits, num_hit = kv.get_computed_blocks(again)
    assert (hits, num_hit) == ([], 16)
    new_ids = kv.allocate_slots(again, again.num_tokens - num_hit, hits)
    out = _step(kv)
    assert [(t.slot, t.block_id) for t in out.kv_loads] == list(zip(range(4), new_ids[:4]))
    # Loaded blocks are published at once (the load runs before the forward) and count as cached.
    assert kv.num_cached_blocks["a2"] == 4 and kv.block_pool.get_cached_block(again.block_hashes[0]) is not None
    stats = kv.tier.stats
    # Queried at each admission: the tokens the first tier missed (a, the filler, a2).
    assert (stats.queries, stats.hits, stats.loaded_blocks) == (17 + 32 + 19, 16, 4)
    kv.free(again)
    _step(kv)
    assert kv.num_free_blocks == 8 and not kv.has_pending_transfers()


def test_a_step_that_needs_the_pinned_blocks_copies_them_first():
    kv = KVCacheManager(5, 4, offload=SecondTier(8))  # 4 usable blocks
    a = make_request("a", list(range(100, 116)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 0  # all four pinned by their copies
    b = make_request("b", list(range(200, 212)))
    hits, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None  # the copies go first instead
    out = _step(kv)
    assert len(out.kv_saves_first) == 4 and out.kv_saves == []
    assert kv.tier.stats.saved_blocks == 4


def test_a_failed_save_leaves_nothing_readable():
    kv = KVCacheManager(9, 4, offload=SecondTier(8))
    a = make_request("a", list(range(100, 109)))
    admit(kv, a)
    kv.free(a)
    out = SchedulerOutput()
    kv.take_transfers(out)
    failed = out.kv_saves[0].slot
    kv.transfers_done([failed])
    check_kv_invariants(kv)
    assert kv.tier.stats.failed_saves == 1 and kv.tier.tier.lookup(a.block_hashes[0]) is None
    assert kv.tier.tier.lookup(a.block_hashes[1]) is not None and failed in kv.tier.tier.free_slot_ids()
