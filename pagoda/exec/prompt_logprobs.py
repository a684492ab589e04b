"""Prompt logprobs: for a request that asks for them, the logprob of each prompt token under the model
(row p of a prefill scores prompt token p + 1), its rank, and the top-N alternatives at that position.

Only these requests' prompt rows go through the LM head, in slices, so a long prompt chunk never
materialises a [tokens, vocab] logits tensor at once; every other request keeps the runner's path
that computes logits for sampling rows only. Logprobs are log_softmax of the raw logits, as for
sampled tokens (vLLM's semantics).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows per LM-head slice: [256, 49k] fp32 logits are ~50 MB, beside a prefill's own activations.
_ROWS_PER_SLICE = 256

# One prompt position: ([target token, top-1, ..., top-N], their logprobs, the target's rank).
PromptLogprobRow = tuple[list[int], list[float], int]


def prompt_logprob_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    num_top: int,
) -> list[PromptLogprobRow]:
    """hidden: [R, H] final hidden states of R prompt positions; targets: the R prompt tokens they score."""
    rows: list[PromptLogprobRow] = []
    for lo in range(0, len(targets), _ROWS_PER_SLICE):
        hi = min(lo + _ROWS_PER_SLICE, len(targets))
        logprobs = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=-1)
        target = torch.tensor(targets[lo:hi], device=logprobs.device).unsqueeze(1)
        target_lp = logprobs.gather(1, target)
        # Rank 1 = the most likely token; ties with the target do not push it down.
        ranks = (logprobs > target_lp).sum(dim=1) + 1
        ids, lps = target, target_lp
        if num_top > 0:
            top_lps, top_ids = logprobs.topk(num_top, dim=-1)
            ids, lps = torch.cat([target, top_ids], dim=1), torch.cat([target_lp, top_lps], dim=1)
        rows.extend(zip(ids.tolist(), lps.tolist(), ranks.tolist()))
    return rows
