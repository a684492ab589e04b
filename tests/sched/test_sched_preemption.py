"""docs/testing.md A6 and C3: preemption by recompute under KV pressure, and resuming from the cache.

block_size 4; block 0 is the null block. Prompts of 7 tokens take 2 blocks; the first decode
(position 7) fits in the second block, the second decode (position 8) needs a third block.
"""

from __future__ import annotations

from sched_helpers import make_request, make_scheduler, split, step

from pagoda.kv.invariants import check_kv_invariants
from pagoda.sched import RequestStatus


def test_a6_fcfs_preempts_last_admitted_and_resumes_from_its_cached_blocks():
    sched, kv = make_scheduler(num_blocks=8)  # 7 usable blocks
    r1 = make_request("r1", 7, max_tokens=3)
    r2 = make_request("r2", 7)
    r3 = make_request("r3", 7)
    for r in (r1, r2, r3):
        sched.add_request(r)
    out, _ = step(sched, token=11)
    assert [s.block_ids for s in out.scheduled] == [[1, 2], [3, 4], [5, 6]]
    out, _ = step(sched, token=12)
    assert split(out) == [("r1", 1), ("r2", 1), ("r3", 1)]
    r3_hashes = list(r3.block_hashes)
    assert kv.block_pool.blocks[5].block_hash == r3_hashes[0]

    r4 = make_request("r4", 3)
    sched.add_request(r4)
    out, _ = step(sched, token=13)
    # r1 takes the last free block (7); r2 needs one more: r3, admitted last, is the victim.
    assert split(out) == [("r1", 1), ("r2", 1)]
    assert [s.new_block_ids for s in out.scheduled] == [[7], [6]]
    assert out.preempted_request_ids == ["r3"]
    # No admission in a step that preempted, although r4 would fit: r1 finished (max_tokens=3).
    assert r4.status is RequestStatus.WAITING
    # r1's partial tail (7) first, then cached blocks by age: r3's first block (5), r1's prefix.
    assert kv.block_pool.free_block_ids() == [7, 5, 2, 1]
    assert (r3.status, r3.num_computed_tokens, r3.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert r3.output_token_ids == [11, 12] and r3.num_tokens == 9  # keeps every token
    assert [r.request_id for r in sched.waiting] == ["r3", "r4"]  # back at the front
    assert "r3" not in kv.req_to_blocks
    # Its first block survived (evicted last); its tail, freed first, went to r2.
    assert kv.block_pool.blocks[5].block_hash == r3_hashes[0] and kv.block_pool.blocks[5].ref_cnt == 0
    assert r1.is_finished()
    check_kv_invariants(kv)

    out, _ = step(sched, token=14)
    assert split(out) == [("r2", 1), ("r3", 5), ("r4", 3)]
    s3 = out.scheduled[1]
    assert (s3.is_new, s3.num_computed_tokens, s3.samples) == (True, 4, True)
    assert (s3.block_ids, s3.new_block_ids) == ([5, 7, 2], [7, 2])
    assert out.scheduled[2].block_ids == [1]
    assert r3.output_token_ids == [11, 12, 14]
    assert r3.num_cached_tokens == 0  # the hit at first admission, not at the resume
    assert sched.stats().num_preemptions == 1
    check_kv_invariants(kv)


def test_a6_priority_preempts_lowest_priority_then_latest_arrival():
    sched, kv = make_scheduler(num_blocks=7, policy="priority")  # 6 usable blocks
    x = make_request("x", 7, max_tokens=4, priority=5, arrival=1.0)
    y = make_request("y", 7, max_tokens=4, priority=5, arrival=2.0)
    z = make_request("z", 7, max_tokens=4, priority=0, arrival=3.0)
    sched.add_request(x)
    sched.add_request(y)
    step(sched)
    sched.add_request(z)
    out, _ = step(sched)
    assert split(out) == [("x", 1), ("y", 1), ("z", 7)]
    out, _ = step(sched)
    # FCFS would take z (admitted last); the policy names y (priority 5, latest arrival).
    assert out.preempted_request_ids == ["y"]
    assert split(out) == [("x", 1), ("z", 1)]
    assert out.scheduled[0].new_block_ids == [4]
    assert y.status is RequestStatus.PREEMPTED and [r.request_id for r in sched.running] == ["x", "z"]
    check_kv_invariants(kv)


def test_a6_priority_victim_already_scheduled_in_the_step_is_taken_back():
    sched, kv = make_scheduler(num_blocks=5, policy="priority")  # 4 usable blocks
    x = make_request("x", 5, max_tokens=4, priority=5, arrival=1.0)
    z = make_request("z", 8, max_tokens=4, priority=0, arrival=2.0)
    sched.add_request(x)
    step(sched)
    sched.add_request(z)
    out, _ = step(sched)
    assert split(out) == [("x", 1), ("z", 8)]
    out = sched.schedule()
    # x (position 6, inside its block) is scheduled first; z then needs a block and x is the victim.
    assert out.preempted_request_ids == ["x"]
    assert split(out) == [("z", 1)]
    assert out.num_scheduled_tokens == {"z": 1} and out.total_num_scheduled_tokens == 1
    assert out.scheduled[0].new_block_ids == [2]  # x's partial tail, freed first
    assert x.status is RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    changed = sched.update(out, {"z": [3], "x": [3]})
    assert changed == [z] and x.output_token_ids == [7, 7]
    check_kv_invariants(kv)


def test_a6_a_request_preempted_for_a_higher_priority_one_is_not_scheduled_that_step():
    sched, kv = make_scheduler(num_blocks=5, policy="priority")
    x = make_request("x", 8, max_tokens=4, priority=5, arrival=1.0)
    z = make_request("z", 8, max_tokens=4, priority=0, arrival=2.0)
    sched.add_request(x)
    sched.add_request(z)
    out, _ = step(sched)
    assert split(out) == [("z", 8), ("x", 8)]
    out, _ = step(sched)
    # z takes nothing (no free block); it preempts x, the lowest priority, and takes x's tail.
    assert out.preempted_request_ids == ["x"] and split(out) == [("z", 1)]
    assert out.scheduled[0].new_block_ids == [4]
    check_kv_invariants(kv)


def test_c3_resume_recomputes_only_what_the_cache_lookup_misses():
    sched, kv = make_scheduler(num_blocks=6, long_prefill_token_threshold=3)  # 5 usable blocks
    r1 = make_request("r1", 11, max_tokens=2)
    r2 = make_request("r2", 7, max_tokens=6)
    sched.add_request(r1)
    sched.add_request(r2)
    assert split(step(sched)[0]) == [("r1", 3), ("r2", 3)]
    assert split(step(sched)[0]) == [("r1", 3), ("r2", 3)]
    assert split(step(sched)[0]) == [("r1", 3), ("r2", 1)]
    assert split(step(sched)[0]) == [("r1", 2), ("r2", 1)]
    assert (kv.get_block_ids("r1"), kv.get_block_ids("r2")) == ([1, 3, 5], [2, 4])
    assert (r1.num_computed_tokens, r2.num_computed_tokens) == (11, 8)
    out, _ = step(sched)
    # r2 needs a third block, none is free, and r2 is the last admitted: it preempts itself.
    assert split(out) == [("r1", 1)] and out.preempted_request_ids == ["r2"]
    assert r2.num_tokens == 9 and r2.num_computed_tokens == 0
    assert r1.is_finished()
    free = kv.block_pool.free_block_ids()
    assert free == [4, 2, 5, 3, 1]

    out, _ = step(sched)
    # 9 tokens known (7 prompt + 2 generated); both of r2's full blocks survived: 8 hit, 1 to compute,
    # not 9 (no lookup) nor 7 - 8 (prompt only). The cap of 3 does not bind.
    assert split(out) == [("r2", 1)]
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.is_new, s.samples) == (8, True, True)
    assert (s.block_ids, s.new_block_ids) == ([2, 4, 5], [5])
    assert r2.output_token_ids == [7, 7, 7] and r2.num_computed_tokens == 9
    check_kv_invariants(kv)


def test_c3_resume_with_a_partial_hit_is_chunked_from_the_hit():
    sched, kv = make_scheduler(num_blocks=8, long_prefill_token_threshold=3)  # 7 usable blocks
    r1 = make_request("r1", 7, max_tokens=3)
    r2 = make_request("r2", 7)
    r3 = make_request("r3", 7, max_tokens=5)
    for r in (r1, r2, r3):
        sched.add_request(r)
    for _ in range(4):
        step(sched)
    assert [kv.get_block_ids(r) for r in ("r1", "r2", "r3")] == [[1, 4], [2, 5], [3, 6]]
    out, _ = step(sched)
    assert out.preempted_request_ids == ["r3"]
    assert [s.new_block_ids for s in out.scheduled] == [[7], [6]]  # r2 took r3's tail
    table = kv.block_pool.cached_block_hash_to_block
    assert table[r3.block_hashes[0]].block_id == 3 and r3.block_hashes[1] not in table

    out, _ = step(sched)
    s3 = out.scheduled[1]
    # 9 known tokens, 4 hit: 5 to compute, capped at 3 this step (no token), then 2 (a token).
    assert (s3.request_id, s3.num_computed_tokens, s3.num_new_tokens) == ("r3", 4, 3)
    assert (s3.block_ids, s3.new_block_ids, s3.is_new, s3.samples) == ([3, 7], [7], True, False)
    assert r3.num_output_tokens == 2
    out, _ = step(sched)
    s3 = out.scheduled[1]
    assert (s3.num_computed_tokens, s3.num_new_tokens, s3.block_ids, s3.samples) == (7, 2, [3, 7, 4], True)
    assert s3.is_new is False and r3.num_output_tokens == 3
    check_kv_invariants(kv)


def _two_victims_setup():
    """r1's second prefill chunk needs 2 blocks with none free: r3, then r2, are preempted."""
    sched, kv = make_scheduler(num_blocks=6, long_prefill_token_threshold=12)  # 5 usable blocks
    r1 = make_request("r1", 19, max_tokens=1)
    r2 = make_request("r2", 3, max_tokens=5)
    r3 = make_request("r3", 3, max_tokens=5)
    for r in (r1, r2, r3):
        sched.add_request(r)
    out, _ = step(sched, token=11)
    assert split(out) == [("r1", 12), ("r2", 3), ("r3", 3)]
    assert [s.block_ids for s in out.scheduled] == [[1, 2, 3], [4], [5]]
    assert kv.num_free_blocks == 0
    out, _ = step(sched, token=12)
    return sched, kv, out, (r1, r2, r3)


def test_a6_fcfs_two_victims_in_one_step_in_admission_order():
    sched, kv, out, (r1, r2, r3) = _two_victims_setup()
    # Victims are taken from the back (r3, then r2) until r1's chunk of 7 fits.
    assert out.preempted_request_ids == ["r3", "r2"]
    # Their blocks held no computed full block: reusable, r2's (freed last) first.
    assert split(out) == [("r1", 7)] and out.scheduled[0].new_block_ids == [4, 5]
    assert out.num_scheduled_tokens == {"r1": 7} and out.total_num_scheduled_tokens == 7
    # Both go back to the front, in their admission order.
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    for r in (r2, r3):
        assert (r.status, r.num_computed_tokens, r.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
        assert r.output_token_ids == [11] and r.num_tokens == 4
    assert r1.is_finished() and r1.output_token_ids == [12]
    # r1's partial tail (5) is reusable; its full blocks are cached, freed tail first (1 is evicted last).
    assert kv.block_pool.free_block_ids() == [5, 4, 3, 2, 1]
    assert sched.stats().num_preemptions == 2
    check_kv_invariants(kv)

    out, _ = step(sched, token=13)
    assert split(out) == [("r2", 4), ("r3", 4)]  # 3 prompt + 1 generated each, nothing cached
    assert [(s.num_computed_tokens, s.block_ids, s.is_new) for s in out.scheduled] == [
        (0, [5], True),
        (0, [4], True),
    ]
    assert r2.output_token_ids == r3.output_token_ids == [11, 13]
    check_kv_invariants(kv)


def test_a1_abort_of_a_preempted_request_leaves_every_queue():
    sched, kv, out, (r1, r2, r3) = _two_victims_setup()
    assert out.preempted_request_ids == ["r3", "r2"]
    assert (sched.num_running, sched.num_waiting, sched.get_num_unfinished_requests()) == (0, 2, 2)
    free_before = kv.block_pool.free_block_ids()
    sched.abort_requests("r3")
    assert (r3.status, r3.finish_reason) == (RequestStatus.FINISHED_ABORTED, "abort")
    assert [r.request_id for r in sched.waiting] == ["r2"] and set(sched.requests) == {"r2"}
    assert (sched.num_running, sched.num_waiting, sched.get_num_unfinished_requests()) == (0, 1, 1)
    # It held no blocks while preempted: aborting it frees nothing.
    assert kv.block_pool.free_block_ids() == free_before
    out, _ = step(sched, token=13)
    assert split(out) == [("r2", 4)] and out.finished_request_ids == ["r1", "r3"]
    assert r3.output_token_ids == [11]
    check_kv_invariants(kv)


def test_a6_priority_self_victim_and_requeue_position():
    sched, kv = make_scheduler(num_blocks=5, policy="priority")  # 4 usable blocks
    x = make_request("x", 7, max_tokens=4, priority=5, arrival=1.0)
    z = make_request("z", 7, max_tokens=4, priority=0, arrival=2.0)
    sched.add_request(x)
    step(sched)
    sched.add_request(z)
    out, _ = step(sched)
    assert split(out) == [("x", 1), ("z", 7)]
    assert (kv.get_block_ids("x"), kv.get_block_ids("z"), kv.num_free_blocks) == ([1, 2], [3, 4], 0)
    w = make_request("w", 3, max_tokens=4, priority=5, arrival=10.0)
    v = make_request("v", 3, max_tokens=4, priority=1, arrival=11.0)
    sched.add_request(w)
    sched.add_request(v)

    out, _ = step(sched)
    # x (running[0]) needs a block for position 8; it is the lowest priority itself, so it is the
    # victim, although it is not the last admitted. z (position 7, inside its block) still runs.
    assert out.preempted_request_ids == ["x"]
    assert split(out) == [("z", 1)] and out.scheduled[0].new_block_ids == []
    assert [r.request_id for r in sched.running] == ["z"]
    # Back under its own key: behind the more urgent v, ahead of w (same priority, later arrival).
    # v would fit in x's freed blocks but is not admitted in a step that preempted.
    assert [r.request_id for r in sched.waiting] == ["v", "x", "w"]
    assert kv.block_pool.free_block_ids() == [2, 1]
    check_kv_invariants(kv)

    sched.abort_requests("x")  # a preempted request leaves the priority queue too
    assert [r.request_id for r in sched.waiting] == ["v", "w"]
    out, _ = step(sched)
    assert split(out) == [("z", 1), ("v", 3)]
    assert [(s.block_ids, s.new_block_ids) for s in out.scheduled] == [([3, 4, 2], [2]), ([1], [1])]
    assert out.finished_request_ids == ["x"]
    check_kv_invariants(kv)
