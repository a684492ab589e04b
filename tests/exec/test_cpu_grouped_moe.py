"""The grouped bf16 MoE kernel (pagoda/exec/cpu_grouped_moe.py, csrc/moe_experts.cpp) computes what
the per-expert loop computes, on the rows it is given and only those, and the runner uses it for
bf16 experts whose shapes tile."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_grouped_moe import GroupedExperts, grouped_applies, grouped_fused_experts, grouped_kernel
from pagoda.exec.cpu_moe import PackedExperts, pack_experts
from pagoda.model.fused_moe import StackedExperts, fused_experts, select_experts
from pagoda.model.loader import load_model
from tests.model.test_moe import naive_moe
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(grouped_kernel() is None, reason="the grouped kernel needs AVX512-BF16")


def _experts(num_experts=8, hidden=128, inter=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).bfloat16()
    return w13, w2, g


@pytest.mark.parametrize("tokens", [1, 3, 8, 32, 77])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_equals_the_modules_path_and_the_per_expert_loop(tokens, renormalize):
    w13, w2, g = _experts()
    x = torch.randn(tokens, 128, generator=g).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, 8, generator=g), 2, renormalize)
    got = grouped_fused_experts(x, GroupedExperts(w13, w2), weights, ids)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    # The modules' path in bf16 rounds at the same places; the dot products' order differs, which can
    # move a rounded value by a bf16 step.
    modules = fused_experts(x, StackedExperts(w13, w2), weights, ids)
    torch.testing.assert_close(got, modules, atol=2e-2, rtol=2e-2)
    assert (got == modules).float().mean() > 0.95
    exact = naive_moe(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), exact, atol=4e-2, rtol=4e-2)


def test_experts_without_tokens_are_not_read():
    w13, w2, g = _experts()
    x = torch.randn(10, 128, generator=g).bfloat16()
    ids = torch.tensor([[3, 5]] * 9 + [[5, 3]])  # six experts get no token
    weights = torch.rand(10, 2, generator=g)
    w13[0].fill_(float("nan"))
    w2[7].fill_(float("nan"))
    got = grouped_fused_experts(x, GroupedExperts(w13, w2), weights, ids)
    assert torch.isfinite(got).all()
    w13[0].zero_()
    w2[7].zero_()
    torch.testing.assert_close(got.float(), naive_moe(x.float(), w13.float(), w2.float(), weights, ids),
                               atol=4e-2, rtol=4e-2)
    assert grouped_fused_experts(x[:0], GroupedExperts(w13, w2), weights[:0], ids[:0]).shape == (0, 128)


def test_a_token_gets_the_same_bits_alone_or_among_many():
    # Among 77 tokens an expert has 15-24 rows, which the micro-kernel takes in two passes (of up to
    # 12 rows, kMRHalves); alone, a token's expert has one row and one pass. A row's sums add in the
    # same order either way, so a token's output does not depend on its batch.
    w13, w2, g = _experts(hidden=192, inter=160)
    x = torch.randn(77, 192, generator=g).bfloat16()
    weights, ids = select_experts(torch.randn(77, 8, generator=g), 2, True)
    experts = GroupedExperts(w13, w2)
    together = grouped_fused_experts(x, experts, weights, ids)
    alone = torch.cat([grouped_fused_experts(x[t : t + 1], experts, weights[t : t + 1], ids[t : t + 1])
                       for t in range(77)])
    assert torch.bincount(ids.flatten(), minlength=8).min() > 12  # every expert takes two passes
    assert torch.equal(together, alone)


def test_expert_parallel_slices_sum_to_the_whole():
    w13, w2, g = _experts()
    x = torch.randn(20, 128, generator=g).bfloat16()
    weights, ids = select_experts(torch.randn(20, 8, generator=g), 2, True)
    ids[:2] = torch.tensor([[0, 2], [1, 0]])  # two tokens wholly on the low rank
    whole = grouped_fused_experts(x, GroupedExperts(w13, w2), weights, ids)
    low = grouped_fused_experts(x, GroupedExperts(w13[:3], w2[:3]), weights, ids, 0, 8)
    high = grouped_fused_experts(x, GroupedExperts(w13[3:], w2[3:]), weights, ids, 3, 8)
    # Each token's two contributions add in bf16 either way: one on each rank, or both here.
    torch.testing.assert_close(low.float() + high.float(), whole.float(), atol=2e-2, rtol=2e-2)
    only_low = (ids < 3).all(dim=1)
    assert only_low.sum() >= 2 and (high[only_low] == 0).all() and torch.equal(low[only_low], whole[only_low])


def test_shapes_that_do_not_tile_are_refused():
    w13, w2, _ = _experts(inter=48)  # 48 is not a multiple of 32
    assert not grouped_applies(w13, w2)
    w13, w2, _ = _experts(hidden=96)  # nor 96 of 64
    assert not grouped_applies(w13, w2)
    w13, w2, _ = _experts()
    assert grouped_applies(w13, w2) and not grouped_applies(w13.float(), w2.float())


def test_runner_uses_the_grouped_kernel_for_bf16_and_onednn_for_float32(tmp_path):
    save_tiny_model("mixtral", tmp_path)  # hidden 64, 4 experts of 32
    x = torch.randn(7, 64)
    for dtype, kind in ((torch.bfloat16, GroupedExperts), (torch.float32, PackedExperts)):
        model = load_model(str(tmp_path), dtype=str(dtype).removeprefix("torch.")).model
        layer = model.model.layers[0].mlp
        with torch.no_grad():
            want = layer(x.to(dtype))
            assert pack_experts(model, torch.device("cpu")) == 2
            assert isinstance(layer.packed_experts, kind) and layer.w13_weight.numel() == 0
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(layer(x.to(dtype)), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bf16_engine_greedy_equals_transformers_on_the_grouped_kernel(tmp_path, monkeypatch, arch):
    """End to end in bf16: prefill through the modules and decode through the fused step, both on the
    grouped kernel, give transformers' greedy tokens (bf16 too), as the oneDNN-packed experts do."""
    from pagoda import SamplingParams
    from pagoda.exec import cpu_grouped_moe
    from tests.conftest import hf_greedy, make_engine

    hf = save_tiny_model(arch, tmp_path).to(torch.bfloat16)
    prompts = [[5, 17, 300, 42, 7], [100, 200, 300], list(range(40, 110))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def greedy():
        llm = make_engine(load_model(str(tmp_path), dtype="bfloat16"), None, num_gpu_blocks_override=64)
        kinds = {type(layer.mlp.packed_experts).__name__ for layer in llm.engine.core.runner.model.model.layers
                 if hasattr(layer.mlp, "packed_experts")}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return kinds, llm.engine.core.runner.fused_decode is not None, [o.outputs[0].token_ids for o in outs]

    kinds, fused, grouped = greedy()
    assert kinds == {"GroupedExperts"} and fused
    assert grouped == [hf_greedy(hf, p, 12) for p in prompts]
    monkeypatch.setattr(cpu_grouped_moe, "grouped_kernel", lambda: None)
    kinds, fused, packed = greedy()
    assert kinds == {"PackedExperts"} and not fused and packed == grouped


def test_the_off_switch_in_a_fresh_process():
    import os
    import subprocess
    import sys

    code = "from pagoda.exec.cpu_grouped_moe import grouped_kernel; print(grouped_kernel() is None)"
    for value, off in (("1", "True"), ("0", "False")):
        env = {**os.environ, "PAGODA_NO_GROUPED_MOE": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.stdout.strip().splitlines()[-1] == off, out.stderr
