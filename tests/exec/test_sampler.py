"""Tests for the batched sampler (pagoda/exec/sampler.py) and SamplingParams validation.

Each sampling parameter has a test that would fail if the sampler ignored that parameter. Random
draws are made as many rows in one batch (one call), so the statistical tests are fast and, with a
fixed default seed, deterministic.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.exec.cpu_kernels import load_greedy
from pagoda.exec.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    greedy_ids,
    make_generator,
    sample_from_probs,
)
from pagoda.sampling_params import SamplingParams

CPU = torch.device("cpu")
sampler = Sampler()


@pytest.fixture(autouse=True)
def _seed_default_generator() -> None:
    torch.manual_seed(0)


def build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab,
        CPU,
    )


def draw(logits_row: torch.Tensor, params: SamplingParams, num: int) -> torch.Tensor:
    """`num` independent samples of one distribution: the row repeated `num` times in one batch."""
    logits = logits_row.unsqueeze(0).repeat(num, 1)
    return sampler(logits, build([params] * num, logits.shape[1])).token_ids


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# --- greedy and temperature -------------------------------------------------------------------


def test_temperature_zero_is_argmax_fast_path() -> None:
    logits = torch.randn(32, 100)
    meta = build([SamplingParams(temperature=0.0)] * 32, 100)
    assert meta.all_greedy and meta.no_penalties and not meta.needs_logprobs
    out = sampler(logits, meta)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None


def test_greedy_takes_the_first_of_tied_maxima_in_bf16_and_fp32() -> None:
    # bf16 ties often (8 significant bits); greedy must pick the first maximal id, as argmax does.
    logits = torch.randn(64, 3000).to(torch.bfloat16)
    logits[:, 2900] = logits[:, 7] = 9.0  # every row: a tie between ids 7 and 2900
    logits[0, 5] = 9.0  # row 0: three-way, the first at 5
    meta = build([SamplingParams(temperature=0.0)] * 64, 3000)
    for dtype in (torch.bfloat16, torch.float32):
        ids = sampler(logits.to(dtype), meta).token_ids
        assert ids[0] == 5 and bool((ids[1:] == 7).all())
        assert torch.equal(ids, logits.to(dtype).argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 33, 100, 1000])
def test_cpu_argmax_kernel_gives_torchs_ids(dtype: torch.dtype, n: int) -> None:
    # The C++ argmax (csrc/greedy.cpp) must choose what max(dim).indices chooses: the first maximum,
    # a row's first NaN, +-inf as values; rows shorter than, equal to and past its 16 lanes, and rows
    # that are a view with a stride.
    kernel = load_greedy()
    if kernel is None:
        pytest.skip("the C++ kernels did not build here")
    g = torch.Generator().manual_seed(n)
    for trial in range(20):
        x = torch.randint(-3, 4, (9, n + 3), generator=g).to(dtype)[:, 3:]  # many ties; a strided view
        hit = torch.rand(x.shape, generator=g)
        if trial % 4 == 1:
            x[hit < 0.05] = float("nan")
        elif trial % 4 == 2:
            x[:] = float("-inf")
            x[hit < 0.02] = float("inf")
        elif trial % 4 == 3:
            x[hit < 0.1] = float("inf")
        expected = x.max(dim=-1).indices
        assert torch.equal(kernel.argmax_rows(x), expected)
        assert torch.equal(greedy_ids(x), expected)


def test_bf16_logits_are_accepted() -> None:
    logits = torch.randn(8, 64).to(torch.bfloat16)
    out = sampler(logits, build([SamplingParams(temperature=0.0, logprobs=2)] * 8, 64))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs.dtype == torch.float32


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    # Flat logits: a random row almost never hits the argmax, so ignoring temperature=0 would show.
    logits = torch.randn(64, 1000) * 0.01
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(64)]
    out = sampler(logits, build(params, 1000)).token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(out[0::2], argmax[0::2])
    assert (out[1::2] != argmax[1::2]).sum() > 25


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(64, 500) * 0.01  # nearly flat: plain sampling would rarely pick argmax
    out = sampler(logits, build([SamplingParams(temperature=1.0, top_k=1)] * 64, 500)).token_ids
    assert torch.equal(out, logits.argmax(-1))
    # The filter itself (not only the params' greedy shortcut) leaves just the argmax.
    masked = apply_top_k_top_p(logits.clone(), torch.ones(64, dtype=torch.int64), None, 1)
    assert torch.equal(torch.isfinite(masked).sum(-1), torch.ones(64, dtype=torch.int64))
    assert torch.equal(masked.argmax(-1), logits.argmax(-1))


def test_sampling_matches_softmax_distribution() -> None:
    logits = probs_to_logits([0.5, 0.25, 0.15, 0.1])
    samples = draw(logits, SamplingParams(temperature=1.0), 8000)
    freq = torch.bincount(samples, minlength=4).float() / 8000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=0.025)


def test_draw_across_blocks_and_a_ragged_tail() -> None:
    # V = 700: two full blocks of 256 and a tail of 188; weight in every part, zeros elsewhere.
    w = torch.zeros(700)
    w[[3, 300, 511, 512, 699]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    samples = sample_from_probs(w.repeat(8000, 1), torch.rand(8000))
    freq = torch.bincount(samples, minlength=700).float() / 8000
    assert set(samples.tolist()) == {3, 300, 511, 512, 699}
    assert torch.allclose(freq[[3, 300, 511, 512, 699]], w[[3, 300, 511, 512, 699]], atol=0.02)
    # The ends of [0, 1) land on the first and last tokens of non-zero weight, never a zero.
    edge = sample_from_probs(w.repeat(2, 1), torch.tensor([0.0, 1.0 - 2**-24]))
    assert edge.tolist() == [3, 699]


def test_temperature_scales_the_distribution() -> None:
    logits = torch.zeros(16)
    logits[3] = 5.0  # p(top) = 0.91 at temperature 1
    hot = draw(logits, SamplingParams(temperature=100.0), 4000)
    cold = draw(logits, SamplingParams(temperature=0.3), 4000)
    normal = draw(logits, SamplingParams(temperature=1.0), 4000)
    assert (hot == 3).float().mean() < 0.15  # ~1/16 when nearly uniform
    assert len(torch.unique(hot)) == 16
    assert 0.87 < (normal == 3).float().mean() < 0.95
    assert (cold == 3).all()  # p(other) = 15 * e^(-5/0.3) ~ 1e-6 per draw


# --- top-k, top-p, min-p ----------------------------------------------------------------------


def test_top_k_never_samples_outside_the_top_k() -> None:
    vocab, k = 200, 5
    logits = torch.randn(vocab) * 0.1  # flat: without top-k almost every sample is outside the top 5
    top = set(logits.topk(k).indices.tolist())
    samples = draw(logits, SamplingParams(temperature=1.0, top_k=k), 3000)
    assert set(samples.tolist()) == top  # only the top k, and every one of them drawn

    # A row with top-k off in the same batch is not filtered by its neighbours' k.
    batch = logits.unsqueeze(0).repeat(400, 1)
    params = [SamplingParams(temperature=1.0, top_k=k if i % 2 else 0) for i in range(400)]
    out = sampler(batch, build(params, vocab)).token_ids
    assert set(out[1::2].tolist()) <= top
    assert len(set(out[0::2].tolist()) - top) > 50


def test_top_p_small_keeps_only_the_top_token() -> None:
    logits = torch.randn(64, 300) * 0.05
    out = sampler(logits, build([SamplingParams(temperature=1.0, top_p=1e-3)] * 64, 300)).token_ids
    assert torch.equal(out, logits.argmax(-1))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = probs_to_logits([0.1, 0.4, 0.2, 0.3])
    # 0.4 alone < 0.5; 0.4 + 0.3 >= 0.5: the nucleus is {1, 3}.
    samples = draw(logits, SamplingParams(temperature=1.0, top_p=0.5), 3000)
    assert set(samples.tolist()) == {1, 3}
    freq = (samples == 1).float().mean()
    assert abs(freq - 0.4 / 0.7) < 0.04  # renormalised within the nucleus


def test_top_k_applies_before_top_p() -> None:
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1]).unsqueeze(0)
    p = torch.tensor([0.75])
    # top-p alone: 0.4 + 0.3 = 0.7 < 0.75, so three tokens stay.
    alone = apply_top_k_top_p(logits.clone(), None, p)
    assert torch.isfinite(alone[0]).tolist() == [True, True, True, False]
    # after top-k 3 the distribution is renormalised: 0.444 + 0.333 >= 0.75, so two stay.
    both = apply_top_k_top_p(logits.clone(), torch.tensor([3]), p, 3)
    assert torch.isfinite(both[0]).tolist() == [True, True, False, False]
    # kept values are unchanged
    assert torch.equal(both[0, :2], logits[0, :2])


def _reference_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's sort-based filter, one full ascending sort, as an independent reference."""
    logits = logits.clone()
    vocab = logits.shape[1]
    srt, idx = logits.sort(dim=-1)
    kth = srt.gather(1, (vocab - k).unsqueeze(1))
    srt.masked_fill_(srt < kth, float("-inf"))
    cum = srt.softmax(-1).cumsum(-1)
    drop = cum <= 1 - p.unsqueeze(1)
    drop[:, -1] = False
    srt.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, idx, srt)


def test_top_k_top_p_match_a_sort_based_reference() -> None:
    # Rows of different sharpness: sharp ones resolve among the top 256 candidates, flatter ones
    # among the top 4096, the flattest (nucleus over 4096 tokens) take the full sort. Some rows have
    # p = 1 or top-k off.
    vocab = 6000
    scale = torch.tensor([0.1, 0.3, 1.0, 3.0, 10.0, 0.05, 2.0, 5.0, 0.01]).unsqueeze(1)
    logits = torch.randn(9, vocab) * scale
    k = torch.tensor([vocab, 50, vocab, 10, vocab, 2000, vocab, 1000, vocab])
    p = torch.tensor([0.5, 0.9, 1.0, 0.8, 0.95, 0.7, 1.0, 0.3, 0.9])
    rows = (p < 1).nonzero().squeeze(1)
    got = apply_top_k_top_p(logits.clone(), k, p[rows], int(k[k < vocab].max()), rows)
    want = _reference_top_k_top_p(logits, k, p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])
    kept = torch.isfinite(got).sum(-1)
    assert 256 < kept[0] < 4096 and 256 < kept[5] < 4096 and kept[8] > 4096  # every tier ran
    assert kept[2] == vocab and kept[6] == vocab


def test_min_p_filters_relative_to_the_top_probability() -> None:
    logits = probs_to_logits([0.05, 0.5, 0.15, 0.3])
    # threshold 0.35 * 0.5 = 0.175: keeps {1, 3}
    samples = draw(logits, SamplingParams(temperature=1.0, min_p=0.35), 3000)
    assert set(samples.tolist()) == {1, 3}
    assert abs((samples == 1).float().mean() - 0.5 / 0.8) < 0.04
    unfiltered = draw(logits, SamplingParams(temperature=1.0), 3000)
    assert set(unfiltered.tolist()) == {0, 1, 2, 3}


# --- seeds ------------------------------------------------------------------------------------


def _run_seeded(
    seed: int, position: int, mates: list[SamplingParams], steps: int, step_logits: list[torch.Tensor]
) -> list[int]:
    """Sample `steps` tokens for a seeded row at `position` among `mates`; returns its tokens."""
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
    params = mates[:position] + [target] + mates[position:]
    gens: list[torch.Generator | None] = [
        make_generator(p.seed) if p.seed is not None else None for p in params
    ]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(params), step_logits[0].shape[0])  # fresh mates' logits each step
        logits[position] = step_logits[step]
        out = sampler(logits, build(params, logits.shape[1], generators=gens))
        tokens.append(int(out.token_ids[position]))
    return tokens


def test_same_seed_same_tokens_in_different_batches() -> None:
    vocab, steps = 1000, 12
    step_logits = [torch.randn(vocab) * 0.5 for _ in range(steps)]
    alone = _run_seeded(1234, 0, [], steps, step_logits)
    mates_a = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)]
    mates_b = [
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.9, min_p=0.1, logprobs=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, seed=7, top_k=5),
    ]
    in_a = _run_seeded(1234, 1, mates_a, steps, step_logits)
    in_b = _run_seeded(1234, 5, mates_b, steps, step_logits)
    assert alone == in_a == in_b
    assert len(set(alone)) > steps // 2  # really random draws, not a constant


def test_different_seeds_differ() -> None:
    vocab, steps = 1000, 12
    step_logits = [torch.randn(vocab) * 0.5 for _ in range(steps)]
    a = _run_seeded(1, 0, [], steps, step_logits)
    b = _run_seeded(2, 0, [], steps, step_logits)
    assert a != b
    assert sum(x != y for x, y in zip(a, b)) > steps // 2


def test_a_seeded_row_draws_only_from_its_own_generator() -> None:
    # One step takes exactly one uniform from the row's generator, whatever the batch holds, and
    # the default generator's draws do not depend on which rows are seeded.
    vocab = 50
    g, ref = make_generator(5), make_generator(5)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=5)]
    sampler(torch.randn(2, vocab), build(params, vocab, generators=[None, g]))
    torch.rand(1, generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())


# --- penalties --------------------------------------------------------------------------------

BASE = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]


def _penalised(**kwargs: float) -> list[float]:
    logits = torch.tensor([BASE])
    meta = build([SamplingParams(**kwargs)], 6, [PROMPT], [OUTPUT])
    before = logits.clone()
    out = apply_penalties(logits, meta)
    assert torch.equal(logits, before)  # input untouched
    return out[0].tolist()


def test_repetition_penalty_over_prompt_and_output() -> None:
    # seen = {0, 1} (prompt) + {2, 3} (output): positive / 2, negative * 2; 4 and 5 unseen.
    assert _penalised(repetition_penalty=2.0) == [1.0, -2.0, 0.25, -1.0, 3.0, 0.0]


def test_presence_penalty_counts_output_tokens_once() -> None:
    # only output tokens {2, 3}, once each, whatever their count; prompt tokens untouched
    assert _penalised(presence_penalty=0.5) == [2.0, -1.0, 0.0, -1.0, 3.0, 0.0]


def test_frequency_penalty_scales_with_output_count() -> None:
    # token 2 twice, token 3 once
    assert _penalised(frequency_penalty=0.25) == [2.0, -1.0, 0.0, -0.75, 3.0, 0.0]


def test_all_penalties_together() -> None:
    got = _penalised(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    assert got == [1.0, -2.0, -0.75, -1.75, 3.0, 0.0]


def test_repetition_penalty_applies_once_per_token() -> None:
    # token 2 appears twice in the prompt and once in the output: still divided by p only once
    logits = torch.tensor([BASE])
    meta = build([SamplingParams(repetition_penalty=2.0)], 6, [[2, 2]], [[2]])
    assert apply_penalties(logits, meta)[0].tolist() == [2.0, -1.0, 0.25, -0.5, 3.0, 0.0]


def test_penalties_apply_to_their_rows_only() -> None:
    logits = torch.tensor([BASE, BASE, BASE])
    params = [
        SamplingParams(),
        SamplingParams(frequency_penalty=0.25),
        SamplingParams(temperature=0.0),
    ]
    meta = build(params, 6, [PROMPT] * 3, [OUTPUT] * 3)
    out = apply_penalties(logits, meta)
    assert out[0].tolist() == BASE and out[2].tolist() == BASE
    assert out[1].tolist() == [2.0, -1.0, 0.0, -0.75, 3.0, 0.0]


def test_penalties_change_the_greedy_token() -> None:
    logits = torch.tensor([BASE])
    prompts, outputs = [[4]], [[4, 4]]
    plain = sampler(logits, build([SamplingParams(temperature=0.0)], 6, prompts, outputs))
    assert plain.token_ids.tolist() == [4]
    rep = build([SamplingParams(temperature=0.0, repetition_penalty=2.0)], 6, prompts, outputs)
    assert sampler(logits, rep).token_ids.tolist() == [0]  # 3.0 / 2 = 1.5 < 2.0
    freq = build([SamplingParams(temperature=0.0, frequency_penalty=0.6)], 6, prompts, outputs)
    assert sampler(logits, freq).token_ids.tolist() == [0]  # 3.0 - 2 * 0.6 = 1.8 < 2.0


def test_metadata_skips_histories_without_penalties() -> None:
    class Untouchable(list):
        def __iter__(self):  # reading a history would be O(B * context) Python work
            raise AssertionError("history read although no row has penalties")

        def __len__(self) -> int:
            raise AssertionError("history read although no row has penalties")

    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(256)]
    hist = [Untouchable() for _ in range(256)]
    meta = SamplingMetadata.build(params, hist, hist, [None] * 256, 1000, CPU)
    assert meta.no_penalties and meta.rep_rows is None and meta.sub_rows is None


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(4, 50) * 3
    reference = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=None),
        SamplingParams(temperature=1.0, top_k=5, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=5, presence_penalty=1.0),
    ]
    meta = build(params, 50, [[1, 2]] * 4, [[3, 4, 4]] * 4)
    assert meta.needs_logprobs and meta.max_num_logprobs == 5
    out = sampler(logits, meta)
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    # sampled token first, with the logprob of the raw (unpenalised, unscaled) logits
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    assert torch.allclose(out.logprobs[:, 0], reference.gather(1, out.token_ids.unsqueeze(1))[:, 0])
    # then the top-5 alternatives, descending
    top_vals, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 1:], top_vals)


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = torch.randn(3, 20)
    out = sampler(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 3, 20))
    assert out.logprobs.shape == (3, 1)
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))
    assert torch.allclose(out.logprobs, expected)


def test_no_logprobs_when_none_asked() -> None:
    out = sampler(torch.randn(3, 20), build([SamplingParams(temperature=1.0)] * 3, 20))
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.int64


# --- logit_bias and min_tokens ------------------------------------------------------------------


def test_logit_bias_forces_bans_and_shifts_tokens_of_its_own_row() -> None:
    logits = torch.randn(4, 50)
    top = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),  # forced
        SamplingParams(temperature=0, logit_bias={int(top[1]): -100.0}),  # the argmax banned
        SamplingParams(temperature=0),  # untouched
        SamplingParams(temperature=1.0, logit_bias={3: 100.0}, logprobs=1),  # random rows too
    ]
    out = sampler(logits, build(params, 50))
    assert out.token_ids[0] == 7 and out.token_ids[2] == top[2] and out.token_ids[3] == 3
    second = logits[1].topk(2).indices[1]
    assert out.token_ids[1] == second
    # Logprobs stay those of the raw logits (vLLM's default).
    assert out.logprobs[3, 0] == pytest.approx(torch.log_softmax(logits[3], -1)[3].item())


def test_logit_bias_past_float32_forces_its_token_at_any_temperature() -> None:
    # 1e300 is a finite float, but not a float32: unclamped, the biased logit became +inf and the
    # row's softmax NaN, so random rows sampled garbage (the last vocabulary id) instead.
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=1.0, seed=1, logit_bias={7: 1e300}),
        SamplingParams(temperature=0.01, seed=2, logit_bias={9: 1e38, 3: -1e300}, top_p=0.9),
        SamplingParams(temperature=0, logit_bias={11: 1e300}),
    ]
    gens = [make_generator(1), make_generator(2), None]
    meta = SamplingMetadata.build(params, [[]] * 3, [[]] * 3, gens, 50, CPU)
    assert sampler(logits, meta).token_ids.tolist() == [7, 9, 11]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(3, 20)
    logits[:, 5] = 10.0  # EOS is the argmax
    logits[:, 6] = 9.0  # then a stop token id
    eos = [5, 5, 5]
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6])
    outputs = [[1], [1, 2], [1, 2, 3]]  # the third row has its min_tokens outputs
    meta = SamplingMetadata.build([params] * 3, [[]] * 3, outputs, [None] * 3, 20, CPU, eos)
    assert sampler(logits, meta).token_ids.tolist() == [0, 0, 5]
    # ignore_eos: EOS is a token like any other, so only the stop token id is held back.
    ignoring = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6], ignore_eos=True)
    meta = SamplingMetadata.build([ignoring], [[]], [[1]], [None], 20, CPU, [5])
    assert sampler(logits[:1], meta).token_ids.tolist() == [5]
    # A structured output's grammar decides when it ends (complete, it allows EOS alone).
    from pagoda.sampling_params import StructuredOutputsParams

    grammar = params.clone(structured_outputs=StructuredOutputsParams(choice=["a"]))
    assert SamplingMetadata.build([grammar], [[]], [[1]], [None], 20, CPU, [5]).bias_rows is None
    # Stop ids past the vocabulary are never sampled anyway: no mask entry for them.
    far = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[10**6])
    meta = SamplingMetadata.build([far], [[]], [[]], [None], 20, CPU, [None])
    assert meta.bias_rows is None and sampler(logits[:1], meta).token_ids.tolist() == [5]


# --- SamplingParams validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"n": 0},
        {"max_tokens": 0},
        {"top_k": -2},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"logprobs": -1},
        {"min_tokens": 5, "max_tokens": 2},
        # NaN passes every range comparison; strings and booleans are not numbers
        {"temperature": float("nan")},
        {"repetition_penalty": float("nan")},
        {"top_p": float("inf")},
        {"temperature": "0"},
        {"n": True},
        {"max_tokens": True},
        {"seed": 1.5},
        {"stop": 5},
        {"stop": ["ok", 5]},
        {"stop_token_ids": 7},
        {"logit_bias": {"7": 1.0}},
        {"logit_bias": {7: float("nan")}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": [7]},
    ],
)
def test_sampling_params_reject_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_params_accept_edge_values() -> None:
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, n=1, max_tokens=1)
    assert p.top_k == 0 and p.greedy


# --- hygiene ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5),  # temperature 1: no division makes a copy
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=2),
    ],
)
def test_sampler_never_modifies_the_callers_logits(params: SamplingParams) -> None:
    logits = torch.randn(4, 300)
    before = logits.clone()
    sampler(logits, build([params] * 4, 300, [[1, 2, 3]] * 4, [[4, 4, 5]] * 4))
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    for params in ([], [SamplingParams(temperature=1.0, top_p=0.5, logprobs=2)]):
        meta = build(params * 0, 100)
        out = sampler(torch.randn(0, 100), meta)
        assert out.token_ids.shape == (0,)
