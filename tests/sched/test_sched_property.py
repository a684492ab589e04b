"""docs/testing.md C6 (and A10) at the scheduler level: random arrivals, prompt lengths, priorities,
aborts and fake sampled tokens over a small pool, with the invariants checked after every step.

A fake KV store doubles as an oracle: every step, each scheduled request must find, in the slots of
its block table, the tokens of all the positions it claims as computed, as written by EARLIER steps
(so prefix-cache hits, evictions and preemptions can never hand a request someone else's KV, nor KV
that the same step is still writing). Then the step "writes" its new tokens into their slots.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.kv import KVCacheManager
from pagoda.kv.invariants import check_kv_invariants
from pagoda.sampling_params import SamplingParams
from pagoda.sched import Request, RequestStatus, Scheduler, SchedulerConfig

MAX_MODEL_LEN = 32
PREFIXES = [[], [1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 4, 3, 2, 1, 0, 1]]

new_request = st.tuples(
    st.integers(0, len(PREFIXES) - 1),  # shared prefix
    st.lists(st.integers(0, 4), min_size=1, max_size=12),  # own suffix
    st.integers(1, 10),  # max_tokens
    st.integers(0, 3),  # priority
    st.booleans(),  # eos 0 counts (else ignore_eos)
    st.integers(0, 3),  # min_tokens
)
step_events = st.tuples(
    st.lists(new_request, max_size=3),  # arrivals
    st.lists(st.integers(0, 50), max_size=2),  # aborts: indexes into the unfinished requests
)


def check_scheduler(sched: Scheduler, kv: KVCacheManager) -> None:
    check_kv_invariants(kv)
    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
    assert not running & waiting and running | waiting == set(sched.requests)
    assert set(kv.req_to_blocks) == running
    assert len(sched.running) <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(kv.get_block_ids(r.request_id)) * kv.block_size >= r.num_computed_tokens
        assert r.num_computed_tokens <= r.num_tokens
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunking=st.booleans(),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(1, 48),
    cap=st.integers(0, 8),
    max_num_seqs=st.integers(1, 6),
    spare_blocks=st.integers(0, 12),
    events=st.lists(step_events, min_size=1, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_c6_scheduler_invariants_random_workload(
    caching, policy, chunking, block_size, budget, cap, max_num_seqs, spare_blocks, events, seed
):
    if not chunking:
        budget = max(budget, MAX_MODEL_LEN)
    rng = random.Random(seed)
    # Room for one request of MAX_MODEL_LEN tokens at least (add_request refuses bigger ones).
    num_blocks = 1 + MAX_MODEL_LEN // block_size + spare_blocks
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunking,
        long_prefill_token_threshold=cap,
        policy=policy,
    )
    sched = Scheduler(config, kv)
    store: dict[int, list[int | None]] = {}  # block id -> the token whose KV each slot holds
    added: list[str] = []
    objs: dict[str, Request] = {}  # every request added, by id: steps name requests by id only
    reported: set[str] = set()  # ids seen in finished_request_ids
    t = 0.0

    def one_step() -> None:
        out = sched.schedule()
        for rid in out.finished_request_ids:
            assert rid not in reported and rid in added
            reported.add(rid)
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & reported and not set(ids) & set(out.preempted_request_ids)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= budget
        assert out.num_scheduled_tokens == {s.request_id: s.num_new_tokens for s in out.scheduled}
        if out.preempted_request_ids:
            assert not any(s.is_new for s in out.scheduled)
        # Oracle, read side: everything before num_computed_tokens was written by an earlier step.
        for s in out.scheduled:
            r, nc, nn = objs[s.request_id], s.num_computed_tokens, s.num_new_tokens
            assert nn >= 1 and nc + nn <= r.num_tokens
            if cap and chunking:
                assert nn <= cap
            if not chunking and s.is_new:
                assert nc + nn == r.num_tokens
            assert s.block_ids == kv.get_block_ids(r.request_id)
            assert len(s.block_ids) * block_size >= nc + nn
            if s.new_block_ids:
                assert s.block_ids[-len(s.new_block_ids) :] == s.new_block_ids
            for pos in range(nc):
                slot = store.get(s.block_ids[pos // block_size])
                assert slot is not None and slot[pos % block_size] == r.all_token_ids[pos], (r, pos)
        # Oracle, write side.
        for s in out.scheduled:
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                slot = store.setdefault(s.block_ids[pos // block_size], [None] * block_size)
                slot[pos % block_size] = objs[s.request_id].all_token_ids[pos]
        # Fake sampler: a token for everyone (mid-prompt ones must be ignored), sometimes two.
        sampled = {rid: [rng.randrange(5) for _ in range(rng.choice((1, 1, 1, 2)))] for rid in ids}
        before = {s.request_id: objs[s.request_id].num_output_tokens for s in out.scheduled}
        changed = sched.update(out, sampled)
        for s in out.scheduled:
            r = objs[s.request_id]
            if s.samples and r in changed:
                assert r.num_output_tokens > before[r.request_id]
            else:
                assert r.num_output_tokens == before[r.request_id]
            if r.is_finished():
                assert r.request_id not in sched.requests and r.finish_reason in ("stop", "length")
        check_scheduler(sched, kv)

    for arrivals, aborts in events:
        for prefix, suffix, max_tokens, priority, use_eos, min_tokens in arrivals:
            prompt = (PREFIXES[prefix] + suffix)[: MAX_MODEL_LEN - 2]
            params = SamplingParams(
                max_tokens=max_tokens, ignore_eos=not use_eos, min_tokens=min(min_tokens, max_tokens)
            )
            rid = f"r{len(added)}"
            t += 1.0
            objs[rid] = Request(rid, prompt, params, eos_token_id=0, arrival_time=t, priority=priority)
            sched.add_request(objs[rid])
            added.append(rid)
        for a in aborts:
            live = sorted(sched.requests)
            if live:
                sched.abort_requests([live[a % len(live)]])
        check_scheduler(sched, kv)
        one_step()

    # Drain: with no more arrivals every request must end (max_tokens bounds them all).
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        one_step()
    assert not sched.has_unfinished_requests()
    out = sched.schedule()  # flush the last finished ids
    reported.update(out.finished_request_ids)
    assert out.scheduled == [] and reported == set(added)  # every request answered exactly once

    assert sched.requests == {} and sched.running == [] and len(sched.waiting) == 0
    assert kv.req_to_blocks == {} and kv.req_to_block_ids == {} and kv.num_cached_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == num_blocks - 1 and kv.usage == 0.0
    check_kv_invariants(kv)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.cached_block_hash_to_block == {}
