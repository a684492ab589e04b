"""A8: speculative decoding in the scheduler: drafts scheduled as 1 + k tokens within the budget,
rejected drafts rolled back, their KV slots given back, hashes published only for verified tokens."""

from __future__ import annotations

from pagoda.kv.invariants import check_kv_invariants
from tests.sched.sched_helpers import make_request, make_scheduler, step


def _decoding(sched, kv, prompt_len=6, **params):
    """One request past its prefill: 6 prompt tokens computed, 1 sampled (block size 4)."""
    r = make_request("a", prompt_len, max_tokens=params.pop("max_tokens", 32), **params)
    sched.add_request(r)
    step(sched, {"a": [100]})
    assert r.num_computed_tokens == prompt_len and r.num_tokens == prompt_len + 1
    return r


def test_a8_step_schedules_one_plus_k_tokens_and_counts_them_against_the_budget():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    r = _decoding(sched, kv)
    sched.update_draft_token_ids({"a": list(range(201, 210))})
    out = sched.schedule()
    (s,) = out.scheduled
    # Budget 8: the known token and 7 of the 9 drafts.
    assert s.new_token_ids == [100] and s.spec_token_ids == list(range(201, 208))
    assert s.num_new_tokens == 8 and out.total_num_scheduled_tokens == 8
    # Slots for positions 6..13: the request holds blocks for 14 tokens.
    assert len(kv.get_block_ids("a")) == 4
    assert r.spec_token_ids == []  # consumed by the step


def test_a8_rejected_drafts_roll_back_and_give_their_blocks_back():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r = _decoding(sched, kv)
    free_before = kv.num_free_blocks
    sched.update_draft_token_ids({"a": [201, 202, 203, 204, 205, 206]})
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 7  # positions 6..12: blocks for 13 tokens
    assert len(kv.get_block_ids("a")) == 4
    # The runner accepted 201 and then sampled 300 instead of 202.
    sched.update(out, {"a": [201, 300]})
    assert r.output_token_ids == [100, 201, 300]
    assert r.num_computed_tokens == 8  # prompt 6 + 100 + 201; 300 is not computed yet
    # 9 known tokens need 3 blocks; the fourth held only rejected drafts and went back.
    assert len(kv.get_block_ids("a")) == 3 and kv.num_free_blocks == free_before - 1
    check_kv_invariants(kv)
    assert sched.spec_stats.num_drafts == 1 and sched.spec_stats.num_draft_tokens == 6
    assert sched.spec_stats.num_accepted_tokens == 1 and sched.spec_stats.num_accepted_tokens_per_pos == [1, 0, 0, 0, 0, 0]
    # The next step computes the token after the accepted ones (no drafts given: one token).
    out = sched.schedule()
    assert out.scheduled[0].num_computed_tokens == 8 and out.scheduled[0].new_token_ids == [300]


def test_a8_all_accepted_plus_bonus_and_an_empty_proposal():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r = _decoding(sched, kv)
    sched.update_draft_token_ids({"a": [201, 202]})
    out = sched.schedule()
    sched.update(out, {"a": [201, 202, 203]})
    assert r.output_token_ids == [100, 201, 202, 203] and r.num_computed_tokens == 9
    sched.update_draft_token_ids({"a": []})  # nothing proposed: a plain decode
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].spec_token_ids == []
    sched.update(out, {"a": [7]})
    assert r.num_computed_tokens == 10


def test_a8_a_blocks_hash_is_published_only_when_its_tokens_are_verified():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r = _decoding(sched, kv)  # tokens 0..6 known; block 0 (0..3) published
    assert kv.num_cached_blocks["a"] == 1
    sched.update_draft_token_ids({"a": [201, 202, 203, 204, 205]})
    out = sched.schedule()  # computes positions 6..11: blocks 1 and 2 would be full
    sched.update(out, {"a": [300]})  # every draft rejected
    # Only 6 + 1 tokens are verified and computed: block 1 (positions 4..7) is not full of them.
    assert r.num_computed_tokens == 7 and kv.num_cached_blocks["a"] == 1
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    check_kv_invariants(kv)


def test_a5_drafts_past_a_stop_are_cut_and_never_scheduled_past_max_tokens():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r = _decoding(sched, kv, max_tokens=4)  # one output so far; three more at most
    sched.update_draft_token_ids({"a": [201, 202, 203, 204, 205]})
    out = sched.schedule()
    # Two drafts and the token sampled after them reach the cap.
    assert out.scheduled[0].spec_token_ids == [201, 202]
    sched.update(out, {"a": [201, 202, 203]})
    assert r.output_token_ids == [100, 201, 202, 203] and r.is_finished()
    assert kv.num_free_blocks == kv.num_usable_blocks
    check_kv_invariants(kv)
    # A stop token among accepted drafts ends the request there.
    sched2, kv2 = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r2 = _decoding(sched2, kv2, stop_token_ids=[202])
    sched2.update_draft_token_ids({"a": [201, 202, 203]})
    out = sched2.schedule()
    sched2.update(out, {"a": [201, 202, 203, 204]})
    assert r2.output_token_ids == [100, 201, 202] and r2.stop_reason == 202
    assert kv2.num_free_blocks == kv2.num_usable_blocks
    check_kv_invariants(kv2)


def test_a8_abort_mid_speculation_and_preemption_drop_drafts():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r = _decoding(sched, kv)
    sched.update_draft_token_ids({"a": [201, 202, 203]})
    out = sched.schedule()
    sched.abort_requests("a")  # between schedule() and update(), as a client disconnect
    sched.update(out, {"a": [201, 202]})
    assert r.output_token_ids == [100]
    assert kv.num_free_blocks == kv.num_usable_blocks
    check_kv_invariants(kv)
    # Drafts for unknown requests are ignored.
    sched.update_draft_token_ids({"a": [1, 2]})
    assert not sched.has_unfinished_requests()


def test_a8_a_step_with_drafts_round_trips_through_msgpack():
    import msgspec

    from pagoda.contracts.step import SchedulerOutput

    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    _decoding(sched, kv)
    sched.update_draft_token_ids({"a": [201, 202]})
    out = sched.schedule()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert back == out and back.scheduled[0].spec_token_ids == [201, 202]
