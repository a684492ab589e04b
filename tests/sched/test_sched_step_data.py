"""The step as plain data (pagoda.contracts.step) and the stop conditions (StopConditions).

A step names requests by id and carries only what the runner needs: the token ids each row
computes, and for a new or resumed request its prompt, outputs so far and sampling parameters."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
from sched_helpers import make_request, make_scheduler, step

from pagoda.contracts.step import SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.sched import RequestStatus, StopConditions


def test_a_step_round_trips_through_msgpack():
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 6))
    step(sched)
    sched.add_request(make_request("b", 5, temperature=0.5, seed=3, stop_token_ids=[9]))
    out = sched.schedule()
    assert [s.is_new for s in out.scheduled] == [False, True]
    # No scheduler object inside: msgspec would refuse to encode one.
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert back == out and back.scheduled[1].new_request.sampling_params == out.scheduled[1].new_request.sampling_params


def test_rows_carry_the_tokens_they_compute_and_new_requests_their_state_once():
    sched, _ = make_scheduler(max_num_batched_tokens=6, long_prefill_token_threshold=6)
    a = make_request("a", 10, max_tokens=4, eos=3)
    sched.add_request(a)
    out, _ = step(sched)
    (s,) = out.scheduled
    assert (s.new_token_ids, s.num_tokens) == (a.prompt_token_ids[:6], 10)
    new = s.new_request
    assert (new.prompt_token_ids, new.output_token_ids, new.eos_token_id) == (a.prompt_token_ids, [], 3)
    assert new.sampling_params is a.sampling_params
    out, _ = step(sched, token=21)
    (s,) = out.scheduled
    assert (s.new_token_ids, s.is_new, s.new_request, s.samples) == (a.prompt_token_ids[6:], False, None, True)
    out, _ = step(sched, token=22)
    assert [s.new_token_ids for s in out.scheduled] == [[21]]  # a decode: the token sampled last step


def test_a_resumed_request_carries_its_outputs_so_far_as_a_copy():
    # 4 usable blocks of 4: two requests of 6 prompt tokens run out of room while decoding.
    sched, _ = make_scheduler(num_blocks=5, block_size=4)
    a, b = make_request("a", 6, max_tokens=8), make_request("b", 6, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    resumed = None
    for i in range(30):
        out = sched.schedule()
        resumed = next((s for s in out.scheduled if s.is_new and s.new_request.output_token_ids), None)
        if resumed is not None:
            break
        sched.update(out, {s.request_id: [40 + i] for s in out.scheduled})
    assert resumed is not None and sched.num_preemptions > 0
    r = sched.requests[resumed.request_id]
    outputs = list(r.output_token_ids)
    assert resumed.new_request.output_token_ids == outputs
    c, n = resumed.num_computed_tokens, resumed.num_new_tokens
    assert resumed.new_token_ids == r.all_token_ids[c : c + n]
    sched.update(out, {s.request_id: [99] for s in out.scheduled})
    assert r.output_token_ids[-1] == 99 and resumed.new_request.output_token_ids == outputs  # a copy


def test_prompt_logprobs_from_follows_the_engine_and_keeps_cache_reads_off():
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    prompt = list(range(100, 110))
    sched.add_request(make_request("warm", prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    r = make_request("p", prompt, max_tokens=2, prompt_logprobs=1)
    sched.add_request(r)
    out = sched.schedule()
    assert [(s.num_computed_tokens, s.prompt_logprobs_from) for s in out.scheduled] == [(0, 0)]  # no hit
    sched.update(out, {})
    r.advance_prompt_logprobs(4)
    out = sched.schedule()
    assert [s.prompt_logprobs_from for s in out.scheduled] == [4]
    sched.update(out, {})
    r.advance_prompt_logprobs(9)  # prompt positions 0..8 score tokens 1..9: all known
    assert not r.wants_prompt_logprobs
    assert [s.prompt_logprobs_from for s in sched.schedule().scheduled] == [None]
    # A one-token prompt has no position to score; a request that did not ask wants none.
    assert make_request("one", [5], prompt_logprobs=1).prompt_logprobs_from is None
    assert make_request("plain", 4).prompt_logprobs_from is None


def test_stop_conditions_from_params_and_cap():
    sp = SamplingParams(max_tokens=None, stop_token_ids=[7, 8], min_tokens=2)
    stop = StopConditions.from_params(sp, eos_token_id=2)
    assert stop == StopConditions(2, frozenset({7, 8}), 2, math.inf)
    assert StopConditions.from_params(sp.clone(ignore_eos=True), 2).eos_token_id is None
    assert stop.capped(5).max_output_tokens == 5 and stop.capped(5).capped(9).max_output_tokens == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        stop.min_tokens = 0


def test_stop_conditions_check():
    stop = StopConditions(2, frozenset({7}), 2, 5)
    assert stop.check([4], 0) is None
    assert stop.check([2], 0) is None  # EOS before min_tokens outputs
    assert stop.check([4, 2, 9], 0) == (2, RequestStatus.FINISHED_STOPPED)
    assert stop.check([7], 3) == (1, RequestStatus.FINISHED_STOPPED)
    assert stop.check([4, 4, 4, 4], 2) == (3, RequestStatus.FINISHED_LENGTH)  # the 5th output hits the cap
    assert stop.check([4, 4, 7], 2) == (3, RequestStatus.FINISHED_STOPPED)  # a stop token before length
    assert stop.check([5, 2], 3) == (2, RequestStatus.FINISHED_STOPPED)  # EOS is checked before length


def test_scheduler_caps_output_by_max_model_len_at_admission():
    sched, _ = make_scheduler(max_model_len=12)
    r = make_request("a", 8, max_tokens=100)
    assert r.stop_conditions.max_output_tokens == 100
    sched.add_request(r)
    assert r.stop_conditions.max_output_tokens == 4
    while sched.has_unfinished_requests():
        step(sched)
    assert (r.num_output_tokens, r.finish_reason) == (4, "length")


def test_a_step_with_kv_tier_copies_round_trips_through_msgpack():
    from pagoda.contracts.step import KVTransfer

    out = SchedulerOutput(kv_saves_first=[KVTransfer(3, 0, -(2**63))], kv_loads=[KVTransfer(4, 1, 2**63 - 1)],
                          kv_saves=[KVTransfer(5, 2, 12345)])
    assert not out.is_empty  # a step of copies alone still runs
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput)
    assert back == out and back.kv_loads[0].block_hash == 2**63 - 1
