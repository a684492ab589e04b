"""docs/testing.md C6: allocator invariants after random sequences of KV-manager operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import compute, make_request

from pagoda.kv import KVCacheManager
from pagoda.kv.invariants import check_kv_invariants

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7]]

op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 2), st.lists(st.integers(0, 3), max_size=9)),
    st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=40), caching=st.booleans(), num_blocks=st.integers(2, 14))
def test_c6_allocator_invariants_random_ops(ops, caching, num_blocks):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    live = []  # admitted requests, in admission order
    n = 0
    for o in ops:
        if o[0] == "admit":
            r = make_request(f"r{n}", PREFIXES[o[1]] + o[2])
            n += 1
            hits, num_hit = kv.get_computed_blocks(r)
            before = kv.num_free_blocks
            ids = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
            if ids is None:
                assert kv.num_free_blocks == before and r.request_id not in kv.req_to_blocks
            else:
                assert len(kv.get_block_ids(r.request_id)) == -(-r.num_tokens // BS)
                r.num_computed_tokens = num_hit
                compute(kv, r, r.num_tokens - num_hit)
                live.append(r)
        elif o[0] == "grow" and live:
            r = live[o[1] % len(live)]
            r.append_output_token_ids([o[2] % 4] * o[2])
            todo = r.num_tokens - r.num_computed_tokens
            if kv.allocate_slots(r, todo) is not None:
                compute(kv, r, todo)
            else:
                kv.free(r)  # what a preemption does
                live.remove(r)
        elif o[0] == "free" and live:
            kv.free(live.pop(o[1] % len(live)))
        elif o[0] == "reset":
            assert kv.reset_prefix_cache() == (not live)
        check_kv_invariants(kv)
        for r in live:
            assert len(kv.get_block_ids(r.request_id)) * BS >= r.num_computed_tokens
    for r in live:
        kv.free(r)
    check_kv_invariants(kv)
    assert kv.num_free_blocks == num_blocks - 1 and kv.usage == 0.0
    assert kv.req_to_blocks == {} and kv.req_to_block_ids == {} and kv.num_cached_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
