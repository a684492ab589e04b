"""SamplingMetadata: one step's per-row sampling parameters, as device tensors for the batched sampler.

Owns the translation from a list of per-request `SamplingParams` (plus the rows' token history and
seeded generators) into the few tensors `pagoda.exec.sampler.Sampler` needs. The model runner builds
it once per step. Building is cheap on purpose: every stage that no row uses is left as `None` (so the
sampler skips it), and token histories are read only for rows that ask for penalties.

Penalties are kept sparse: as (row, token) pairs of the tokens a row has seen, not as [B, V] count
tensors. A row's context has at most a few thousand distinct tokens while V is ~50k-150k, so gathering
and scattering the seen pairs costs O(context) instead of several full passes over [B, V].
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step sampling state for a batch of B rows (one row per sequence that samples this step)."""

    num_rows: int
    vocab_size: int
    device: torch.device

    # True when every row is greedy (argmax); then no randomness, temperature or filtering is needed.
    all_greedy: bool
    # True when no row is greedy; then the argmax for greedy rows is skipped.
    all_random: bool
    # [B] bool, True for greedy rows; None when all rows are greedy or none are (no mixing needed).
    greedy_mask: torch.Tensor | None = None
    # [B] float32; greedy rows hold 1.0 so dividing by it never makes inf/NaN. None when all greedy
    # or when every row's temperature is 1.0 (the API default: the division would be a no-op pass).
    temperature: torch.Tensor | None = None

    # [B] int64 top-k per row; rows with top-k off hold vocab_size. None when no row uses top-k.
    top_k: torch.Tensor | None = None
    # Largest real top-k in the batch, kept as a Python int so the sampler never syncs to read it.
    max_top_k: int = 0
    # [P] float32 top-p of the rows that use it (p < 1), and [P] int64 their row indices
    # (None when every row uses it). Rows with p = 1 are left out so they never cost a sort.
    top_p: torch.Tensor | None = None
    top_p_rows: torch.Tensor | None = None
    # [B] float32 min-p per row (0.0 = off). None when no row uses min-p.
    min_p: torch.Tensor | None = None

    no_penalties: bool = True
    # Repetition penalty, sparse: one entry per distinct (row, token) seen in prompt or output of a
    # row with repetition_penalty != 1; factor is that row's penalty. None when no row has one.
    rep_rows: torch.Tensor | None = None  # [R] int64
    rep_tokens: torch.Tensor | None = None  # [R] int64
    rep_factors: torch.Tensor | None = None  # [R] float32
    # Presence + frequency, sparse: one entry per distinct (row, token) in a row's OUTPUT, with the
    # amount to subtract: frequency * count + presence. None when no row has either.
    sub_rows: torch.Tensor | None = None  # [S] int64
    sub_tokens: torch.Tensor | None = None  # [S] int64
    sub_values: torch.Tensor | None = None  # [S] float32
    # Additive biases, sparse, applied before the penalties: logit_bias entries, and -inf on the stop
    # tokens (EOS unless ignore_eos, stop_token_ids) of rows that have fewer than min_tokens outputs,
    # so those rows never sample them (vLLM's semantics). None when no row has either.
    bias_rows: torch.Tensor | None = None  # [A] int64
    bias_tokens: torch.Tensor | None = None  # [A] int64
    bias_values: torch.Tensor | None = None  # [A] float32

    # Row index -> that row's private generator. Rows not here draw from the default generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    # True when at least one row asked for logprobs (logprobs is not None, 0 included).
    needs_logprobs: bool = False
    # Largest top-N asked for; 0 when no row asks for alternatives. Output width is 1 + this.
    max_num_logprobs: int = 0

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Sequence[int | None] | None = None,
    ) -> "SamplingMetadata":
        """Build the batch's tensors. `prompt_token_ids`/`output_token_ids` are only read for rows
        with penalties, so callers with no penalties pay nothing for long contexts. `eos_token_ids`:
        each row's EOS, which min_tokens keeps it from sampling too early."""
        n = len(params)
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        meta = cls(
            num_rows=n,
            vocab_size=vocab_size,
            device=device,
            all_greedy=all_greedy,
            all_random=all_random,
        )

        if not all_greedy:
            if not all_random:
                meta.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
            # Greedy rows never use their scaled logits (their token comes from argmax); 1.0 keeps
            # their softmax finite. Filters likewise only matter for random rows.
            temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
            if any(t != 1.0 for t in temps):
                meta.temperature = torch.tensor(temps, dtype=torch.float32, device=device)
            ks = [
                p.top_k if (not g and 0 < p.top_k < vocab_size) else vocab_size
                for p, g in zip(params, greedy)
            ]
            real_ks = [k for k in ks if k < vocab_size]
            if real_ks:
                meta.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
                meta.max_top_k = max(real_ks)
            p_rows = [i for i, (p, g) in enumerate(zip(params, greedy)) if not g and p.top_p < 1.0]
            if p_rows:
                meta.top_p = torch.tensor(
                    [float(params[i].top_p) for i in p_rows], dtype=torch.float32, device=device
                )
                if len(p_rows) < n:
                    meta.top_p_rows = torch.tensor(p_rows, dtype=torch.int64, device=device)
            mps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
            if any(v > 0.0 for v in mps):
                meta.min_p = torch.tensor(mps, dtype=torch.float32, device=device)

        # Penalties change greedy rows too (vLLM applies them before the argmax).
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            # Repetition looks at prompt + output.
            histories = [itertools.chain(prompt_token_ids[i], output_token_ids[i]) for i in rep_rows]
            lengths = [len(prompt_token_ids[i]) + len(output_token_ids[i]) for i in rep_rows]
            rows, toks, _ = _distinct_pairs(rep_rows, histories, lengths, vocab_size, device)
            per_row = torch.ones(n, dtype=torch.float32, device=device)
            per_row[rep_rows] = torch.tensor(
                [params[i].repetition_penalty for i in rep_rows], dtype=torch.float32, device=device
            )
            # index_select, not per_row[rows]: tensor-indexed gathers are far slower on CPU.
            meta.rep_rows, meta.rep_tokens = rows, toks
            meta.rep_factors = per_row.index_select(0, rows)

        sub_rows = [
            i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        if sub_rows:
            # Presence and frequency look at the output only.
            histories = [output_token_ids[i] for i in sub_rows]
            lengths = [len(output_token_ids[i]) for i in sub_rows]
            rows, toks, counts = _distinct_pairs(sub_rows, histories, lengths, vocab_size, device)
            freq = torch.zeros(n, dtype=torch.float32, device=device)
            pres = torch.zeros(n, dtype=torch.float32, device=device)
            freq[sub_rows] = torch.tensor(
                [params[i].frequency_penalty for i in sub_rows], dtype=torch.float32, device=device
            )
            pres[sub_rows] = torch.tensor(
                [params[i].presence_penalty for i in sub_rows], dtype=torch.float32, device=device
            )
            meta.sub_rows, meta.sub_tokens = rows, toks
            meta.sub_values = freq.index_select(0, rows) * counts + pres.index_select(0, rows)
        _add_biases(meta, params, output_token_ids, eos_token_ids, device)
        meta.no_penalties = meta.rep_rows is None and meta.sub_rows is None and meta.bias_rows is None

        meta.generators = {i: g for i, g in enumerate(generators) if g is not None}
        meta.needs_logprobs = any(p.logprobs is not None for p in params)
        meta.max_num_logprobs = max((p.logprobs or 0 for p in params), default=0)
        return meta


# A bias past this already forces or bans its token. Larger ones (1e300 is a finite float64, but
# not a float32) would make the biased logit +inf, and softmax's inf - inf a NaN row that samples
# garbage; 1e30 stays finite even divided by the smallest temperature that is not greedy.
_MAX_BIAS = 1e30


def _add_biases(
    meta: SamplingMetadata,
    params: list[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int | None] | None,
    device: torch.device,
) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            tokens.extend(p.logit_bias)
            values.extend(min(_MAX_BIAS, max(-_MAX_BIAS, v)) for v in p.logit_bias.values())
        # A grammar decides when a structured output ends: once it is complete it allows EOS alone,
        # and masking that too would leave the row no token at all.
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens and p.structured_outputs is None:
            eos = None if eos_token_ids is None or p.ignore_eos else eos_token_ids[i]
            # Ids past the vocabulary can never be sampled (and would index another row's logits).
            stops = {t for t in p.stop_token_ids if t < meta.vocab_size}
            if eos is not None and eos < meta.vocab_size:
                stops.add(eos)
            rows.extend([i] * len(stops))
            tokens.extend(stops)
            values.extend([float("-inf")] * len(stops))
    if rows:
        meta.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        meta.bias_tokens = torch.tensor(tokens, dtype=torch.int64, device=device)
        meta.bias_values = torch.tensor(values, dtype=torch.float32, device=device)


def _distinct_pairs(
    rows: list[int],
    histories: list,
    lengths: list[int],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs over the given rows' token histories, with their counts.

    Done in numpy on the host, where the ids already are: `numpy.fromiter` reads the lists ~5x
    faster than torch.tensor, and `numpy.unique` over the key row * V + token is ~25x faster than
    torch.unique on CPU. Only the deduplicated pairs cross to the device.
    """
    total = sum(lengths)
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, torch.empty(0, dtype=torch.float32, device=device)
    ids = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=total)
    keys = np.repeat(np.asarray(rows, dtype=np.int64), lengths) * vocab_size + ids
    keys, counts = np.unique(keys, return_counts=True)
    pair_rows, pair_tokens = np.divmod(keys, vocab_size)
    return (
        torch.from_numpy(pair_rows).to(device),
        torch.from_numpy(pair_tokens).to(device),
        torch.from_numpy(counts).to(device=device, dtype=torch.float32),
    )
