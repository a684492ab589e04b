"""Every supported architecture, with random tiny weights, gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.model.loader import load_model
from tests.conftest import hf_greedy, make_engine
from tests.tiny_models import save_tiny_model

PROMPTS = [[5, 17, 300, 42, 7], [100, 200, 300], list(range(40, 110))]


@pytest.mark.parametrize(
    "arch,shard",
    [("llama3", True), ("llama_linear", False), ("mistral", False), ("qwen2", True), ("qwen3", False)],
)
def test_greedy_equals_transformers(tmp_path, arch, shard):
    hf = save_tiny_model(arch, tmp_path, shard=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(str(tmp_path), dtype="float32")
    llm = make_engine(loaded, None, num_gpu_blocks_override=64)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    # And the logits themselves agree, not just their argmax.
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata

    ids = PROMPTS[2]
    with torch.no_grad():
        h = loaded.model(torch.tensor(ids), torch.arange(len(ids)),
                         AttentionContext(ContiguousKVBackend(), ContiguousMetadata([0], [len(ids)])))
        ours = loaded.model.compute_logits(h)
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
