"""Mixtures of experts: the fused routed-expert layer against a naive per-expert loop, the routing
rules against transformers' routers (tied scores included), and Mixtral, Qwen2-MoE and Qwen3-MoE with
random tiny weights against transformers (greedy tokens identical, fp32 logits within 1e-4)."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.model.errors import ModelLoadError
from pagoda.model.fused_moe import StackedExperts, fused_experts, select_experts
from pagoda.model.loader import load_model
from tests.conftest import hf_greedy, make_engine
from tests.tiny_models import save_tiny_model

PROMPTS = [[5, 17, 300, 42, 7], [100, 200, 300], list(range(40, 110))]


def naive_moe(x, w13, w2, weights, ids):
    """Expert by expert, the tokens that chose it, as transformers' eager experts do."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w13[e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    return out


def _experts(num_experts=8, hidden=48, inter=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g).to(dtype) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g).to(dtype) * 0.2
    return w13, w2, g


@pytest.mark.parametrize("tokens", [1, 3, 7, 64])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_experts_equal_the_per_expert_loop(tokens, renormalize):
    w13, w2, g = _experts()
    x = torch.randn(tokens, 48, generator=g)
    logits = torch.randn(tokens, 8, generator=g)
    weights, ids = select_experts(logits, 2, renormalize)
    got = fused_experts(x, StackedExperts(w13, w2), weights, ids)
    want = naive_moe(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if tokens <= 3:  # at most 6 of the 8 experts chosen: some received no token
        assert len(set(ids.flatten().tolist())) < 8


def test_experts_without_tokens_and_every_token_on_one_expert():
    w13, w2, g = _experts()
    x = torch.randn(10, 48, generator=g)
    ids = torch.tensor([[3, 5]] * 10)  # only experts 3 and 5 get tokens; six get none
    weights = torch.rand(10, 2, generator=g)
    torch.testing.assert_close(fused_experts(x, StackedExperts(w13, w2), weights, ids), naive_moe(x, w13, w2, weights, ids))
    # An expert's weights that no token chose are never read: NaN there changes nothing.
    w13[0].fill_(float("nan"))
    w2[7].fill_(float("nan"))
    assert torch.isfinite(fused_experts(x, StackedExperts(w13, w2), weights, ids)).all()
    assert fused_experts(x[:0], StackedExperts(w13, w2), weights[:0], ids[:0]).shape == (0, 48)


def test_fused_experts_bf16_close_to_float32():
    w13, w2, g = _experts()
    x = torch.randn(32, 48, generator=g)
    weights, ids = select_experts(torch.randn(32, 8, generator=g), 2, True)
    want = naive_moe(x, w13, w2, weights, ids)
    got = fused_experts(x.bfloat16(), StackedExperts(w13.bfloat16(), w2.bfloat16()), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)


def test_expert_and_tensor_slices_sum_to_the_whole():
    """Expert parallel: each rank's experts; TP inside experts: each rank's rows of every expert.
    Either way the ranks' parts add up to the whole layer (the all-reduce's job)."""
    w13, w2, g = _experts(inter=24)
    x = torch.randn(20, 48, generator=g)
    weights, ids = select_experts(torch.randn(20, 8, generator=g), 2, False)
    whole = fused_experts(x, StackedExperts(w13, w2), weights, ids)
    by_experts = sum(fused_experts(x, StackedExperts(w13[s : s + 3], w2[s : s + 3]), weights, ids, s, 8) for s in (0, 3, 6))
    torch.testing.assert_close(by_experts, whole, atol=1e-5, rtol=1e-5)
    gate, up = w13.chunk(2, dim=1)
    halves = [(torch.cat([gate[:, r], up[:, r]], dim=1), w2[:, :, r]) for r in (slice(0, 10), slice(10, 24))]
    by_rows = sum(fused_experts(x, StackedExperts(a.contiguous(), b.contiguous()), weights, ids) for a, b in halves)
    torch.testing.assert_close(by_rows, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_routing_equals_transformers_router_with_tied_scores(arch):
    import transformers
    from tests.tiny_models import tiny_config

    config = tiny_config(arch)
    module = {"mixtral": transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
              "qwen2_moe": transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter,
              "qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter}[arch]
    router = module(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.weight[2] = router.weight[1]  # experts 1 and 2 always score the same
    x = torch.randn(200, config.hidden_size, generator=g)
    from pagoda.model.moe import moe_spec

    spec = moe_spec(config)
    with torch.no_grad():
        _, want_w, want_ids = router(x)
        got_w, got_ids = select_experts(x @ router.weight.t(), spec.top_k, spec.renormalize)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.float())
    # The tie decided something: tokens where exactly one of the tied experts made the top 2.
    one = ((want_ids == 1) | (want_ids == 2)).sum(-1) == 1
    assert one.any()


def _tie_routers(hf, folder, shard):
    """Experts 1 and 2 of every sparse layer get the same router row: their scores always tie."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p[2] = p[1]
    for old in folder.glob("*.safetensors*"):
        old.unlink()
    hf.save_pretrained(folder, **({"max_shard_size": "100KB"} if shard else {}))


MIX, SHARED, DENSE = "FusedMoE", "SharedExpertMoE", "LlamaMLP"
# arch, sharded checkpoint, config overrides, tied router scores, the layers' feed-forward blocks
CASES = [
    ("mixtral", True, {}, False, [MIX, MIX]),
    ("mixtral", False, {}, True, [MIX, MIX]),
    ("qwen2_moe", False, {}, False, [SHARED, SHARED]),
    ("qwen2_moe", False, {}, True, [SHARED, SHARED]),
    ("qwen3_moe", False, {}, False, [DENSE, MIX, MIX]),  # mlp_only_layers=[0]
    ("qwen3_moe", True, {"decoder_sparse_step": 2, "mlp_only_layers": []}, True, [DENSE, MIX, DENSE]),
]


@pytest.mark.parametrize("arch,shard,overrides,tied,kinds", CASES)
def test_greedy_and_logits_equal_transformers(tmp_path, arch, shard, overrides, tied, kinds):
    hf = save_tiny_model(arch, tmp_path, shard=shard, **overrides)
    if tied:
        _tie_routers(hf, tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(str(tmp_path), dtype="float32")
    assert [type(layer.mlp).__name__ for layer in loaded.model.model.layers] == kinds
    llm = make_engine(loaded, None, num_gpu_blocks_override=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    from pagoda.model.attention import AttentionContext, ContiguousKVBackend, ContiguousMetadata

    ids = PROMPTS[2]
    with torch.no_grad():
        h = loaded.model(torch.tensor(ids), torch.arange(len(ids)),
                         AttentionContext(ContiguousKVBackend(), ContiguousMetadata([0], [len(ids)])))
        ours = loaded.model.compute_logits(h)
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_missing_and_misshapen_expert_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_model("mixtral", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing expert tensor\(s\) model.layers.1.mlp.experts.3.up"):
        load_model(str(tmp_path), dtype="float32")
    save_file({**tensors, name: tensors[name][:5]}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"experts.3.w3.weight' \(expert 3, up\) has shape \(5, 64\)"):
        load_model(str(tmp_path), dtype="float32")
