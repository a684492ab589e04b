"""Verification of draft tokens: which drafts a request keeps, and the one token it samples after them.

Owns the rule that makes speculative decoding lossless. For each request with k drafts d_1..d_k, the
target model scored k + 1 positions in one forward; p_j is the distribution the sampler would draw
position j from (after penalties, temperature, top-k, top-p, min-p), q_j the draft's (one-hot at d_j
for a proposer without probabilities, such as n-gram lookup). Draft d_j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the normalised
max(p_j - q_j, 0), and when every draft is accepted a bonus token is drawn from p_{k+1}. Each
emitted token is then distributed exactly as p (Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding"). A greedy row's p is one-hot at its argmax, which makes the
rule "keep the longest prefix equal to the argmax, then the argmax" (`greedy_verify` does that
without building distributions).

Everything is batched over requests, padded to the longest draft; the randomness is given as
uniforms, so a seeded request draws them from its own generator.
"""

from __future__ import annotations

import torch

from pagoda.exec.sampler import sample_from_probs


def _accepted_count(accept: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[R] the length of each row's leading run of accepted drafts (only its first num_drafts count)."""
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    return (accept & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)


def _emit(draft_ids: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[R, K + 1]: the drafts with the final token written at position num_accepted (later positions
    are padding that the caller cuts at num_accepted + 1)."""
    out = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1)
    return out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))


def greedy_verify(
    draft_ids: torch.Tensor, num_drafts: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows. draft_ids [R, K], num_drafts [R], target_argmax [R, K + 1] (position j: the
    argmax after the known tokens and the drafts before d_{j+1}). Returns (tokens [R, K + 1],
    num_accepted [R]); a row's output is tokens[: num_accepted + 1]."""
    num_accepted = _accepted_count(target_argmax[:, :-1] == draft_ids, num_drafts)
    final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _emit(draft_ids, num_accepted, final), num_accepted


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> torch.Tensor:
    """The distribution to draw from after rejecting `draft` ([R]): max(p - q, 0) (unnormalised),
    with q one-hot at the draft when None. The sampler draws in proportion to the weights."""
    if q is None:
        return p.scatter(1, draft.unsqueeze(1), 0.0)
    return (p - q).clamp_(min=0.0)


def rejection_sample(
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled (or mixed) rows. draft_ids [R, K] int64 (padding past num_drafts: any valid id);
    num_drafts [R]; target_probs [R, K + 1, V] normalised; draft_probs [R, K, V] or None (one-hot
    drafts); uniforms [R, K + 1] in [0, 1): columns 0..K-1 decide the acceptances, column K draws
    the final token. Returns (tokens [R, K + 1], num_accepted [R])."""
    r, k = draft_ids.shape
    p_draft = target_probs[:, :k].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        accept = uniforms[:, :k] < p_draft  # q(d) = 1
    else:
        q_draft = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2)
        accept = uniforms[:, :k] * q_draft < p_draft  # u < p / q without dividing by a zero q
    num_accepted = _accepted_count(accept, num_drafts)
    rows = torch.arange(r, device=draft_ids.device)
    p_final = target_probs[rows, num_accepted]  # [R, V]
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=k - 1)
    q_final = None if draft_probs is None else draft_probs[rows, at]
    residual = residual_distribution(p_final, q_final, draft_ids[rows, at])
    # p == q to rounding leaves no residual weight; then the rejection had probability ~0 and p is
    # as good a fallback as any.
    use_residual = rejected & (residual.sum(dim=1) > 0)
    dist = torch.where(use_residual.unsqueeze(1), residual, p_final)
    final = sample_from_probs(dist, uniforms[:, k].contiguous())
    return _emit(draft_ids, num_accepted, final), num_accepted
