"""Data-parallel replicas (`pagoda.engine.replica_set`): the routing policies and the prefix index
(units, plain data), the KV events the block pool reports, and DP=2 against DP=1 on SmolLM2 with
real engine-core processes (greedy tokens identical, both replicas used, the prefix index fed by
the replicas' own reports)."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.config import EngineArgs
from pagoda.contracts.messages import KVCacheEvents
from pagoda.engine.prefix_index import PrefixIndex, block_hashes
from pagoda.engine.routing import Router, rendezvous
from pagoda.kv.block_pool import BlockPool
from pagoda.sampling_params import SamplingParams
from pagoda.sched.request import Request


def test_router_hashes_equal_the_cores_block_hashes():
    tokens = list(range(100, 150))
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    req.bind_block_hashing(16)
    assert block_hashes(tokens, 16) == req.block_hashes
    assert len(req.block_hashes) == 3  # 50 tokens: three full blocks, the tail unhashed


def test_prefix_index_matches_leading_blocks_only_and_stays_bounded():
    idx = PrefixIndex(max_blocks=4)
    idx.insert(0, [1, 2, 3])
    assert idx.match(0, [1, 2, 3, 4]) == 3
    assert idx.match(0, [1, 5, 3]) == 1  # up to the first block it lacks
    assert idx.match(1, [1, 2]) == 0
    idx.insert(0, [7, 8])  # over the bound: the least recently used (2: 1 was matched since) goes
    assert idx.num_blocks(0) == 4 and idx.match(0, [2]) == 0 and idx.match(0, [1]) == 1
    assert idx.match(0, [7, 8]) == 2
    idx.apply_events(0, KVCacheEvents(stored=[9], removed=[7]))
    assert idx.match(0, [7]) == 0 and idx.match(0, [9]) == 1
    idx.apply_events(0, KVCacheEvents(stored=[5], cleared=True))
    assert idx.num_blocks(0) == 1 and idx.match(0, [5]) == 1


def test_block_pool_reports_published_and_evicted_hashes():
    pool = BlockPool(4)
    pool.record_events()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [11, 12, 13], 0, 3)
    assert pool.pop_events() == ([11, 12, 13], [], False)
    assert pool.pop_events() == ([], [], False)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)  # no untouched block left: the cached ones are evicted, LRU first
    stored, removed, cleared = pool.pop_events()
    assert stored == [] and sorted(removed) == [11, 12, 13] and not cleared
    unrecorded = BlockPool(4)
    unrecorded.cache_full_blocks(unrecorded.get_new_blocks(1), [5], 0, 1)
    assert unrecorded.pop_events() == ([], [], False)


def test_cache_aware_follows_the_longest_prefix_unless_loads_are_out_of_balance():
    router = Router("cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = router.choose({0: 0, 1: 0}, [1, 2, 3])
    assert first.reason == "least_cached"
    # A new prefix goes to the replica sent the fewest new blocks, even if it is busier.
    other = router.choose({first.replica: 0, 1 - first.replica: 2}, [7, 8])
    assert (other.replica, other.reason) == (1 - first.replica, "least_cached")
    assert router.choose({0: 0, 1: 0}, [20]).replica == other.replica  # sent 2 new blocks, not 3
    # The prompt's blocks now count as held there: the next request with that prefix follows it,
    # even onto the busier replica, while the imbalance stays within the thresholds.
    again = router.choose({0: 3, 1: 0} if first.replica == 0 else {0: 0, 1: 3}, [1, 2, 9])
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "prefix_match", 2)
    loads = {first.replica: 10, 1 - first.replica: 1}
    over = router.choose(loads, [1, 2, 3])
    assert (over.replica, over.reason) == (1 - first.replica, "imbalance")
    assert router.choose({0: 0, 1: 0}, []).reason == "least_load"
    router.forget_replica(first.replica)  # it restarted: it holds nothing, and is level with the other
    assert router.index.match(first.replica, [1, 2]) == 0
    assert router._new_blocks[first.replica] == router._new_blocks[1 - first.replica]


def test_least_load_round_robin_and_session():
    ll = Router("least_load")
    assert ll.choose({0: 5, 1: 2, 2: 9}).replica == 1
    # Equal loads: the replica least recently chosen, so sequential requests alternate.
    assert [ll.choose({0: 0, 1: 0}).replica for _ in range(4)] == [0, 1, 0, 1]
    rr = Router("round_robin")
    assert [rr.choose({0: 9, 1: 0, 2: 0}).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    s = Router("session")
    picks = {s.choose({0: 0, 1: 100}, session="alice").replica for _ in range(5)}
    assert picks == {rendezvous("alice", [0, 1])}  # load does not move a session
    assert len({rendezvous(f"user{i}", [0, 1]) for i in range(20)}) == 2  # keys spread over replicas
    assert s.choose({0: 0, 1: 3}).reason == "least_load"  # no key
    with pytest.raises(ValueError, match="routing policy must be one of"):
        Router("random")


def test_offline_engine_refuses_data_parallel():
    from pagoda.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="data_parallel_size > 1 is for `pagoda serve`"):
        LLMEngine(EngineArgs(device="cpu", data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineArgs(data_parallel_size=0)


async def _generate_all(engine, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, ids: list[int]) -> list[int]:
        out: list[int] = []
        async for o in engine.generate({"prompt_token_ids": ids}, params, request_id=f"p{i}"):
            out.extend(o.outputs[0].token_ids)
        return out

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids)))


@pytest.mark.slow
def test_dp2_greedy_equals_dp1_on_smollm2_and_replicas_report_their_prefixes(smollm2_prompt_ids, smollm2_tokenizer):
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.replica_set import DataParallelLLM

    common = dict(device="cpu", dtype="float32", max_model_len=512, num_gpu_blocks_override=200)
    long_prompt = (smollm2_prompt_ids[0] * 20)[:100]  # six full blocks of 16

    async def main():
        one = AsyncLLM(EngineArgs(**common), tokenizer=smollm2_tokenizer)
        await one.start()
        try:
            reference = await _generate_all(one, smollm2_prompt_ids, 24)
        finally:
            await one.shutdown()
        # round_robin: every other prompt on each replica, and routing inserts nothing in the
        # prefix index, so what it holds below came from the replicas' own KV events.
        two = DataParallelLLM(EngineArgs(data_parallel_size=2, **common), tokenizer=smollm2_tokenizer,
                              routing_policy="round_robin")
        await two.start()
        try:
            got = await _generate_all(two, smollm2_prompt_ids, 24)
            used = [two.routes[f"p{i}"].replica for i in range(len(smollm2_prompt_ids))]
            hashes = block_hashes(long_prompt, 16)
            await _generate_all(two, [long_prompt], 2)
            ran_on = two.routes["p0"].replica
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while two.router.index.match(ran_on, hashes) < len(hashes) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            matches = [two.router.index.match(r, hashes) for r in (0, 1)]
            return reference, got, used, ran_on, matches
        finally:
            await two.shutdown()

    reference, got, used, ran_on, matches = asyncio.run(main())
    assert got == reference
    assert sorted(set(used)) == [0, 1] and used.count(0) == used.count(1)
    assert matches[ran_on] == 6 and matches[1 - ran_on] == 0
