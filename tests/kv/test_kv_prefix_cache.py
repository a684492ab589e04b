"""docs/testing.md section B: the KV cache manager and the prefix cache, with exact block ids.

Block 0 is the null block, so the first usable block is 1. block_size is 4 throughout.
"""

from __future__ import annotations

from kv_helpers import admit, compute, free_ids, hashes, make_request, ref_counts

from pagoda.kv import KVCacheManager, hash_block_tokens, sha256_hash_block_tokens

BS = 4


def test_b1_full_miss_allocation_order_and_chained_hashes():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = make_request("r", list(range(10)), extra_keys=("salt",))
    assert kv.get_computed_blocks(r) == ([], 0)
    assert kv.allocate_slots(r, 10) == [1, 2, 3]
    assert kv.get_block_ids("r") == [1, 2, 3]
    # Nothing is published before the step that computes the tokens has run.
    assert hashes(kv) == {}
    compute(kv, r, 10)

    h1 = hash_block_tokens(None, [0, 1, 2, 3], ("salt",))
    h2 = hash_block_tokens(h1, [4, 5, 6, 7], ("salt",))
    assert r.block_hashes == [h1, h2]
    assert hashes(kv) == {1: h1, 2: h2}  # block 3 holds 2 tokens: a partial tail has no hash
    assert kv.block_pool.cached_block_hash_to_block == {h1: kv.block_pool.blocks[1], h2: kv.block_pool.blocks[2]}
    assert ref_counts(kv) == {1: 1, 2: 1, 3: 1}
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]
    assert kv.num_free_blocks == 6
    assert kv.usage == 3 / 9


def test_b1_chain_depends_on_parent():
    # Same tokens in block 2, different block 1: different hash for block 2.
    a = make_request("a", [0, 1, 2, 3, 9, 9, 9, 9])
    b = make_request("b", [5, 1, 2, 3, 9, 9, 9, 9])
    a.bind_block_hashing(BS)
    b.bind_block_hashing(BS)
    assert a.block_hashes[1] != b.block_hashes[1]


def test_b2_hit_while_running_shares_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    assert admit(kv, r1) == [1, 2, 3]
    r2 = make_request("r2", list(range(8)) + [100, 101])
    blocks, num_hit = kv.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [1, 2] and num_hit == 8
    assert kv.allocate_slots(r2, 2, blocks) == [4]
    assert kv.get_block_ids("r2") == [1, 2, 4]
    assert ref_counts(kv) == {1: 2, 2: 2, 3: 1, 4: 1}
    assert free_ids(kv) == [5, 6, 7, 8, 9]


def test_b2_hit_after_finish_takes_blocks_out_of_free_queue():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    admit(kv, r1)
    kv.free(r1)
    # The partial tail holds no cached prefix: it is handed out before never-used blocks.
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    r2 = make_request("r2", list(range(8)) + [100, 101])
    assert admit(kv, r2) == [3]
    assert kv.get_block_ids("r2") == [1, 2, 3]
    assert ref_counts(kv) == {1: 1, 2: 1, 3: 1}
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9]


def test_b3_free_order_is_eviction_order():
    kv = KVCacheManager(num_blocks=11, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    r2 = make_request("r2", list(range(8)) + [50, 51])
    assert admit(kv, r1) == [1, 2, 3]
    assert admit(kv, r2) == [4]  # shares blocks 1 and 2
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10]
    kv.free(r1)
    # Only r1's tail reaches 0; the shared prefix is still held by r2.
    assert free_ids(kv) == [3, 5, 6, 7, 8, 9, 10]
    assert ref_counts(kv) == {1: 1, 2: 1, 4: 1}
    kv.free(r2)
    # Tails (no cached prefix), the last freed first; then never-used blocks; then the cached
    # shared prefix, freed in reverse (1 is evicted last).
    assert free_ids(kv) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
    assert ref_counts(kv) == {}
    assert kv.req_to_blocks == {} and kv.req_to_block_ids == {} and kv.num_cached_blocks == {}


def test_b4_decode_allocates_only_when_a_block_fills():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = make_request("r", [10, 11, 12, 13, 14, 15])
    assert admit(kv, r) == [1, 2]
    h1 = r.block_hashes[0]
    assert hashes(kv) == {1: h1}

    r.append_output_token_ids(16)  # position 6 lies in block 2
    assert kv.allocate_slots(r, 1) == []
    compute(kv, r, 1)
    assert hashes(kv) == {1: h1}

    r.append_output_token_ids(17)  # position 7 fills block 2
    assert len(r.block_hashes) == 2
    assert kv.allocate_slots(r, 1) == []
    assert hashes(kv) == {1: h1}  # full, but not computed yet
    compute(kv, r, 1)
    h2 = hash_block_tokens(h1, [14, 15, 16, 17])
    assert r.block_hashes == [h1, h2]
    assert hashes(kv) == {1: h1, 2: h2}

    r.append_output_token_ids(18)  # position 8 needs a third block
    assert kv.allocate_slots(r, 1) == [3]
    assert kv.get_block_ids("r") == [1, 2, 3]


def test_b5_evicted_block_loses_its_hash():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    r1 = make_request("r1", list(range(8)))
    admit(kv, r1)
    h1, h2 = r1.block_hashes
    assert hashes(kv) == {1: h1, 2: h2}
    kv.free(r1)
    assert free_ids(kv) == [3, 4, 2, 1]

    r2 = make_request("r2", [90 + i for i in range(12)])
    assert kv.allocate_slots(r2, 12) == [3, 4, 2]  # block 2 (r1's tail) is evicted
    assert hashes(kv) == {1: h1}
    assert kv.block_pool.cached_block_hash_to_block == {h1: kv.block_pool.blocks[1]}
    # The chain now breaks at block 2: only block 1 can be hit.
    r3 = make_request("r3", list(range(8)) + [7, 7, 7, 7])
    blocks, num_hit = kv.get_computed_blocks(r3)
    assert [b.block_id for b in blocks] == [1] and num_hit == 4


def test_b6_allocation_evicts_other_blocks_before_its_hits():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    r1 = make_request("r1", [1, 2, 3, 4, 5, 6, 7, 8])
    other = make_request("other", [21, 22, 23, 24, 25, 26, 27, 28])
    assert admit(kv, r1) == [1, 2]
    assert admit(kv, other) == [3, 4]
    kv.free(r1)
    kv.free(other)
    # r1's blocks are now at the FRONT of the free queue.
    assert free_ids(kv) == [2, 1, 4, 3]
    h_other = other.block_hashes

    r2 = make_request("r2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    blocks, num_hit = kv.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [1, 2] and num_hit == 8
    # The new block must not be block 2, though 2 is at the head of the queue.
    assert kv.allocate_slots(r2, 4, blocks) == [4]
    assert kv.get_block_ids("r2") == [1, 2, 4]
    assert free_ids(kv) == [3]
    assert hashes(kv) == {1: r1.block_hashes[0], 2: r1.block_hashes[1], 3: h_other[0]}


def test_b7_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    r1 = make_request("r1", list(range(8)))
    admit(kv, r1)
    kv.free(r1)
    hold = make_request("hold", [50, 51, 52, 53])
    assert kv.allocate_slots(hold, 4) == [3]
    before = (free_ids(kv), ref_counts(kv), hashes(kv), dict(kv.block_pool.cached_block_hash_to_block))
    stats_before = (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits)
    assert before[0] == [4, 2, 1]

    r2 = make_request("r2", list(range(8)) + [60 + i for i in range(8)])
    blocks, num_hit = kv.get_computed_blocks(r2)
    assert [b.block_id for b in blocks] == [1, 2] and num_hit == 8
    # 2 free hit blocks + 2 new blocks > 3 free blocks.
    assert kv.allocate_slots(r2, 8, blocks) is None
    after = (free_ids(kv), ref_counts(kv), hashes(kv), dict(kv.block_pool.cached_block_hash_to_block))
    assert after == before
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == stats_before
    assert kv.get_block_ids("r2") == [] and "r2" not in kv.req_to_blocks
    # A running request that cannot grow keeps what it has.
    hold.append_output_token_ids(list(range(54, 67)))
    hold.num_computed_tokens = 4
    assert kv.allocate_slots(hold, 13) is None  # needs 4 more blocks, 3 are free
    assert kv.get_block_ids("hold") == [3] and ref_counts(kv) == {3: 1}


def test_b8_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    r1 = make_request("r1", list(range(10)))
    assert admit(kv, r1) == [1, 2, 3]
    r2 = make_request("r2", list(range(10)))
    assert kv.get_computed_blocks(r2) == ([], 0)
    assert admit(kv, r2) == [4, 5, 6]
    assert hashes(kv) == {} and kv.block_pool.cached_block_hash_to_block == {}
    kv.free(r1)
    kv.free(r2)
    r3 = make_request("r3", list(range(10)))
    assert kv.get_computed_blocks(r3) == ([], 0)
    assert kv.prefix_cache_stats.queries == 0 and kv.prefix_cache_stats.hits == 0


def test_b9_extra_keys_keep_blocks_apart():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", list(range(9)), extra_keys=("tenant-a",))
    admit(kv, a)
    b = make_request("b", list(range(9)), extra_keys=("tenant-b",))
    assert kv.get_computed_blocks(b) == ([], 0)
    none = make_request("none", list(range(9)))
    assert kv.get_computed_blocks(none) == ([], 0)
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    a2 = make_request("a2", list(range(9)), extra_keys=("tenant-a",))
    blocks, num_hit = kv.get_computed_blocks(a2)
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8


def test_b10_hit_statistics_in_tokens():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    admit(kv, make_request("r1", list(range(10))))
    s = kv.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    admit(kv, make_request("r2", list(range(8)) + [99, 98, 97, 96]))
    assert (s.requests, s.queries, s.hits) == (2, 22, 8)
    # A lookup alone counts nothing: stats are taken once, when the request is admitted.
    kv.get_computed_blocks(make_request("r3", list(range(10))))
    assert (s.requests, s.queries, s.hits) == (2, 22, 8)
    assert s.hit_rate == 8 / 22


def test_null_block_is_never_handed_out():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.num_usable_blocks == 3
    r = make_request("r", list(range(12)))
    assert kv.allocate_slots(r, 12) == [1, 2, 3]
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    assert kv.block_pool.null_block.block_id == 0 and kv.block_pool.null_block.ref_cnt == 0


def test_duplicate_content_is_cached_once():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    # Both allocated before either is computed (same step): no hit, separate blocks.
    assert kv.allocate_slots(a, 9) == [1, 2, 3]
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.allocate_slots(b, 9) == [4, 5, 6]
    compute(kv, a, 9)
    compute(kv, b, 9)
    assert hashes(kv) == {1: a.block_hashes[0], 2: a.block_hashes[1]}
    kv.free(a)
    kv.free(b)
    # b's private copies and a's tail hold nothing reusable: handed out first (b's freed last).
    assert free_ids(kv) == [4, 5, 6, 3, 7, 8, 9, 2, 1]
    # The published copies still serve hits.
    blocks, num_hit = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8


def test_reset_prefix_cache_refused_while_in_use():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = make_request("r", list(range(9)))
    admit(kv, r)
    assert kv.reset_prefix_cache() is False
    assert len(hashes(kv)) == 2
    kv.free(r)
    assert kv.reset_prefix_cache() is True
    assert hashes(kv) == {} and kv.block_pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_request("again", list(range(9)))) == ([], 0)


def test_sha256_hasher_chains_and_separates_extra_keys():
    h1 = sha256_hash_block_tokens(None, [1, 2, 3, 4], ())
    assert h1 == sha256_hash_block_tokens(None, [1, 2, 3, 4], ())
    assert h1 != sha256_hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert sha256_hash_block_tokens(h1, [5], ()) != sha256_hash_block_tokens(None, [5], ())
    kv = KVCacheManager(num_blocks=10, block_size=BS, hasher=sha256_hash_block_tokens)
    admit(kv, make_request("a", list(range(9))))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(9))))
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8


def test_b10_a_chunked_prefill_is_counted_once():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    # Three chunks (4, 4, 2): the first allocation queries all 10 tokens, the later ones count nothing.
    assert admit(kv, r1, 4) == [1]
    s = kv.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    assert kv.allocate_slots(r1, 4) == [2]
    compute(kv, r1, 4)
    assert kv.allocate_slots(r1, 2) == [3]
    compute(kv, r1, 2)
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    # A second request hits both full blocks of the first: 8 of its 10 tokens.
    r2 = make_request("r2", list(range(10)))
    assert admit(kv, r2, 1) == [4]
    assert kv.get_block_ids("r2") == [1, 2, 4]
    assert (s.requests, s.queries, s.hits) == (2, 20, 8)
    # A failed allocation counts nothing either.
    r3 = make_request("r3", list(range(10)))
    blocks, _ = kv.get_computed_blocks(r3)
    assert kv.allocate_slots(r3, 100, blocks) is None
    assert (s.requests, s.queries, s.hits) == (2, 20, 8)
