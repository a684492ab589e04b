"""The working set: blocks handed out so that the blocks ever written follow what is in use plus a
bounded prefix cache, and the trimmer's recent-peak rule for giving memory back."""

from __future__ import annotations

import random

import pytest
from kv_helpers import admit, free_ids, make_request

from pagoda.kv import KVCacheManager
from pagoda.kv.invariants import check_kv_invariants
from pagoda.kv.working_set import WorkingSetTrimmer

BS = 4


def _ever_handed_out(kv: KVCacheManager, seen: set[int], rid: str) -> None:
    seen.update(kv.get_block_ids(rid))


def test_sustained_unique_traffic_touches_peak_in_use_plus_the_cached_cap():
    # 400 requests of 3-9 blocks, at most 3 running at once, through a 1,000-block pool with prefix
    # caching on: every full prompt block gets a hash. Handing out fresh blocks before evicting
    # cached ones would walk the whole pool; the cap keeps what is ever written small.
    cap = 20
    kv = KVCacheManager(num_blocks=1001, block_size=BS, max_cached_free_blocks=cap)
    rng = random.Random(0)
    seen: set[int] = set()
    running: list = []
    peak = 0
    for i in range(400):
        r = make_request(f"r{i}", [rng.randrange(10**6) for _ in range(rng.randrange(9, 36))])
        assert admit(kv, r) is not None
        running.append(r)
        _ever_handed_out(kv, seen, r.request_id)
        peak = max(peak, kv.num_usable_blocks - kv.num_free_blocks)
        if len(running) == 3:
            kv.free(running.pop(rng.randrange(3)))
        check_kv_invariants(kv)
    assert peak <= 27
    assert len(seen) <= peak + cap
    assert kv.block_pool.num_touched_blocks == len(seen)
    # Eviction is lazy: what was written and is free stays cached until needed, or until the trimmer
    # applies the cap.
    assert kv.block_pool.cached_free.num_free_blocks > cap
    assert kv.block_pool.evict_cached_beyond_cap() > 0 and kv.block_pool.cached_free.num_free_blocks == cap
    check_kv_invariants(kv)


def test_a_shared_prefix_keeps_hitting_under_the_cap():
    kv = KVCacheManager(num_blocks=200, block_size=BS, max_cached_free_blocks=4)
    prefix = list(range(16))  # 4 full blocks
    hits = []
    for i in range(50):
        r = make_request(f"r{i}", prefix + [1000 + 10 * i + j for j in range(9)])
        hit_blocks, num_hit = kv.get_computed_blocks(r)
        hits.append(num_hit)
        assert admit(kv, r) is not None
        kv.free(r)
    # The prefix is freed last of each request's blocks (reversed), so it is the most recently
    # used cached content and survives while the unique tails' hashes are evicted.
    assert hits[0] == 0 and hits[1:] == [16] * 49
    check_kv_invariants(kv)


def test_reusable_blocks_come_before_untouched_ones_and_lowest_untouched_first():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(8)))
    assert admit(kv, a) == [1, 2, 3]
    assert admit(kv, b) == [4, 5]
    kv.free(a)  # freed tail first: 3, 2, 1; the last freed (1) is handed out first
    assert free_ids(kv) == [1, 2, 3, 6, 7, 8, 9]
    c = make_request("c", list(range(20)))
    assert admit(kv, c) == [1, 2, 3, 6, 7]


def test_release_reusable_takes_the_longest_free_and_makes_them_untouched():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    pool = kv.block_pool
    a, b = make_request("a", list(range(8))), make_request("b", list(range(8)))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)  # 2, 1 reusable
    kv.free(b)  # 4, 3 on top
    assert pool.num_touched_blocks == 4 and free_ids(kv) == [3, 4, 1, 2, 5, 6, 7, 8, 9]
    assert pool.release_reusable(3) == [2, 1, 4]
    assert pool.num_touched_blocks == 1
    assert free_ids(kv) == [3, 1, 2, 4, 5, 6, 7, 8, 9]
    check_kv_invariants(kv)


def test_beyond_the_cap_cached_blocks_are_evicted_before_untouched_ones_are_written():
    for cap, expected in ((0, [3, 2, 1]), (None, [3, 4, 5])):
        kv = KVCacheManager(num_blocks=10, block_size=BS, max_cached_free_blocks=cap)
        r = make_request("r", list(range(9)))  # blocks 1, 2 full (cached), 3 partial
        admit(kv, r)
        kv.free(r)
        assert kv.block_pool.cached_free.num_free_blocks == 2  # lazy: still cached after the free
        s = make_request("s", [100 + i for i in range(12)])
        assert admit(kv, s) == expected
        assert kv.block_pool.num_touched_blocks == max(expected)
        check_kv_invariants(kv)
    with pytest.raises(ValueError, match="max_cached_free_blocks"):
        KVCacheManager(num_blocks=10, max_cached_free_blocks=-1)


def test_trimmer_keeps_the_recent_peak_and_releases_a_burst_after_the_windows_pass():
    kv = KVCacheManager(num_blocks=101, block_size=BS, enable_prefix_caching=False)
    pool = kv.block_pool
    trim = WorkingSetTrimmer(pool, window_s=10.0, num_windows=3, now=0.0)
    burst = [make_request(f"b{i}", list(range(20))) for i in range(10)]  # 5 blocks each
    for r in burst:
        admit(kv, r)
    trim.observe()
    for r in burst[2:]:
        kv.free(r)
    assert pool.num_reusable_blocks == 40
    assert trim.blocks_to_release(5.0) == []  # inside the first window
    # The burst's peak (50) is still recent: nothing goes back while the windows remember it.
    assert trim.blocks_to_release(10.0) == []
    assert trim.blocks_to_release(20.0) == [] and trim.blocks_to_release(30.0) == []
    # Three windows later the peak is the 10 blocks still in use: the 40 reusable are released,
    # the longest free first.
    released = trim.blocks_to_release(40.0)
    assert len(released) == 40 and pool.num_reusable_blocks == 0
    assert pool.num_touched_blocks == 10 and trim.num_released == 40
    check_kv_invariants(kv)


def test_trimmer_counts_idle_windows_it_was_not_called_in():
    kv = KVCacheManager(num_blocks=41, block_size=BS, enable_prefix_caching=False)
    trim = WorkingSetTrimmer(kv.block_pool, window_s=1.0, num_windows=6, now=0.0)
    r = make_request("r", list(range(40)))
    admit(kv, r)
    trim.observe()
    kv.free(r)
    # One call long after the burst: the windows in between had nothing in use.
    assert len(trim.blocks_to_release(100.0)) == 10
