"""Engine behaviours on a tiny random Llama: n > 1, seeds across batches, logprobs, aborts, no leaks."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest
import torch

from pagoda import SamplingParams, StructuredOutputsParams
from pagoda.contracts.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStats,
    KVCacheEvents,
    UtilityRequest,
    UtilityResult,
    decoder,
    encode,
)
from pagoda.engine.timeline import RequestTimeline
from pagoda.kv.invariants import check_kv_invariants
from pagoda.model.loader import load_model
from tests.conftest import hf_greedy, make_engine
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama3")
    hf = save_tiny_model("llama3", folder)
    return load_model(str(folder), dtype="float32"), hf


def test_n4_outputs_share_prompt_blocks(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64, block_size=16)
    eng = llm.engine
    prompt = list(range(10, 50))  # 40 tokens: two full blocks and a partial one
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), request_id="r")
    kv = eng.core.kv_manager
    seen_shared = False
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
        tables = [kv.get_block_ids(f"r#{i}") for i in range(4)]
        if all(tables):
            first_two = {tuple(t[:2]) for t in tables}
            assert len(first_two) == 1  # the same two prompt blocks in every child
            blocks = kv.block_pool.blocks
            assert all(blocks[b].ref_cnt == 4 for b in tables[0][:2])
            seen_shared = True
    assert seen_shared
    assert final.finished and len(final.outputs) == 4
    assert [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in final.outputs)
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1  # distinct samples
    assert kv.usage == 0.0


def test_seed_reproducible_inside_different_batches(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=128)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[1, 2, 3, 4]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([[9, 9, 9], [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]], [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([[7] * 20, [1, 2, 3, 4]], [other, seeded], use_tqdm=False)
    assert again[1].outputs[0].token_ids == alone
    different = llm.generate([[1, 2, 3, 4]], seeded.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_logprobs_equal_reference_log_softmax(tiny):
    loaded, hf = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64)
    prompt = [3, 14, 15, 92, 65]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top = torch.topk(ref, 3)
    (entry,) = out.logprobs
    sampled = out.token_ids[0]
    assert sampled == int(top.indices[0])
    assert abs(entry[sampled].logprob - ref[sampled].item()) < 1e-4
    for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert entry[tid].rank == rank
        assert abs(entry[tid].logprob - lp) < 1e-4
    assert abs(out.cumulative_logprob - ref[sampled].item()) < 1e-4


def test_top_k_1_equals_greedy(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64)
    prompts = [[1, 2, 3], [40, 41, 42, 43]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_abort_frees_blocks_and_many_requests_leave_nothing(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=40, max_num_seqs=8)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(30):
        eng.add_request({"prompt_token_ids": [i % 50 + 1] * (5 + i)}, params, request_id=f"q{i}")
    finished = set()
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finished  # answered exactly once
                finished.add(out.request_id)
        step += 1
        if step == 3:
            for i in range(0, 30, 3):
                eng.abort_request(f"q{i}")
    assert finished == {f"q{i}" for i in range(30) if i % 3}
    core = eng.core
    assert core.kv_manager.usage == 0.0
    assert not core.scheduler.requests and core.scheduler.num_running == 0 and core.scheduler.num_waiting == 0
    assert not eng.processor.has_unfinished()
    assert not core.runner.block_tables.row_of


def test_messages_round_trip():
    req = EngineCoreRequest("a", [1, 2, 3], SamplingParams(temperature=0.7, stop=["x"], seed=3, logprobs=2), eos_token_id=2, priority=-1, cache_salt="s")
    assert decoder(EngineCoreRequest).decode(encode(req)) == req
    out = EngineCoreOutput("a", [5], new_logprobs=[([5, 6], [-0.1, -2.0])], finish_reason="stop", stop_reason=5)
    assert decoder(EngineCoreOutput).decode(encode(out)) == out


def _all_fields_set(msg):
    """Check that a message sets every optional field away from its default, so that a field the
    encoder dropped or the decoder misread cannot hide behind the default; returns the message."""
    for f in msgspec.inspect.type_info(type(msg)).fields:
        if not f.required:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            assert getattr(msg, f.name) != default, f"{type(msg).__name__}.{f.name} left at its default"
    return msg


def test_c9_every_message_round_trips_with_every_field_set():
    sp = SamplingParams(
        n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.2,
        frequency_penalty=-0.3, seed=11, max_tokens=7, min_tokens=2, stop=["a", "bc"], stop_token_ids=[4, 5],
        ignore_eos=True, include_stop_str_in_output=True, logprobs=0, prompt_logprobs=1,
        logit_bias={3: -1.5}, structured_outputs=StructuredOutputsParams(choice=["a", "b"]), truncate_prompt_tokens=5,
        skip_special_tokens=False, detokenize=False, extra={"k": [1, "v"]},
    )
    for f in dataclasses.fields(SamplingParams):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert getattr(sp, f.name) != default, f"SamplingParams.{f.name} left at its default"
    req = _all_fields_set(EngineCoreRequest(
        "r#1", [1, 2, 3], sp, eos_token_id=2, arrival_time=12.5, priority=-3, cache_salt="salt",
        share_prompt_with="r#0",
    ))
    out = _all_fields_set(EngineCoreOutput(
        "r#1", [5, 6], new_logprobs=[([5, 9], [-0.25, -3.5]), ([6], [-0.5])], finish_reason="stop",
        stop_reason="bc", num_cached_tokens=16, queued_time=1.5, scheduled_time=2.5,
        prompt_logprobs=[([2, 7], [-1.25, -0.5], 3), ([3, 3], [-0.75, -0.75], 1)], error="weights swapped",
    ))
    stats = _all_fields_set(EngineCoreStats(
        num_running=1, num_waiting=2, kv_usage=0.25, prefix_cache_queries=40, prefix_cache_hits=16,
        num_preemptions=3, num_blocks=65, num_usable_blocks=64, num_free_blocks=48, num_steps=9,
        num_aborted_requests=1, spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=11,
        spec_num_accepted_tokens_per_pos=[5, 4, 2, 0], kv_offload_queries=30, kv_offload_hits=12,
        kv_offload_bytes_saved=4096, kv_offload_bytes_loaded=2048, num_swaps_out=2, num_swaps_in=1, pid=1234,
    ))
    ready = _all_fields_set(EngineCoreReady(
        max_model_len=512, vocab_size=512, num_blocks=65, num_usable_blocks=64, block_size=16,
        model_name="tiny", architecture="LlamaForCausalLM", dtype="float32", device="cpu", eos_token_id=2, pid=1234,
        weight_version="v7", weights_loaded_at=1.75,
    ))
    call = _all_fields_set(UtilityRequest(3, "timeline", ["r#1", 2]))
    # What the utilities really return: a timeline (one of each event) and the stats as a dict.
    tl = RequestTimeline("r#1", 1.0)
    tl.admitted(1.5, 16, False)
    tl.prefill_chunk(1.5, 16, 8)
    tl.token(2.0, 1, 1)
    tl.preempted(2.5, 3)
    tl.admitted(3.0, 16, True, {"device": [0, 2], "disk": [2, 4]})
    tl.token(3.5, 4, 1)
    running = tl.to_dict()  # an open decode run: None fields
    tl.finished(4.0, "length", 5)
    result = _all_fields_set(UtilityResult(3, result=[tl.to_dict(), running], error="none"))
    stats_result = UtilityResult(4, result=msgspec.structs.asdict(stats))
    kv_events = _all_fields_set(KVCacheEvents(stored=[-(2**63), 5], removed=[2**63 - 1], cleared=True))
    outputs = _all_fields_set(EngineCoreOutputs(
        outputs=[out, EngineCoreOutput("r#2", [])], stats=stats, utility=result, ready=ready,
        rejected={"r#3": "too long"}, failed="boom", config_error="KV cache too small", timestamp=3.25,
        iteration_tokens=[7, 1, 1], kv_events=kv_events, weight_version="v7",
    ))
    for msg in (req, out, stats, ready, call, result, stats_result, kv_events, outputs):
        assert decoder(type(msg)).decode(encode(msg)) == msg, type(msg).__name__
    # Defaults are omitted on the wire and come back as defaults.
    bare = EngineCoreRequest("b", [1], SamplingParams())
    assert decoder(EngineCoreRequest).decode(encode(bare)) == bare
    assert decoder(EngineCoreOutputs).decode(encode(EngineCoreOutputs())) == EngineCoreOutputs()
    # ABORT and FINISH carry a list of core request ids.
    ids = ["r#1", "r#2", "x"]
    assert decoder(list[str]).decode(encode(ids)) == ids


def test_bad_prompts_rejected_without_disturbing_others(tiny):
    loaded, _ = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 100000]], SamplingParams(max_tokens=4), use_tqdm=False)
    for ids in ("abc", None, [1.5, 2]):
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt logprobs of 21, which is greater than max allowed: 20"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, prompt_logprobs=21), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_cache_dtype_sizes_and_stores_the_cache(tiny):
    loaded, _ = tiny
    budget = 4 * 1024 * 1024
    full = make_engine(loaded, kv_cache_memory=budget).engine.core
    half = make_engine(loaded, kv_cache_memory=budget, kv_cache_dtype="float16").engine.core
    assert full.kv_cache.tensor.dtype == torch.float32 and half.kv_cache.tensor.dtype == torch.float16
    assert half.kv_cache.num_blocks == 2 * full.kv_cache.num_blocks  # the same bytes hold twice the tokens
    # Prefill with earlier context (a chunked prompt) and decodes read the float16 cache back.
    llm = make_engine(loaded, kv_cache_dtype="bfloat16", num_gpu_blocks_override=64, max_num_batched_tokens=16)
    out = llm.generate([list(range(3, 40)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert llm.engine.core.kv_manager.usage == 0.0


def test_kv_cache_dtype_errors(tiny):
    from pagoda.config import EngineArgs
    from pagoda.engine.kv_layout import kv_cache_dtype

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16, int8, fp8, fp8_e4m3; "
                                         "got 'fp8_e5m2'"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
    # Only the dtype choice: no CUDA machine needed.
    with pytest.raises(ValueError, match="supported on the CPU only"):
        kv_cache_dtype(EngineArgs(kv_cache_dtype="float16"), tiny[0], torch.device("cuda"))
    assert kv_cache_dtype(EngineArgs(), tiny[0], torch.device("cuda")) == torch.float32
    for name in ("fp8", "fp8_e4m3"):
        assert kv_cache_dtype(EngineArgs(kv_cache_dtype=name), tiny[0], torch.device("cuda")) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='fp8' needs a CUDA GPU \(e4m3, read by the Triton kernels\); "
                                         r"on the cpu use 'int8'$"):
        kv_cache_dtype(EngineArgs(kv_cache_dtype="fp8"), tiny[0], torch.device("cpu"))


GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY8, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]


def test_c1_fully_cached_prompts_still_compute_and_sample(tiny):
    loaded, hf = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64, block_size=16)
    p32 = list(range(100, 132))  # exactly two blocks
    p33 = p32 + [7]
    ref32, ref33 = hf_greedy(hf, p32, 8), hf_greedy(hf, p33, 8)
    assert _generate(llm, [p32]) == [(ref32, 0)]
    # Fully cached, a multiple of the block size: the last block is recomputed (16 cached, not 32).
    assert _generate(llm, [p32]) == [(ref32, 16)]
    # Fully cached but for its last token: one token is computed on top of 32 cached ones.
    assert _generate(llm, [p33]) == [(ref33, 32)]
    assert llm.engine.core.stats().prefix_cache_hits == 48
    assert llm.engine.core.kv_manager.usage == 0.0


def test_c2_same_step_shared_prefix_end_to_end(tiny):
    loaded, hf = tiny
    llm = make_engine(loaded, num_gpu_blocks_override=64, block_size=16)
    shared = list(range(200, 232))
    prompts = [shared + [5], shared + [6, 7], shared[:16] + [8] * 20]
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    # Admitted in one step: no request may use blocks the others are still computing.
    assert _generate(llm, prompts) == [(r, 0) for r in refs]
    # Once computed, they serve later requests: both shared blocks, or only the first.
    later = [shared + [9], shared[:16] + [1] * 17]
    assert _generate(llm, later) == [(hf_greedy(hf, later[0], 8), 32), (hf_greedy(hf, later[1], 8), 16)]
    assert llm.engine.core.kv_manager.usage == 0.0


def test_b9_cache_salt_keeps_prefix_cache_entries_apart(tiny):
    loaded, hf = tiny
    core = make_engine(loaded, num_gpu_blocks_override=64, block_size=16).engine.core
    prompt = list(range(300, 340))
    ref = hf_greedy(hf, prompt, 8)

    def run(rid, salt):
        core.add_request(EngineCoreRequest(rid, prompt, GREEDY8, cache_salt=salt))
        tokens, cached = [], []
        while core.has_unfinished_requests():
            for out in core.step():
                tokens += out.new_token_ids
                cached.append(out.num_cached_tokens)
        return tokens, cached[0]

    assert run("a1", "a") == (ref, 0)
    assert run("b1", "b") == (ref, 0)  # another salt: no hit
    assert run("n1", None) == (ref, 0)  # no salt is a salt of its own
    assert run("a2", "a") == (ref, 32)
    assert run("b2", "b") == (ref, 32)
    assert run("n2", None) == (ref, 32)
    assert core.kv_manager.usage == 0.0


def test_c3_preemption_keeps_seeded_and_greedy_outputs(tiny):
    loaded, hf = tiny
    prompts = [[i * 7 + j for j in range(20)] for i in range(1, 5)]
    seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(num_blocks, params):
        llm = make_engine(loaded, num_gpu_blocks_override=num_blocks, block_size=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        core = llm.engine.core
        assert core.kv_manager.usage == 0.0
        return [o.outputs[0].token_ids for o in outs], core.stats().num_preemptions

    # 4 requests of up to 50 tokens need 16 blocks of 16; 8 usable blocks force preemptions.
    roomy, tight = run(64, seeded), run(9, seeded)
    assert (roomy[1], tight[1] > 0) == (0, True)
    assert tight[0] == roomy[0]  # a resumed request draws what it would have drawn
    tokens, preemptions = run(9, greedy)
    assert preemptions > 0 and tokens == [hf_greedy(hf, p, 30) for p in prompts]


def test_a10_engine_leaves_nothing_behind_with_n_aborts_and_preemption(tiny):
    loaded, _ = tiny
    rng = random.Random(0)
    llm = make_engine(loaded, num_gpu_blocks_override=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=64)
    eng, core = llm.engine, llm.engine.core
    live, finished, aborted = set(), set(), set()
    n_added = 0
    for _ in range(400):
        if n_added < 30 and rng.random() < 0.5:
            rid = f"q{n_added}"
            n_added += 1
            prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(0, 8)] + [rng.randint(10, 400) for _ in range(rng.randint(1, 12))]
            params = SamplingParams(n=rng.choice([1, 2, 3]), temperature=1.0, seed=rng.randint(0, 9),
                                    max_tokens=rng.randint(1, 12), ignore_eos=True)
            eng.add_request({"prompt_token_ids": prompt}, params, request_id=rid)
            live.add(rid)
        if live and rng.random() < 0.15:
            rid = rng.choice(sorted(live))
            eng.abort_request(rid)
            live.discard(rid)
            aborted.add(rid)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finished | aborted  # answered once, never after an abort
                finished.add(out.request_id)
                live.discard(out.request_id)
        check_kv_invariants(core.kv_manager)
        if n_added == 30 and not eng.has_unfinished_requests():
            break
    assert n_added == 30 and not eng.has_unfinished_requests()
    assert finished | aborted == {f"q{i}" for i in range(30)} and len(aborted) >= 3
    assert core.stats().num_preemptions > 0
    sched = core.scheduler
    assert sched.requests == {} and sched.running == [] and len(sched.waiting) == 0 and not core._deferred
    assert core.kv_manager.usage == 0.0 and all(b.ref_cnt == 0 for b in core.kv_manager.block_pool.blocks)
    assert not eng.processor.has_unfinished()
    assert core.runner.block_tables.row_of == {} and core.runner.generators == {}
    assert core.timelines.live == {}
