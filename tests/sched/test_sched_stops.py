"""docs/testing.md A5: stop conditions applied by update(), with exact outputs and reasons."""

from __future__ import annotations

from sched_helpers import make_request, make_scheduler, step

from pagoda.sched import RequestStatus

EOS = 2


def run(request, token_lists, **config):
    """Admit `request`, then feed it one list of sampled tokens per step until it finishes."""
    sched, kv = make_scheduler(**config)
    sched.add_request(request)
    for tokens in token_lists:
        _, changed = step(sched, {request.request_id: tokens})
        assert changed == [request]
        if request.is_finished():
            break
    assert kv.req_to_blocks == {} or not request.is_finished()
    return sched


def test_a5_eos_stops():
    r = make_request("r", 4, eos=EOS)
    run(r, [[5], [EOS], [6]])
    assert r.output_token_ids == [5, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert (r.finish_reason, r.stop_reason) == ("stop", None)


def test_a5_stop_token_id_records_stop_reason():
    r = make_request("r", 4, eos=EOS, stop_token_ids=[9, 11])
    run(r, [[5], [11], [6]])
    assert r.output_token_ids == [5, 11]
    assert (r.status, r.finish_reason, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "stop", 11)


def test_a5_max_tokens_cuts_extra_speculative_tokens():
    r = make_request("r", 4, max_tokens=3, eos=EOS)
    run(r, [[5], [6, 7, 8, 9]])
    assert r.output_token_ids == [5, 6, 7]
    assert r.all_token_ids[-3:] == [5, 6, 7] and r.num_tokens == 7
    assert (r.status, r.finish_reason, r.stop_reason) == (RequestStatus.FINISHED_LENGTH, "length", None)


def test_a5_eos_inside_a_multi_token_step_cuts_the_rest():
    r = make_request("r", 4, max_tokens=10, eos=EOS)
    run(r, [[5, 6, EOS, 8, 9]])
    assert r.output_token_ids == [5, 6, EOS]
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_a5_ignore_eos_runs_to_max_tokens():
    r = make_request("r", 4, max_tokens=3, eos=EOS, ignore_eos=True)
    run(r, [[EOS], [EOS], [EOS], [EOS]])
    assert r.output_token_ids == [EOS, EOS, EOS]
    assert (r.status, r.finish_reason) == (RequestStatus.FINISHED_LENGTH, "length")


def test_a5_ignore_eos_still_honours_stop_token_ids():
    r = make_request("r", 4, eos=EOS, ignore_eos=True, stop_token_ids=[9])
    run(r, [[EOS], [9]])
    assert r.output_token_ids == [EOS, 9] and r.stop_reason == 9


def test_a5_min_tokens_suppresses_earlier_stops():
    r = make_request("r", 4, max_tokens=10, min_tokens=3, eos=EOS, stop_token_ids=[9])
    run(r, [[EOS], [9], [EOS], [5]])
    assert r.output_token_ids == [EOS, 9, EOS]  # the third output may stop
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)


def test_a5_min_tokens_inside_a_multi_token_step():
    r = make_request("r", 4, max_tokens=10, min_tokens=2, eos=EOS)
    run(r, [[EOS, EOS, 5]])
    assert r.output_token_ids == [EOS, EOS]


def test_a5_max_model_len_stops():
    r = make_request("r", 8, max_tokens=None, eos=EOS)
    run(r, [[5], [6], [7]], max_model_len=10)
    assert r.output_token_ids == [5, 6] and r.num_tokens == 10
    assert (r.status, r.finish_reason) == (RequestStatus.FINISHED_LENGTH, "length")


def test_a5_prompt_of_max_model_len_gets_one_token():
    r = make_request("r", 10, max_tokens=None)
    run(r, [[5], [6]], max_model_len=10)
    assert r.output_token_ids == [5] and r.finish_reason == "length"


def test_a5_eos_on_the_last_allowed_token_is_a_stop():
    r = make_request("r", 4, max_tokens=2, eos=EOS)
    run(r, [[5], [EOS]])
    assert (r.output_token_ids, r.finish_reason) == ([5, EOS], "stop")


def test_finish_requests_with_a_stop_string():
    sched, kv = make_scheduler()
    r = make_request("r", 4)
    sched.add_request(r)
    step(sched)
    sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)  # the engine matched a stop string
    assert (r.status, r.finish_reason) == (RequestStatus.FINISHED_STOPPED, "stop")
    assert kv.req_to_blocks == {} and sched.running == []
    out, _ = step(sched)
    assert out.scheduled == [] and out.finished_request_ids == ["r"]
