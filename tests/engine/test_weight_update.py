"""Hot weight updates offline (`LLM.update_weights`) and the in-place prefix-cache flush, on two tiny
random checkpoints of one architecture (A and B, different seeds)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from tests.tiny_models import save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [3, 4, 100, 200, 7], list(range(10, 60))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    save_tiny_model("llama3", root / "A", seed=0)
    save_tiny_model("llama3", root / "B", seed=1)
    return root


def _llm(path) -> LLM:
    return LLM(str(path), dtype="float32", num_gpu_blocks_override=64, seed=0)


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _bad(checkpoints, name: str, change) -> str:
    """A copy of B with its weights file changed by `change(tensors) -> tensors | bytes`."""
    folder = checkpoints / name
    if not folder.exists():
        shutil.copytree(checkpoints / "B", folder)
        changed = change(load_file(str(folder / "model.safetensors")))
        if isinstance(changed, bytes):
            (folder / "model.safetensors").write_bytes(changed)
        else:
            save_file(changed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def test_update_weights_offline_equals_fresh_engine_on_b(checkpoints):
    llm = _llm(checkpoints / "A")
    out_a = _greedy(llm)
    assert llm.weight_version == "default"
    pool = llm.engine.core.kv_manager.block_pool
    assert pool.cached_block_hash_to_block  # A's prompts are cached
    result = llm.update_weights(str(checkpoints / "B"), version="v2")
    assert not pool.cached_block_hash_to_block  # flushed at the swap: no hit on KV computed by A
    assert result["previous_version"] == "default" and result["weight_version"] == "v2"
    assert llm.weight_version == "v2"
    out_b = _greedy(llm)
    fresh_b = _greedy(_llm(checkpoints / "B"))
    assert out_b == fresh_b
    assert out_b != out_a  # the swap really changed the weights
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert outs[0].weight_version == "v2"
    assert llm.update_weights(str(checkpoints / "A"))["weight_version"] == "A"  # default: the folder's name
    assert _greedy(llm) == out_a


def _drop_tensor(t):
    t.pop("model.layers.1.mlp.down_proj.weight")
    return t


def _reshape_tensor(t):
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:32].contiguous()
    return t


@pytest.mark.parametrize("case, change, words", [
    ("missing", _drop_tensor, ["down_proj"]),
    ("misshaped", _reshape_tensor, ["q_proj", "shape"]),
    ("unreadable", lambda t: b"\x00not a safetensors file at all" * 10, ["safetensors"]),
])
def test_bad_checkpoint_is_refused_and_a_keeps_serving(checkpoints, case, change, words):
    llm = _llm(checkpoints / "A")
    before = _greedy(llm)
    path = _bad(checkpoints, case, change)
    with pytest.raises(ValueError) as err:
        llm.update_weights(path)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert llm.weight_version == "default"
    assert _greedy(llm) == before


def test_other_architecture_and_other_shape_are_refused(checkpoints):
    llm = _llm(checkpoints / "A")
    before = _greedy(llm)
    save_tiny_model("qwen3", checkpoints / "qwen3", seed=2)
    with pytest.raises(ValueError, match="architecture Qwen3ForCausalLM differs"):
        llm.update_weights(str(checkpoints / "qwen3"))
    save_tiny_model("llama3", checkpoints / "wide", seed=2, hidden_size=128)
    with pytest.raises(ValueError, match="hidden_size is 128, the served model's is 64"):
        llm.update_weights(str(checkpoints / "wide"))
    with pytest.raises(ValueError, match="no such file or folder"):
        llm.update_weights(str(checkpoints / "nowhere"))
    assert _greedy(llm) == before


def test_flush_prefix_cache_unpublishes_blocks_in_use():
    from pagoda.kv.manager import KVCacheManager
    from pagoda.sched.request import Request

    kv = KVCacheManager(16, block_size=4)
    r = Request("r", list(range(10)), SamplingParams(max_tokens=4))
    kv.allocate_slots(r, 10)
    r.num_computed_tokens = 8
    kv.cache_blocks(r)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    kv.flush_prefix_cache()
    assert not kv.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in kv.req_to_blocks["r"])
    r.num_computed_tokens = 10
    kv.allocate_slots(r, 2)
    r.num_computed_tokens = 12
    kv.cache_blocks(r)  # its third block is full now, but computed partly on the old weights
    assert not kv.block_pool.cached_block_hash_to_block
    kv.free(r)
    assert not kv.block_pool.cached_block_hash_to_block and not kv.unpublishable
    assert kv.num_free_blocks == kv.num_usable_blocks
    r2 = Request("r2", list(range(10)), SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(r2)[1] == 0
