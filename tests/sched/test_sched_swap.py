"""Swap preemption (preemption_mode="swap") with exact values: the victim's blocks are copied to the
second tier before the step that reuses them and loaded back into its new blocks on resume; the
scheduler swaps only when the measured transfer costs less than recomputing; no room in the
second tier means recompute."""

from __future__ import annotations

from sched_helpers import make_request, step

from pagoda.kv import KVCacheManager
from pagoda.kv.invariants import check_kv_invariants
from pagoda.kv.offload import SecondTier
from pagoda.sched import Scheduler, SchedulerConfig


def _run_until_b_is_preempted(num_slots: int = 16, swap_costs=None):
    # 6 usable blocks of 4 tokens; a and b take 3 each, a's 13th token needs a 4th: b is the victim.
    kv = KVCacheManager(7, 4, enable_prefix_caching=False, offload=SecondTier(num_slots))
    sched = Scheduler(SchedulerConfig(preemption_mode="swap"), kv)
    sched.swap_costs = swap_costs
    a, b = make_request("a", 10, max_tokens=4), make_request("b", 10, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        out, _ = step(sched)
        assert not out.preempted_request_ids
    b_blocks = list(kv.get_block_ids("b"))
    assert (a.num_computed_tokens, b.num_computed_tokens, len(b_blocks)) == (12, 12, 3)
    out = sched.schedule()
    assert out.preempted_request_ids == ["b"]
    check_kv_invariants(kv)
    return sched, kv, b, b_blocks, out


def test_swap_out_copies_every_computed_block_before_the_step_and_loads_them_on_resume():
    sched, kv, b, b_blocks, out = _run_until_b_is_preempted()
    # Copied before this step's forward, which may write the freed blocks (a took one).
    assert [t.block_id for t in out.kv_saves_first] == b_blocks and out.kv_saves == []
    slots = [t.slot for t in out.kv_saves_first]
    assert kv.tier.swapped["b"].num_computed_tokens == 12 and b.num_computed_tokens == 0
    sched.update(out, {"a": [7]})
    check_kv_invariants(kv)
    resumed = None
    for _ in range(10):
        out = sched.schedule()
        rows = {s.request_id: s for s in out.scheduled}
        if "b" in rows and rows["b"].is_new:
            resumed = rows["b"]
            break
        sched.update(out, {rid: [7] for rid in rows})
    assert resumed is not None
    # All 12 computed tokens come back: the resume computes only the token sampled before it left.
    assert (resumed.num_computed_tokens, resumed.num_new_tokens) == (12, 1)
    assert [(t.slot, t.block_id) for t in out.kv_loads] == list(zip(slots, resumed.block_ids[:3]))
    sched.update(out, {"b": [7]})
    check_kv_invariants(kv)
    stats = kv.tier.stats
    assert (stats.swaps_out, stats.swaps_in, stats.saved_blocks, stats.loaded_blocks) == (1, 1, 3, 3)
    # b's blocks were its own (no prefix caching): their entries are dropped once loaded.
    assert kv.tier.tier.entries == {} and kv.tier.tier.num_free_slots == 16


def test_swap_only_when_moving_the_blocks_costs_less_than_recomputing():
    # 3 blocks out and back in at 1 s each against 12 tokens at 1 us: recompute.
    _, kv, b, _, out = _run_until_b_is_preempted(swap_costs=(1.0, 1e-6))
    assert out.kv_saves_first == [] and "b" not in kv.tier.swapped and kv.tier.stats.swaps_out == 0
    _, kv, b, _, out = _run_until_b_is_preempted(swap_costs=(1e-6, 1.0))
    assert len(out.kv_saves_first) == 3 and kv.tier.stats.swaps_out == 1


def test_no_room_in_the_second_tier_recomputes_and_leaves_it_as_it_was():
    _, kv, b, _, out = _run_until_b_is_preempted(num_slots=2)  # 3 blocks to keep, 2 slots
    assert out.kv_saves_first == [] and "b" not in kv.tier.swapped
    assert kv.tier.stats.swap_fallbacks == 1 and kv.tier.tier.num_free_slots == 2 and kv.tier.tier.entries == {}
