"""Verification of draft tokens: the rejection sampler keeps the target distribution exactly (a
chi-square test over 40,000 draws on a tiny vocabulary, temperature 1 with top-p), and the same test
fails for deliberately wrong rules; greedy verification keeps the longest prefix equal to the argmax."""

from __future__ import annotations

import pytest
import torch

from pagoda.exec import rejection_sampler
from pagoda.exec.rejection_sampler import greedy_verify, rejection_sample
from pagoda.exec.sampler import Sampler, SamplingMetadata
from pagoda.sampling_params import SamplingParams

V = 8
N = 40_000
K = 2
# Chi-square critical values at p = 1e-4 by degrees of freedom: an honest sampler fails one about
# once in 10,000 seeds; the seed is fixed, so the test is deterministic.
CHI2_CRIT = {3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p after the sampler's own processing (temperature, top-p), for logits [P, V]."""
    meta = SamplingMetadata.build([params] * len(logits), [[0]] * len(logits), [[]] * len(logits),
                                  [None] * len(logits), V, torch.device("cpu"))
    _, probs, _ = Sampler().distributions(logits, meta)
    return probs


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(the statistic, its critical value) of the emitted tokens against p."""
    counts = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * len(tokens)
    assert counts[expected == 0].sum() == 0, "a token outside the top-p nucleus was emitted"
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, CHI2_CRIT[int(keep.sum()) - 1]


def _passes(tokens: torch.Tensor, p: torch.Tensor) -> bool:
    stat, crit = _chi2(tokens, p)
    return stat < crit


def _draw(gen: torch.Generator, draft_model: bool):
    """N rows of K drafts each, drafted from q (a draft model) or proposed without probabilities."""
    logits = torch.randn(K + 1, V, generator=gen)
    p = _target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))  # [K + 1, V]
    q = torch.softmax(torch.randn(K, V, generator=gen), dim=-1)  # a different distribution per position
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).T.contiguous()  # [N, K]
    uniforms = torch.rand(N, K + 1, generator=gen)
    target = p.unsqueeze(0).expand(N, K + 1, V)
    draft_probs = q.unsqueeze(0).expand(N, K, V) if draft_model else None
    tokens, accepted = rejection_sample(drafts, torch.full((N,), K), target, draft_probs, uniforms)
    return p, tokens, accepted


@pytest.mark.parametrize("draft_model", [True, False], ids=["draft-probs", "one-hot-drafts"])
def test_rejection_sampling_keeps_the_target_distribution(draft_model):
    gen = torch.Generator().manual_seed(1234)
    p, tokens, accepted = _draw(gen, draft_model)
    kept = (p > 0).sum(dim=1)
    assert (kept < V).all() and (kept >= 4).all()  # top-p cut some tokens at each position
    # The first emitted token is distributed as p_0; the second (where the first draft stood) as p_1.
    assert _passes(tokens[:, 0], p[0])
    second = accepted >= 1
    assert second.sum() > N / 20
    assert _passes(tokens[second, 1], p[1])
    # Some drafts were rejected and some accepted: both branches of the rule were exercised.
    assert 0 < (accepted == 0).sum() < N and (accepted == K).sum() > 0


def _wrong_resample_from_p(p, q, draft):
    return p  # on rejection, draw from p instead of max(p - q, 0)


@pytest.mark.parametrize("draft_model", [True, False], ids=["draft-probs", "one-hot-drafts"])
def test_the_same_test_fails_for_a_wrong_rule(monkeypatch, draft_model):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _wrong_resample_from_p)
    gen = torch.Generator().manual_seed(1234)
    p, tokens, _ = _draw(gen, draft_model)
    stat, crit = _chi2(tokens[:, 0], p[0])
    assert stat > 2 * crit  # fails the test, and not by a hair


def test_accepting_every_draft_fails_the_test():
    gen = torch.Generator().manual_seed(1234)
    p, tokens, _ = _draw(gen, True)
    # Accept-always: the emitted tokens are the drafts, distributed as q.
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(K + 1, V, generator=gen)
    q = torch.softmax(torch.randn(K, V, generator=gen), dim=-1)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).T
    with pytest.raises(AssertionError):
        # Either a token outside the nucleus appears or the chi-square is far off.
        assert _passes(drafts[:, 0].contiguous(), p[0])


def test_greedy_verify_keeps_the_longest_matching_prefix_and_the_argmax_after_it():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 0, 0]])
    num = torch.tensor([3, 3, 3, 1])
    argmax = torch.tensor([[5, 6, 7, 9], [5, 2, 7, 9], [4, 6, 7, 9], [1, 3, 8, 8]])
    tokens, accepted = greedy_verify(drafts, num, argmax)
    assert accepted.tolist() == [3, 1, 0, 1]
    out = [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())]
    assert out == [[5, 6, 7, 9], [5, 2], [4], [1, 3]]


def test_one_hot_targets_make_rejection_sampling_greedy():
    """A greedy row inside a sampled batch is a one-hot target: verification equals greedy_verify."""
    gen = torch.Generator().manual_seed(0)
    argmax = torch.randint(0, V, (64, K + 1), generator=gen)
    drafts = torch.where(torch.rand(64, K, generator=gen) < 0.6, argmax[:, :K], torch.randint(0, V, (64, K), generator=gen))
    one_hot = torch.nn.functional.one_hot(argmax, V).float()
    num = torch.full((64,), K)
    want = greedy_verify(drafts, num, argmax)
    for q in (None, torch.softmax(torch.randn(64, K, V, generator=gen), -1)):
        got = rejection_sample(drafts, num, one_hot, q, torch.rand(64, K + 1, generator=gen))
        assert torch.equal(got[1], want[1])
        assert [t[: a + 1] for t, a in zip(got[0].tolist(), got[1].tolist())] == [
            t[: a + 1] for t, a in zip(want[0].tolist(), want[1].tolist())
        ]
