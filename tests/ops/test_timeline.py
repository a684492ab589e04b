"""Request timelines recorded by the engine core: admissions, prefill chunks, decode runs,
preemptions and the finish, on a tiny random model in-process."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from pagoda.contracts.messages import EngineCoreRequest
from pagoda.engine.timeline import TimelineStore
from tests.conftest import make_engine


def _run(core, requests):
    for r in requests:
        core.add_request(r)
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    return outputs


def test_preempted_request_timeline_shows_preemption_and_both_admissions(tiny_llama3_fp32):
    # 12 usable blocks of 16 tokens; two requests that each grow to 7 blocks cannot both fit.
    core = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=13, block_size=16, max_num_batched_tokens=64).engine.core
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    reqs = [EngineCoreRequest(f"r{i}", list(range(5 + i, 37 + i)), params) for i in range(2)]
    outputs = _run(core, reqs)
    assert core.scheduler.num_preemptions >= 1
    victims = [rid for rid in ("r0", "r1") if core.timeline(rid)[0]["num_preemptions"]]
    assert victims
    tl = core.timeline(victims[0])[0]
    kinds = [e["event"] for e in tl["events"]]
    assert tl["status"] == "finished" and tl["num_admissions"] == tl["num_preemptions"] + 1
    assert kinds[0] == "arrived" and kinds[-1] == "finished"
    first_admit = kinds.index("admitted")
    preempt = kinds.index("preempted")
    second_admit = kinds.index("admitted", preempt)
    assert first_admit < preempt < second_admit
    admits = [e for e in tl["events"] if e["event"] == "admitted"]
    assert admits[0]["resumed"] is False and admits[1]["resumed"] is True
    # The resume recomputes prompt + outputs so far: its prefill chunks cover them.
    pre = tl["events"][preempt]
    after = [e for e in tl["events"][second_admit:] if e["event"] == "prefill"]
    assert sum(e["tokens"] for e in after) + admits[1]["cached_tokens"] == 32 + pre["output_tokens"]
    # Decode runs account for every output token but the one each admission's prefill produced.
    decoded = sum(e["tokens"] for e in tl["events"] if e["event"] == "decode")
    assert tl["events"][-1]["output_tokens"] == 80
    assert decoded == 80 - tl["num_admissions"]
    times = [e.get("time", e.get("start")) for e in tl["events"]]
    assert times == sorted(times)
    first = next(o for o in outputs if o.request_id == victims[0] and o.scheduled_time)
    assert first.scheduled_time == admits[0]["time"]
    assert first.queued_time == tl["arrival_time"] == tl["events"][0]["time"]  # the core's own clock


def test_chunked_prefill_and_prefix_hit_in_timeline(tiny_llama3_fp32):
    core = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, block_size=16, max_num_batched_tokens=32,
                       enable_chunked_prefill=True).engine.core
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = list(range(1, 81))  # 80 tokens: 3 chunks of <= 32
    _run(core, [EngineCoreRequest("a", prompt, params)])
    _run(core, [EngineCoreRequest("b", prompt, params)])
    a, b = core.timeline("a")[0], core.timeline("b")[0]
    assert [e["tokens"] for e in a["events"] if e["event"] == "prefill"] == [32, 32, 16]
    admit_b = next(e for e in b["events"] if e["event"] == "admitted")
    assert admit_b["cached_tokens"] == 64  # 4 full blocks reused; the last block is computed
    assert [e["tokens"] for e in b["events"] if e["event"] == "prefill"] == [16]
    assert [e["event"] for e in a["events"]] == ["arrived", "admitted", "prefill", "prefill", "prefill",
                                                 "first_token", "decode", "finished"]


def test_aborted_and_unknown_and_bounded(tiny_llama3_fp32):
    core = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64).engine.core
    core.add_request(EngineCoreRequest("x", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    core.step()
    core.step()
    live = core.timeline("x")[0]
    assert live["status"] == "running" and live["events"][-1]["event"] == "decode"
    core.abort_requests(["x"])
    tl = core.timeline("x")[0]
    assert tl["events"][-1] == {**tl["events"][-1], "event": "finished", "reason": "abort", "output_tokens": 2}
    assert core.timeline("nope") == []
    store = TimelineStore(max_finished=3)
    for i in range(5):
        store.start(f"q{i}", float(i))
        store.end(f"q{i}", float(i) + 1, "stop", 1)
    assert [store.get(f"q{i}") is not None for i in range(5)] == [False, False, True, True, True]


def test_n_gt_1_sequences_found_by_parent_id(tiny_llama3_fp32):
    core = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64).engine.core
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    _run(core, [EngineCoreRequest("p#0", [1, 2, 3], params), EngineCoreRequest("p#1", [1, 2, 3], params)])
    assert [t["request_id"] for t in core.timeline("p")] == ["p#0", "p#1"]


def test_refused_request_leaves_no_timeline_and_keeps_the_live_one(tiny_llama3_fp32):
    core = make_engine(tiny_llama3_fp32, num_gpu_blocks_override=64, max_model_len=64).engine.core
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", [1, 2, 3], params))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(EngineCoreRequest("a", [4, 5], params))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        core.add_request(EngineCoreRequest("big", list(range(100)), params))
    assert set(core.timelines.live) == {"a"}
    while core.has_unfinished_requests():
        core.step()
    assert core.timeline("a")[0]["events"][-1]["reason"] == "length"
    assert not core.timelines.live
