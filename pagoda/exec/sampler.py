"""The batched sampler: one step's logits [B, V] in, one token per row (and logprobs where asked) out.

Owns, for the execution layer: penalties (repetition, presence, frequency), greedy argmax,
temperature, top-k / top-p / min-p filtering, random sampling with per-request seeds, and logprobs of
the sampled token plus the top-N alternatives. Everything runs as batched tensor ops on the logits'
device; the only per-row Python loop draws one uniform number for each seeded row from its own
generator.

Semantics follow vLLM:
- logprobs are log_softmax of the RAW logits (before penalties and temperature);
- logit_bias, the min_tokens mask (a row short of min_tokens cannot sample EOS or a stop token id)
  and the penalties come first and apply to greedy rows too; then greedy rows take the argmax;
- random rows: temperature, then top-k, top-p, min-p, then one categorical draw per row.

The draw is inverse-CDF sampling with ONE uniform number per row, done in two levels (sums of
blocks of 256 probabilities, then the cumulative sum inside the chosen block). That is exact, costs
little more than the softmax, and, unlike a Gumbel / exponential race, needs one random number per
row instead of V of them (drawing [B, V] noise costs ~10x the softmax on CPU). Because a seeded row's
only randomness is its own uniform, and every other stage is row-wise, a seed gives the same tokens
whatever else is in the batch and wherever the row sits in it.

The per-step tensors live in `SamplingMetadata` (pagoda/exec/sampling_metadata.py), re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.exec.cpu_kernels import load_greedy
from pagoda.exec.sampling_metadata import SamplingMetadata

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties",
    "apply_top_k_top_p",
    "apply_min_p",
    "gather_logprobs",
    "make_generator",
    "sample_from_probs",
]

# Block width of the two-level inverse CDF: the block sums are a cheap vectorised reduction and
# the sequential cumsum then runs over V / 256 sums plus 256 values per row, not over V.
_BLOCK = 256
# Top-p first looks for each row's nucleus among its top 256 candidates (a partial top-k is ~20x
# cheaper than a full sort of V on CPU), then the rows not yet resolved among their top 4096; only
# rows whose nucleus is wider still (very flat distributions) pay for a full sort.
_TOP_P_CANDIDATES = (256, 4096)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64 sampled token per row
    # [B, 1 + max_num_logprobs] float32: sampled token's logprob, then the top-N (descending).
    # None when no row asked for logprobs. Rows that asked for fewer than max_num_logprobs
    # alternatives just use the first 1 + their N columns.
    logprobs: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + max_num_logprobs] int64, same layout


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A private generator for a seeded request. Keep one per sequence across steps; for n > 1
    give each child its own seed (vLLM uses seed + child index) or the children sample alike."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ argmax takes


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first one on ties, as argmax; a row's first NaN if it has one, as
    max(dim)). On the CPU, float32 and bf16 rows go through the C++ kernel (csrc/greedy.cpp: the same
    ids, 0.43 against torch's 2.8 ms for 64 bf16 rows of a 49k vocabulary); elsewhere
    max(dim).indices, which over bf16 takes half of argmax's time."""
    if logits.is_cpu and logits.dtype in _ARGMAX_DTYPES and logits.dim() == 2 and logits.shape[1] > 0:
        kernel = load_greedy()
        if kernel is not None:
            return kernel.argmax_rows(logits if logits.stride(1) == 1 else logits.contiguous())
    return logits.max(dim=-1).indices


class Sampler:
    """Stateless: call it with the step's logits and that step's `SamplingMetadata`."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Fast path, the common offline case: nothing but argmax. No float32 copy, no softmax.
        if meta.all_greedy and meta.no_penalties and not meta.needs_logprobs:
            return SamplerOutput(token_ids=greedy_ids(logits))

        raw_logprobs = None
        if meta.needs_logprobs:
            # Computed in float32 from the raw logits, before anything below changes them.
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        owned = not meta.no_penalties or logits.dtype != torch.float32
        if meta.no_penalties:
            logits = logits.float()  # a copy unless already float32 (then it aliases the caller's)
        else:
            # Our own float32 copy, so the penalties can be written in place.
            copy = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            logits = _apply_penalties_(copy, meta)

        token_ids = self._sample(logits, meta, owned)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        lp, ids = gather_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=lp, logprob_token_ids=ids)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, owned: bool) -> torch.Tensor:
        greedy, probs = self._filtered(logits, meta, owned)
        if probs is None:
            return greedy
        random = sample_from_probs(probs, _uniforms(meta, probs.device))
        if greedy is None:
            return random
        return torch.where(meta.greedy_mask, greedy, random)

    def distributions(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What each row samples from, for speculative verification: (the greedy rows' argmax, or
        None when no row is greedy; [B, V] normalised probabilities after penalties, temperature,
        top-k, top-p and min-p, greedy rows one-hot at their argmax, or None when every row is
        greedy; the raw logprobs when a row asks for logprobs, else None)."""
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if meta.needs_logprobs else None
        if meta.no_penalties:
            owned = logits.dtype != torch.float32
            logits = logits.float()
        else:
            owned = True
            logits = _apply_penalties_(logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True), meta)
        greedy, probs = self._filtered(logits, meta, owned)
        if probs is None:
            return greedy, None, raw_logprobs
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalised
        if greedy is not None:
            one_hot = torch.zeros_like(probs).scatter_(1, greedy.unsqueeze(1), 1.0)
            probs = torch.where(meta.greedy_mask.unsqueeze(1), one_hot, probs)
        return (None if meta.all_random else greedy), probs, raw_logprobs

    def _filtered(
        self, logits: torch.Tensor, meta: SamplingMetadata, owned: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(argmax, or None when no row is greedy; the random rows' unnormalised probabilities after
        temperature and the filters, or None when every row is greedy)."""
        greedy = None if meta.all_random else greedy_ids(logits)
        if meta.all_greedy:
            return greedy, None

        if meta.temperature is not None:
            # Never 0 here: greedy rows carry 1.0 (their token comes from `greedy`). The division
            # makes a fresh tensor, which the in-place filters below may then write into.
            logits = logits / meta.temperature.unsqueeze(1)
            owned = True
        if meta.top_k is not None or meta.top_p is not None:
            if not owned:
                logits = logits.clone()  # the filters write in place; never into the caller's logits
            apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k, meta.top_p_rows)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            apply_min_p(probs, meta.min_p)
        return greedy, probs


def _uniforms(meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """[B] float32 uniforms in [0, 1): seeded rows from their own generator, the rest in one draw."""
    gens = meta.generators
    if not gens:
        return torch.rand(meta.num_rows, device=device)
    # Unseeded rows share one batched draw from the default generator (skipped when none is left).
    if len(gens) < meta.num_rows:
        u = torch.rand(meta.num_rows, device=device)
    else:
        u = torch.empty(meta.num_rows, device=device)
    # One number per seeded row from its own generator: the row's only randomness this step.
    own = torch.cat([torch.rand(1, generator=g, device=g.device).to(device) for g in gens.values()])
    rows = torch.tensor(list(gens.keys()), dtype=torch.int64, device=device)
    return u.index_copy_(0, rows, own)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return float32 logits [B, V] with the rows' penalties applied; the input is not modified.

    repetition_penalty p: for tokens seen in prompt or output, a positive logit is divided by p and
    a non-positive one multiplied by p (so p > 1 always makes a seen token less likely).
    frequency_penalty f: subtract f * (count of the token in the output).
    presence_penalty r: subtract r once for each token that occurs in the output.
    """
    out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return out if meta.no_penalties else _apply_penalties_(out, meta)


def _apply_penalties_(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    # Sparse: only the (row, token) pairs a row has seen are read and written, each pair once
    # (the metadata deduplicated them). Flat indices into the contiguous [B, V] view, because
    # index_select/index_copy_/index_add_ are far faster on CPU than tuple advanced indexing.
    flat = logits.view(-1)
    width = logits.shape[1]
    if meta.bias_rows is not None:
        flat.index_add_(0, meta.bias_rows * width + meta.bias_tokens, meta.bias_values)
    if meta.rep_rows is not None:
        idx = meta.rep_rows * width + meta.rep_tokens
        seen = flat.index_select(0, idx)
        f = meta.rep_factors
        flat.index_copy_(0, idx, torch.where(seen > 0, seen / f, seen * f))
    if meta.sub_rows is not None:
        flat.index_add_(0, meta.sub_rows * width + meta.sub_tokens, meta.sub_values, alpha=-1)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
    top_p_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask (to -inf, in place) logits outside each row's top-k, then outside its top-p nucleus.

    top_k: [B] int64, vocab size = off. top_p: [P] float32 for the rows `top_p_rows` ([P] int64;
    None = all B rows), 1.0 = off. Top-p keeps the smallest set of most likely tokens whose
    probability (after top-k, renormalised) reaches p: a token stays when the tokens more likely
    than it hold less than p. The most likely token always stays. Both filters cut at a threshold
    value, so tokens tied with the last kept one are kept too.
    """
    vocab = logits.shape[1]
    if top_k is not None:
        # The k-th largest value is the threshold; a partial top-k avoids sorting the vocabulary.
        k = min(max_top_k if max_top_k > 0 else int(top_k.max()), vocab)
        top_vals = logits.topk(k, dim=-1).values  # [B, k], descending
        kth = top_vals.gather(1, (top_k.clamp(max=k) - 1).unsqueeze(1))
        # Rows with top-k off (k == vocab) keep everything, even though max_top_k < vocab.
        kth.masked_fill_((top_k >= vocab).unsqueeze(1), float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))

    if top_p is not None:
        sub = logits if top_p_rows is None else logits.index_select(0, top_p_rows)
        sub.masked_fill_(sub < _top_p_threshold(sub, top_p), float("-inf"))
        if top_p_rows is not None:
            logits.index_copy_(0, top_p_rows, sub)
    return logits


def _top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, 1] the smallest logit each row keeps under top-p."""
    vocab = logits.shape[1]
    lse = logits.logsumexp(dim=-1, keepdim=True)
    p = top_p.unsqueeze(1)
    if logits.device.type != "cpu":
        # On a GPU a full sort is cheap and, unlike the tiers below, needs no host sync.
        return _nucleus_cut(logits.sort(dim=-1, descending=True).values, lse, p)[0]
    thresh = torch.empty_like(lse)
    rows = torch.arange(logits.shape[0], device=logits.device)
    sizes = [k for k in _TOP_P_CANDIDATES if k < vocab] + [vocab]
    for size in sizes:
        sub = logits if rows.numel() == logits.shape[0] else logits.index_select(0, rows)
        vals = sub.topk(size, dim=-1).values if size < vocab else sub.sort(dim=-1, descending=True).values
        cut, resolved = _nucleus_cut(vals, lse[rows], p[rows])
        if size == vocab:
            resolved = torch.ones_like(resolved)
        thresh[rows] = cut
        if bool(resolved.all()):
            break
        rows = rows[~resolved]
    return thresh


def _nucleus_cut(
    sorted_desc: torch.Tensor, lse: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold [R, 1] from a row's largest values (descending) and whether the nucleus fits in them."""
    probs = (sorted_desc - lse).exp()
    cum = probs.cumsum(dim=-1)
    before = cum - probs  # probability of the tokens strictly more likely than this one
    num_keep = (before < p).sum(dim=-1, keepdim=True).clamp(min=1)
    resolved = (cum[:, -1:] >= p).squeeze(1)
    return sorted_desc.gather(1, num_keep - 1), resolved


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero (in place) probabilities below min_p times the row's largest probability.

    No renormalisation: the inverse-CDF draw scales by each row's total.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row from non-negative (unnormalised) weights [B, V], given u [B] in [0, 1).

    Returns the index i where the running sum first exceeds u * total, so P(i) = w_i / total and a
    zero weight is never chosen. Two levels keep the sequential scan short: block sums pick the
    block, then a cumulative sum of that block's 256 weights picks the token.
    """
    b, vocab = probs.shape
    full = vocab // _BLOCK * _BLOCK
    sums = probs[:, :full].reshape(b, -1, _BLOCK).sum(dim=-1)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search lands on a block whose weight is > 0.
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, x, right=True).clamp(max=cdf.shape[1] - 1)
    prev = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(x))

    cols = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    inner = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0).cumsum(dim=-1)
    # The block's cumsum may round differently from its sum: stay strictly below its own total.
    r = torch.minimum((x - prev).clamp(min=0.0), torch.nextafter(inner[:, -1:], torch.zeros_like(x)))
    j = torch.searchsorted(inner, r, right=True).clamp(max=_BLOCK - 1)
    return (block * _BLOCK + j).squeeze(1).clamp(max=vocab - 1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1 + num_top] values and ids: the sampled token first, then the top-num_top (descending)."""
    ids = token_ids.unsqueeze(1)
    sampled = logprobs.gather(1, ids)
    if num_top <= 0:
        return sampled, ids
    top_vals, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([sampled, top_vals], dim=1), torch.cat([ids, top_ids], dim=1)
