"""docs/testing.md C1, C2, C4, C7: fully cached prompts, same-step prefix sharing, chunk boundaries,
and requests that finish exactly once. block_size 4; block 0 is the null block."""

from __future__ import annotations

from sched_helpers import make_request, make_scheduler, split, step

from pagoda.kv.invariants import check_kv_invariants
from pagoda.sched import RequestStatus


def test_c1_fully_cached_prompt_of_a_block_multiple_still_computes():
    sched, kv = make_scheduler()
    prompt = list(range(8))  # exactly 2 blocks
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    step(sched)
    assert a.is_finished() and len(kv.block_pool.cached_block_hash_to_block) == 2

    b = make_request("b", prompt, max_tokens=1)
    sched.add_request(b)
    out, changed = step(sched, token=9)
    s = out.scheduled[0]
    # Hit 1 block only: the last block is recomputed to get the logits of the last token.
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples) == (4, 4, True)
    assert (s.block_ids, s.new_block_ids) == ([1, 3], [3])
    assert b.num_cached_tokens == 4
    assert changed == [b] and b.output_token_ids == [9]
    check_kv_invariants(kv)


def test_c1_fully_cached_prompt_not_a_block_multiple_computes_one_token():
    sched, kv = make_scheduler()
    prompt = list(range(9))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    b = make_request("b", prompt, max_tokens=1)
    sched.add_request(b)
    out, changed = step(sched, token=9)
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples) == (8, 1, True)
    assert (s.block_ids, s.new_block_ids) == ([1, 2, 3], [3])  # a's partial tail is reused first
    assert b.num_cached_tokens == 8 and b.output_token_ids == [9]


def test_c2_same_step_requests_do_not_read_each_others_uncomputed_blocks():
    sched, kv = make_scheduler()
    shared = list(range(8))
    a = make_request("a", shared + [50, 51])
    b = make_request("b", shared + [60, 61])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert split(out) == [("a", 10), ("b", 10)]
    assert [s.num_computed_tokens for s in out.scheduled] == [0, 0]
    assert [s.block_ids for s in out.scheduled] == [[1, 2, 3], [4, 5, 6]]
    assert kv.block_pool.cached_block_hash_to_block == {}  # nothing is published before the forward
    sched.update(out, {"a": [7], "b": [7]})
    # a's copies are published; b's identical blocks stay private (one cached copy per hash).
    blocks = kv.block_pool.blocks
    assert [blocks[i].block_hash for i in (1, 2)] == a.block_hashes
    assert [blocks[i].block_hash for i in (4, 5)] == [None, None]

    c = make_request("c", shared + [70])
    sched.add_request(c)
    out, _ = step(sched)
    s = out.scheduled[-1]
    assert (s.request_id, s.num_computed_tokens, s.num_new_tokens, s.block_ids) == ("c", 8, 1, [1, 2, 7])
    assert (blocks[1].ref_cnt, blocks[2].ref_cnt) == (2, 2)
    check_kv_invariants(kv)


def test_c2_a_chunk_computed_in_an_earlier_step_can_be_hit():
    sched, kv = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", list(range(12)))
    sched.add_request(a)
    out, _ = step(sched)
    assert split(out) == [("a", 8)]
    b = make_request("b", list(range(12)))
    sched.add_request(b)
    out = sched.schedule()
    # a's first chunk (blocks 1, 2) was computed last step: b may use it.
    assert split(out) == [("a", 4), ("b", 4)]
    assert out.scheduled[1].num_computed_tokens == 8
    assert out.scheduled[1].block_ids == [1, 2, 4]
    # ... but not a's block 3, which this very step is filling.
    assert kv.block_pool.blocks[3].block_hash is None


def test_c4_chunk_keys_end_at_the_chunk_and_its_token_is_dropped():
    sched, kv = make_scheduler(max_num_batched_tokens=6)
    r = make_request("r", list(range(10)))
    sched.add_request(r)
    out = sched.schedule()
    s = out.scheduled[0]
    # The chunk covers positions 0..5: blocks for 6 tokens, not for the 10-token prompt.
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples) == (0, 6, False)
    assert s.block_ids == [1, 2]
    changed = sched.update(out, {"r": [99]})
    assert changed == [] and r.output_token_ids == [] and r.num_tokens == 10
    assert r.num_computed_tokens == 6
    # Only the block full of computed keys is published; block 2 holds 2 of the chunk's keys.
    assert kv.block_pool.blocks[1].block_hash == r.block_hashes[0]
    assert kv.block_pool.blocks[2].block_hash is None

    out = sched.schedule()
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.samples, s.block_ids) == (6, 4, True, [1, 2, 3])
    changed = sched.update(out, {"r": [42]})
    assert changed == [r] and r.output_token_ids == [42]
    assert kv.block_pool.blocks[2].block_hash == r.block_hashes[1]


def test_c7_finished_request_is_never_freed_twice_nor_rescheduled():
    sched, kv = make_scheduler()
    a = make_request("a", 5, max_tokens=1)
    b = make_request("b", 5, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out, changed = step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    free_before = kv.num_free_blocks
    # The engine's stop-string check and a client abort both arrive after the fact: no effect.
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    sched.abort_requests(["a"])
    assert a.status is RequestStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert kv.num_free_blocks == free_before
    check_kv_invariants(kv)
    out, _ = step(sched)
    assert split(out) == [("b", 1)]
    assert out.finished_request_ids == ["a"]
    out, _ = step(sched)
    assert out.finished_request_ids == []


def test_c7_request_ended_between_schedule_and_update_is_skipped():
    sched, kv = make_scheduler()
    a = make_request("a", 5)
    b = make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_requests(["a"])
    changed = sched.update(out, {"a": [1], "b": [1]})
    assert changed == [b] and a.output_token_ids == [] and a.num_computed_tokens == 0
    assert "a" not in kv.req_to_blocks
    check_kv_invariants(kv)
    out, _ = step(sched)
    assert split(out) == [("b", 1)] and out.finished_request_ids == ["a"]


def test_c7_duplicate_and_repeated_aborts_free_once():
    sched, kv = make_scheduler()
    a = make_request("a", 9)
    sched.add_request(a)
    step(sched)
    sched.abort_requests(["a", "a"])
    sched.abort_requests("a")
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert kv.num_free_blocks == kv.num_usable_blocks
    check_kv_invariants(kv)
    out, _ = step(sched)
    assert out.finished_request_ids == ["a"]
