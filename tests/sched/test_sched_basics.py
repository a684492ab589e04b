"""docs/testing.md A1-A4, A7, A9, A10: request lifecycle, ordering, chunked prefill, priorities, leaks."""

from __future__ import annotations

import pytest
from sched_helpers import make_request, make_scheduler, split, step

from pagoda.sched import RequestStatus


def test_a1_add_finish_abort_lifecycle():
    sched, kv = make_scheduler()
    r1 = make_request("r1", 5, max_tokens=1)
    r2 = make_request("r2", 5, max_tokens=10)
    r3 = make_request("r3", 5, max_tokens=2)
    r4 = make_request("r4", 5, max_tokens=10)
    for r in (r1, r2, r3):
        sched.add_request(r)
    assert (sched.num_waiting, sched.num_running, sched.get_num_unfinished_requests()) == (3, 0, 3)
    assert all(r.status is RequestStatus.WAITING for r in (r1, r2, r3))
    with pytest.raises(ValueError):
        sched.add_request(make_request("r1", 3))

    out, changed = step(sched)
    assert split(out) == [("r1", 5), ("r2", 5), ("r3", 5)]
    assert out.finished_request_ids == []
    assert changed == [r1, r2, r3]
    assert r1.status is RequestStatus.FINISHED_LENGTH and r1.finish_reason == "length"
    assert r1.is_finished() and r1.output_token_ids == [7]
    assert (sched.num_waiting, sched.num_running, sched.get_num_unfinished_requests()) == (0, 2, 2)

    sched.add_request(r4)
    sched.abort_requests(["r2", "nope"])  # an unknown id is ignored
    assert r2.status is RequestStatus.FINISHED_ABORTED and r2.finish_reason == "abort"
    assert (sched.num_waiting, sched.num_running, sched.get_num_unfinished_requests()) == (1, 1, 2)
    sched.abort_requests("r4")  # a waiting request leaves the queue
    assert (sched.num_waiting, sched.num_running, sched.get_num_unfinished_requests()) == (0, 1, 1)

    out, changed = step(sched)
    assert out.finished_request_ids == ["r1", "r2", "r4"]
    assert split(out) == [("r3", 1)] and changed == [r3]
    assert r3.status is RequestStatus.FINISHED_LENGTH and r3.output_token_ids == [7, 7]
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert sched.requests == {} and sched.running == [] and len(sched.waiting) == 0
    assert kv.req_to_blocks == {} and kv.num_free_blocks == kv.num_usable_blocks

    out, changed = step(sched)
    assert out.scheduled == [] and out.finished_request_ids == ["r3"] and changed == []


def test_a2_short_prompts_all_scheduled_in_arrival_order():
    sched, kv = make_scheduler()
    lengths = [3, 5, 7, 2, 4]
    for i, n in enumerate(lengths):
        sched.add_request(make_request(f"r{i}", n, arrival=float(i)))
    out = sched.schedule()
    assert split(out) == [(f"r{i}", n) for i, n in enumerate(lengths)]
    assert out.num_scheduled_tokens == {f"r{i}": n for i, n in enumerate(lengths)}
    assert out.total_num_scheduled_tokens == 21
    assert all(s.is_new and s.samples and s.num_computed_tokens == 0 for s in out.scheduled)
    assert [s.block_ids for s in out.scheduled] == [[1], [2, 3], [4, 5], [6], [7]]
    assert [s.new_block_ids for s in out.scheduled] == [[1], [2, 3], [4, 5], [6], [7]]


def test_a3_chunked_prefill_arithmetic():
    sched, kv = make_scheduler(
        num_blocks=200, block_size=16, max_num_batched_tokens=1024, long_prefill_token_threshold=400
    )
    reqs = [make_request(f"r{i}", 800) for i in range(3)]
    for r in reqs:
        sched.add_request(r)

    out, changed = step(sched)
    assert split(out) == [("r0", 400), ("r1", 400), ("r2", 224)]
    assert [s.samples for s in out.scheduled] == [False, False, False]
    assert changed == [] and all(r.output_token_ids == [] for r in reqs)  # mid-prompt: no token
    assert [r.num_computed_tokens for r in reqs] == [400, 400, 224]

    out, changed = step(sched)
    assert split(out) == [("r0", 400), ("r1", 400), ("r2", 224)]
    assert [s.num_computed_tokens for s in out.scheduled] == [400, 400, 224]
    assert [s.is_new for s in out.scheduled] == [False, False, False]
    assert changed == reqs[:2]
    assert [r.output_token_ids for r in reqs] == [[7], [7], []]

    out, changed = step(sched)
    assert split(out) == [("r0", 1), ("r1", 1), ("r2", 352)]
    assert [s.num_computed_tokens for s in out.scheduled] == [800, 800, 448]
    assert out.total_num_scheduled_tokens == 354
    assert changed == reqs
    assert [r.num_output_tokens for r in reqs] == [2, 2, 1]


def test_a4_without_chunking_a_long_head_blocks_the_queue():
    sched, _ = make_scheduler(
        num_blocks=100, max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False
    )
    for rid, n in (("a", 60), ("b", 50), ("c", 5)):
        sched.add_request(make_request(rid, n))
    out, _ = step(sched)
    assert split(out) == [("a", 60)]  # c would fit, but must not overtake b
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    out, _ = step(sched)
    assert split(out) == [("a", 1), ("b", 50), ("c", 5)]


def test_a4_with_chunking_the_head_is_split_instead():
    sched, _ = make_scheduler(num_blocks=100, max_num_batched_tokens=100, max_model_len=100)
    for rid, n in (("a", 60), ("b", 50), ("c", 5)):
        sched.add_request(make_request(rid, n))
    out, _ = step(sched)
    assert split(out) == [("a", 60), ("b", 40)]
    out, _ = step(sched)
    assert split(out) == [("a", 1), ("b", 10), ("c", 5)]


def test_a4_max_num_seqs_caps_admission():
    sched, _ = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", 3, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=5))
    sched.add_request(make_request("c", 3, max_tokens=5))
    out, _ = step(sched)
    assert split(out) == [("a", 3), ("b", 3)]
    assert sched.num_waiting == 1
    out, _ = step(sched)  # a finished: c takes its seat
    assert split(out) == [("b", 1), ("c", 3)]


def test_a7_priority_order_then_arrival():
    sched, _ = make_scheduler(policy="priority", max_num_seqs=3)
    sched.add_request(make_request("a", 2, priority=2, arrival=1.0))
    sched.add_request(make_request("b", 2, priority=1, arrival=2.0))
    sched.add_request(make_request("c", 2, priority=1, arrival=1.5))  # added later, arrived earlier
    sched.add_request(make_request("d", 2, priority=0, arrival=3.0))
    assert [r.request_id for r in sched.waiting] == ["d", "c", "b", "a"]
    out, _ = step(sched)
    assert split(out) == [("d", 2), ("c", 2), ("b", 2)]
    assert [r.request_id for r in sched.waiting] == ["a"]


def test_a7_equal_priorities_behave_as_fcfs():
    orders = []
    for policy in ("fcfs", "priority"):
        sched, _ = make_scheduler(policy=policy, max_num_batched_tokens=10)
        for i in range(5):
            sched.add_request(make_request(f"r{i}", 3, priority=4, arrival=100.0 + i))
        orders.append([split(step(sched)[0]) for _ in range(3)])
    assert orders[0] == orders[1]
    assert orders[0][0] == [("r0", 3), ("r1", 3), ("r2", 3), ("r3", 1)]


def test_a9_reset_prefix_cache_refused_while_requests_hold_blocks():
    sched, kv = make_scheduler()
    prompt = list(range(10))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    step(sched)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    assert kv.reset_prefix_cache() is False
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    step(sched)  # a finishes
    assert not sched.has_unfinished_requests()
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    b = make_request("b", prompt)
    sched.add_request(b)
    out, _ = step(sched)
    assert split(out) == [("b", 10)] and b.num_cached_tokens == 0


def test_a10_no_leaks_after_many_requests_and_aborts():
    sched, kv = make_scheduler(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=6)
    shared = list(range(12))
    n_added = 0
    for it in range(200):
        if n_added < 60 and it % 2 == 0:
            prompt = shared[: (n_added * 5) % 12] + [1000 + n_added] * (1 + n_added % 9)
            sched.add_request(make_request(f"r{n_added}", prompt, max_tokens=1 + n_added % 7))
            n_added += 1
        if it % 5 == 0 and sched.requests:
            ids = sorted(sched.requests)
            sched.abort_requests(ids[it % len(ids)])
        step(sched, token=it % 3)
        assert sched.get_num_unfinished_requests() == sched.num_running + sched.num_waiting
        if n_added == 60 and not sched.has_unfinished_requests():
            break
    assert n_added == 60 and not sched.has_unfinished_requests()
    assert sched.requests == {} and sched.running == [] and len(sched.waiting) == 0
    assert kv.req_to_blocks == {} and kv.req_to_block_ids == {} and kv.num_cached_blocks == {}
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    assert stats.prefix_cache_hits > 0


def test_add_request_validation():
    sched, _ = make_scheduler(num_blocks=5, max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 33))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("big", 10, max_tokens=10))  # 20 tokens > 4 blocks of 4
    sched.add_request(make_request("ok", 10, max_tokens=6))
    assert sched.get_num_unfinished_requests() == 1


def test_stats():
    sched, kv = make_scheduler(num_blocks=11)
    sched.add_request(make_request("a", list(range(9)), max_tokens=3))
    sched.add_request(make_request("b", list(range(9)), max_tokens=3))
    step(sched)
    sched.add_request(make_request("c", list(range(9)), max_tokens=3))
    step(sched)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (3, 0, 0)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (27, 8)
    # a holds [1, 2, 3]; b, admitted in the same step, could not hit a: [4, 5, 6]; c hit [1, 2] + [7].
    assert kv.get_block_ids("c") == [1, 2, 7]
    assert s.kv_usage == 7 / 10


def test_a4_a_head_without_kv_room_blocks_the_queue():
    sched, kv = make_scheduler(num_blocks=6)  # 5 usable blocks of 4
    a = make_request("a", 11, max_tokens=2)
    sched.add_request(a)
    out, _ = step(sched)
    assert kv.get_block_ids("a") == [1, 2, 3]
    b = make_request("b", 9, max_tokens=2)  # needs 3 blocks
    c = make_request("c", 3, max_tokens=2)  # needs 1 block
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()
    # 2 blocks are free: b does not fit, and c, which would, must not overtake it.
    assert split(out) == [("a", 1)] and kv.num_free_blocks == 2
    sched.update(out, {"a": [7]})
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.status is RequestStatus.WAITING and c.status is RequestStatus.WAITING
    assert a.is_finished()
    out, _ = step(sched)
    assert split(out) == [("b", 9), ("c", 3)]
    assert [s.block_ids for s in out.scheduled] == [[4, 5, 3], [2]]
