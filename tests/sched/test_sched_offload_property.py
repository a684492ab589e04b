"""docs/testing.md C6 with a second KV tier: random arrivals, aborts, evictions, swap preemptions
and failed saves over a small pool and a small second tier, with the invariants checked after
every step and after every copy between the tiers.

Fake KV stores on both tiers double as the oracle (as in test_sched_property.py): each block and each
tier slot holds the token whose KV each of its positions would hold. The step's copies are carried
out as the runner does (saves of reusable blocks, then loads, then the forward's reads and writes,
then the background saves), so a load of the wrong slot, a slot overwritten while still needed, or
a block reused while a copy still reads it hands some request a wrong token and fails the read side.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.kv import KVCacheManager
from pagoda.kv.invariants import check_kv_invariants
from pagoda.kv.offload import SecondTier
from pagoda.sampling_params import SamplingParams
from pagoda.sched import Request, RequestStatus, Scheduler, SchedulerConfig

MAX_MODEL_LEN = 32
PREFIXES = [[], [1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 4, 3, 2, 1, 0, 1]]

new_request = st.tuples(
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(0, 4), min_size=1, max_size=12),
    st.integers(1, 10),  # max_tokens
    st.integers(0, 3),  # priority
)
step_events = st.tuples(
    st.lists(new_request, max_size=3),
    st.lists(st.integers(0, 50), max_size=2),  # aborts
    st.booleans(),  # a second arrival of an earlier prompt (a returning conversation)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caching=st.booleans(),
    swap=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 5),
    spare_blocks=st.integers(0, 8),
    num_slots=st.integers(1, 24),
    fail_rate=st.sampled_from([0.0, 0.0, 0.2]),
    events=st.lists(step_events, min_size=1, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_c6_second_tier_invariants_random_workload(
    caching, swap, policy, block_size, budget, max_num_seqs, spare_blocks, num_slots, fail_rate, events, seed
):
    rng = random.Random(seed)
    num_blocks = 1 + MAX_MODEL_LEN // block_size + spare_blocks
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, offload=SecondTier(num_slots))
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                        policy=policy, preemption_mode="swap" if swap else "recompute"),
        kv,
    )
    store: dict[int, list[int | None]] = {}  # first tier: block id -> token per position
    tier_store: dict[int, list[int | None]] = {}  # second tier: slot -> token per position
    objs: dict[str, Request] = {}
    prompts: list[list[int]] = []
    counts = {"loads": 0, "saves": 0, "swaps": 0}

    def check_all() -> None:
        check_kv_invariants(kv)
        assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0

    def copy(src: dict, src_id: int, dst: dict, dst_id: int) -> None:
        dst[dst_id] = list(src.get(src_id, [None] * block_size))
        check_all()  # after every copy

    def one_step() -> None:
        out = sched.schedule()
        check_all()
        pinned = {t.block_id for t in out.kv_saves}
        slots_written = [t.slot for t in out.kv_saves_first + out.kv_saves]
        assert len(set(slots_written)) == len(slots_written)
        assert not {t.slot for t in out.kv_loads} & set(slots_written)
        for t in out.kv_saves_first:
            copy(store, t.block_id, tier_store, t.slot)
        for t in out.kv_loads:
            copy(tier_store, t.slot, store, t.block_id)
        counts["loads"] += len(out.kv_loads)
        for s in out.scheduled:  # read side: everything before num_computed_tokens is right
            r = objs[s.request_id]
            for pos in range(s.num_computed_tokens):
                slot = store.get(s.block_ids[pos // block_size])
                assert slot is not None and slot[pos % block_size] == r.all_token_ids[pos], (r, pos)
        for s in out.scheduled:  # write side: never into a block a background save still reads
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                block_id = s.block_ids[pos // block_size]
                assert block_id not in pinned, f"the forward writes block {block_id} while it is saved"
                slot = store.setdefault(block_id, [None] * block_size)
                slot[pos % block_size] = objs[s.request_id].all_token_ids[pos]
        failed = []
        for t in out.kv_saves:
            if rng.random() < fail_rate:
                failed.append(t.slot)
                tier_store[t.slot] = [-1] * block_size  # a torn write: must never be read
            else:
                copy(store, t.block_id, tier_store, t.slot)
        counts["saves"] += len(out.kv_saves_first) + len(out.kv_saves)
        for t in out.kv_saves_first:
            if rng.random() < fail_rate:
                failed.append(t.slot)
                tier_store[t.slot] = [-1] * block_size
        sampled = {s.request_id: [rng.randrange(5)] for s in out.scheduled}
        sched.update(out, sampled, failed)
        check_all()

    n = 0
    for arrivals, aborts, again in events:
        new_prompts = [(PREFIXES[p] + suffix)[: MAX_MODEL_LEN - 2] for p, suffix, _, _ in arrivals]
        params = [(m, pr) for _, _, m, pr in arrivals]
        if again and prompts:
            new_prompts.append(prompts[rng.randrange(len(prompts))])
            params.append((rng.randint(1, 10), 0))
        for prompt, (max_tokens, priority) in zip(new_prompts, params):
            rid = f"r{n}"
            n += 1
            objs[rid] = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                arrival_time=float(n), priority=priority)
            sched.add_request(objs[rid])
            prompts.append(prompt)
        for a in aborts:
            live = sorted(sched.requests)
            if live:
                sched.abort_requests([live[a % len(live)]])
        check_all()
        one_step()
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        one_step()
    assert not sched.has_unfinished_requests()
    while kv.has_pending_transfers():  # what the engine core does once idle
        one_step()
    one_step()  # a step with nothing to do builds no transfers
    tier = kv.tier
    assert not tier.swapped and not tier.pending.saves and not tier.in_step.saves
    assert all(e.pins == 0 for e in tier.tier.entries.values())
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks) and kv.num_free_blocks == num_blocks - 1
    assert sched.num_preemptions >= tier.stats.swaps_out
    if not swap:
        assert tier.stats.swaps_out == 0
    check_kv_invariants(kv)
