"""The second KV tier end to end on a tiny random Llama: greedy output with the host-memory and the
disk tier and with swap preemption equals transformers' (and the output without them), under
chunked prefill and prefix caching, while the tier is really used; the timeline names the tiers;
a disk tier's blocks survive a new engine with the same weights and settings, a corrupt or stale
file is skipped with a warning, other settings never read them."""

from __future__ import annotations

import logging

import pytest

from pagoda import SamplingParams
from pagoda.kv.invariants import check_kv_invariants
from pagoda.model.loader import load_model
from tests.conftest import hf_greedy, make_engine
from tests.tiny_models import save_tiny_model

SYSTEM = [1, 2, 3, 4] * 6  # a shared prefix of 24 tokens
PROMPTS = [SYSTEM + [(i * 37 + j * 11) % 500 + 5 for j in range(26)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# A pool of 24 usable blocks of 4 tokens: 3 running requests of up to 60 tokens need 15 each at
# most, so the 8 conversations cannot all stay cached and 3 at a time preempt one another.
TIGHT = dict(num_gpu_blocks_override=25, block_size=4, max_num_seqs=3, max_num_batched_tokens=32,
             long_prefill_token_threshold=20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama3_offload")
    hf = save_tiny_model("llama3", folder)
    return load_model(str(folder), dtype="float32"), hf


@pytest.fixture(scope="module")
def reference(tiny):
    _, hf = tiny
    first = [hf_greedy(hf, p, 10) for p in PROMPTS]
    # The second turn: each conversation comes back with its answer and a new user message.
    second_prompts = [p + out + [7, 8, 9] for p, out in zip(PROMPTS, first)]
    return first, second_prompts, [hf_greedy(hf, p, 10) for p in second_prompts]


def two_turns(llm, second_prompts):
    outs = []
    for prompts in (PROMPTS, second_prompts):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in res])
        check_kv_invariants(llm.engine.core.kv_manager)
    return outs


@pytest.mark.parametrize("backend", ["cpu", "disk"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_second_tier_and_swap_keep_greedy_output(tiny, reference, tmp_path, backend, mode):
    loaded, _ = tiny
    first, second_prompts, second = reference
    llm = make_engine(loaded, kv_offloading_size=0.01, kv_offloading_backend=backend,
                      kv_offloading_dir=str(tmp_path), preemption_mode=mode, **TIGHT)
    assert two_turns(llm, second_prompts) == [first, second]
    core = llm.engine.core
    s = core.stats()
    # The tier was used: second turns loaded their first turn's blocks instead of computing them.
    assert s.kv_offload_hits >= 8 * 4 and s.kv_offload_bytes_loaded > 0 and s.kv_offload_bytes_saved > 0
    assert s.num_preemptions > 0
    if mode == "swap":
        assert s.num_swaps_out > 0 and s.num_swaps_in > 0
        # Measured: a block's copy and a token's compute, which the scheduler weighs per victim.
        per_block, per_token = core.scheduler.swap_costs
        assert per_block > 0 and per_token > 0
    else:
        assert s.num_swaps_out == 0
    kv = core.kv_manager
    assert kv.usage == 0.0 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not kv.tier.swapped and not kv.has_pending_transfers()
    check_timeline_tiers(core, backend)


def check_timeline_tiers(core, backend):
    """Each second-turn request's admission says which blocks came from which tier."""
    seen = []
    for i in range(len(PROMPTS), 2 * len(PROMPTS)):  # the second turn's requests
        for tl in core.timeline(str(i)):
            admitted = [e for e in tl["events"] if e["event"] == "admitted"][0]
            blocks = admitted["blocks_from"]
            assert set(blocks) == {"device", backend} and blocks["device"][0] == 0
            assert blocks["device"][1] == blocks[backend][0] <= blocks[backend][1]
            assert admitted["cached_tokens"] == 4 * blocks[backend][1]
            seen.append(blocks[backend][1] - blocks[backend][0])
    assert len(seen) == len(PROMPTS) and sum(seen) > 0


def test_swap_without_prefix_caching_keeps_greedy_output(tiny, reference):
    loaded, _ = tiny
    first, _, _ = reference
    llm = make_engine(loaded, kv_offloading_size=0.01, preemption_mode="swap", enable_prefix_caching=False, **TIGHT)
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in res] == first
    s = llm.engine.core.stats()
    assert s.num_swaps_in > 0 and s.prefix_cache_hits == 0 and s.kv_offload_hits == 0
    # Every resume loaded its blocks back: no preempted request recomputed its context.
    assert s.num_swaps_in == s.num_swaps_out == s.num_preemptions


def _disk_run(loaded, folder, prompt, **kw):
    llm = make_engine(loaded, kv_offloading_size=0.01, kv_offloading_backend="disk", kv_offloading_dir=str(folder),
                      num_gpu_blocks_override=64, block_size=4, **kw)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    stats = llm.engine.core.stats()
    llm.engine.core.shutdown()
    return out, stats


def test_disk_tier_survives_a_restart_and_skips_corrupt_files(tiny, reference, tmp_path, caplog):
    loaded, _ = tiny
    first, _, _ = reference
    prompt = PROMPTS[0]  # 50 tokens: 12 full blocks can come back (the last token is computed)
    out, _ = _disk_run(loaded, tmp_path, prompt)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == first[0]
    files = sorted(tmp_path.glob("*/slot-*.kvb"))
    assert len(files) >= 12

    out, stats = _disk_run(loaded, tmp_path, prompt)  # a new engine: its first tier is empty
    assert out.num_cached_tokens == stats.kv_offload_hits == 48 and stats.prefix_cache_hits == 0
    assert out.outputs[0].token_ids == first[0]

    # Flip a byte in the payload of one file: it is skipped at start-up, never loaded.
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="pagoda.exec.kv_offload_disk"):
        out, stats = _disk_run(loaded, tmp_path, prompt)
    assert any("corrupt" in r.getMessage() and victim.name in r.getMessage() for r in caplog.records)
    assert 0 <= out.num_cached_tokens < 48 and out.outputs[0].token_ids == first[0]

    # Other cache settings (a bfloat16 cache) are another key: another folder, nothing read.
    out, stats = _disk_run(loaded, tmp_path, prompt, kv_cache_dtype="bfloat16")
    assert out.num_cached_tokens == 0 and stats.kv_offload_hits == 0
    assert len(list(tmp_path.iterdir())) == 2


def test_stale_file_in_the_folder_is_skipped(tiny, tmp_path, caplog):
    loaded, _ = tiny
    prompt = PROMPTS[1]
    _disk_run(loaded, tmp_path, prompt)
    _disk_run(loaded, tmp_path, prompt, kv_cache_dtype="bfloat16")
    ours, other = sorted(tmp_path.iterdir(), key=lambda p: min(f.stat().st_mtime for f in p.iterdir()))
    # A file of the bfloat16 cache copied under a slot name of the float32 cache's folder.
    stale = sorted(other.glob("slot-*.kvb"))[0]
    target = ours / "slot-0000999.kvb"
    target.write_bytes(stale.read_bytes())
    with caplog.at_level(logging.WARNING, logger="pagoda.exec.kv_offload_disk"):
        out, stats = _disk_run(loaded, tmp_path, prompt)
    assert any("stale" in r.getMessage() and target.name in r.getMessage() for r in caplog.records)
    assert out.num_cached_tokens == 48


def test_bad_offload_flags_are_one_line_errors(tiny):
    loaded, _ = tiny
    with pytest.raises(ValueError, match="needs a second KV tier"):
        make_engine(loaded, preemption_mode="swap")
    with pytest.raises(ValueError, match="positive number of GiB"):
        make_engine(loaded, kv_offloading_size=0)
    with pytest.raises(ValueError, match="kv_offloading_backend must be one of cpu, disk"):
        make_engine(loaded, kv_offloading_size=1, kv_offloading_backend="nvme")
    with pytest.raises(ValueError, match="needs prefix caching"):
        make_engine(loaded, kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block"):
        make_engine(loaded, kv_offloading_size=1e-9)
