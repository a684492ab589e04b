"""Speculative decoding in the execution layer: proposing draft tokens and verifying them.

Owns, for the model runner: the proposer (n-gram lookup here; the draft model in
`pagoda.exec.draft_model`), the load gate (no drafts for a step with more than
`disable_by_batch_size` requests), and the verification of the rows that carried drafts. A row with
k drafts was computed as k + 1 positions in the target forward; position j is sampled as if the
drafts before it were already outputs (penalties and min_tokens see them), and
`pagoda.exec.rejection_sampler` decides how many drafts stand and draws the token after them.

Randomness: a seeded request draws its k + 1 uniforms from its own generator (k acceptance tests,
then the final draw), so it reproduces whatever else is in the batch.

Structured outputs: a request's drafts are cut to what its grammar allows, and the runner masks each
drafted position with the grammar's state after the drafts before it
(`pagoda.exec.structured_output`), so verification samples every position as plain decoding would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.config import SpeculativeConfig
from pagoda.contracts.step import ScheduledRequest
from pagoda.exec.ngram_proposer import NgramProposer
from pagoda.exec.rejection_sampler import greedy_verify, rejection_sample
from pagoda.exec.sampler import Sampler, SamplingMetadata, gather_logprobs


class _Extended(Sequence):
    """A token list followed by a few more tokens, without copying the list (a drafted position's
    output history: the outputs so far, then the drafts before it)."""

    __slots__ = ("base", "extra")

    def __init__(self, base: list[int], extra: list[int]) -> None:
        self.base = base
        self.extra = extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __iter__(self):
        yield from self.base
        yield from self.extra

    def __getitem__(self, i):
        return list(self)[i]


# (request id, row state with prompt_token_ids/output_token_ids/sampling_params/eos_token_id,
# generator or None): what verification reads of each request.
VerifyRow = tuple[ScheduledRequest, object, torch.Generator | None]


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, vocab_size: int, device: torch.device, draft=None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        if config.method == "ngram":
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        else:
            if draft is None:
                raise ValueError("speculative method draft_model needs the draft model")
            self.proposer = draft
        self.sampler = Sampler()

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)

    # -- proposing ------------------------------------------------------------------------------
    def enabled_for(self, batch_size: int) -> bool:
        gate = self.config.disable_by_batch_size
        return gate is None or batch_size <= gate

    def propose(self, rows: list[tuple[str, object]], structured_outputs=None) -> dict[str, list[int]]:
        """Drafts for requests whose mirrors (prompt_token_ids, output_token_ids) already hold this
        step's tokens; a structured-output request's are cut where its grammar refuses one."""
        drafts: dict[str, list[int]] = {}
        batched = getattr(self.proposer, "propose_batch", None)
        if batched is not None:  # the draft model: one batch of forwards for all requests
            proposed = batched([(rid, st.prompt_token_ids, st.output_token_ids) for rid, st in rows])
        for rid, state in rows:
            if batched is not None:
                d = proposed.get(rid, [])
            else:
                d = self.proposer.propose(rid, state.prompt_token_ids, state.output_token_ids)
            so = state.sampling_params.structured_outputs
            if d and so is not None:
                d = structured_outputs.valid_drafts(rid, so, d) if structured_outputs is not None else []
            if d:
                drafts[rid] = d
        return drafts

    # -- verifying ------------------------------------------------------------------------------
    @torch.no_grad()
    def verify(
        self, logits: torch.Tensor, rows: list[VerifyRow]
    ) -> tuple[list[list[int]], list[list[tuple[list[int], list[float]]] | None]]:
        """`logits`: k_i + 1 rows per request, in order (the known token's, then each draft's).
        Returns each request's emitted tokens (accepted drafts, then one) and, for those that ask,
        their logprobs (one entry per emitted token: the token first, then the top-N)."""
        ks = [len(s.spec_token_ids) for s, _, _ in rows]
        params, prompts, outputs, eos = [], [], [], []
        for (s, st, _), k in zip(rows, ks):
            for j in range(k + 1):
                params.append(st.sampling_params)
                prompts.append(st.prompt_token_ids)
                outputs.append(_Extended(st.output_token_ids, s.spec_token_ids[:j]) if j else st.output_token_ids)
                eos.append(st.eos_token_id)
        meta = SamplingMetadata.build(params, prompts, outputs, [None] * len(params), self.vocab_size,
                                      self.device, eos)
        greedy, probs, raw_logprobs = self.sampler.distributions(logits, meta)

        r, kmax = len(rows), max(ks)
        dev = logits.device
        # Flat row of (request i, position j), padded positions pointing at the request's last row.
        starts = [0]
        for k in ks:
            starts.append(starts[-1] + k + 1)
        index = torch.tensor(
            [[starts[i] + min(j, ks[i]) for j in range(kmax + 1)] for i in range(r)], dtype=torch.int64, device=dev
        )
        drafts = torch.tensor([s.spec_token_ids + [0] * (kmax - k) for (s, _, _), k in zip(rows, ks)],
                              dtype=torch.int64, device=dev)
        num_drafts = torch.tensor(ks, dtype=torch.int64, device=dev)
        if probs is None:
            tokens, accepted = greedy_verify(drafts, num_drafts, greedy[index])
        else:
            draft_probs = self.proposer.draft_probs(rows, kmax) if hasattr(self.proposer, "draft_probs") else None
            tokens, accepted = rejection_sample(drafts, num_drafts, probs[index], draft_probs,
                                                self._uniforms(rows, ks, kmax))
        tokens_l, accepted_l = tokens.tolist(), accepted.tolist()
        emitted = [t[: a + 1] for t, a in zip(tokens_l, accepted_l)]

        logprobs: list = [None] * r
        if raw_logprobs is not None:
            for i, (s, st, _) in enumerate(rows):
                n = st.sampling_params.logprobs
                if n is None:
                    continue
                flat = torch.arange(starts[i], starts[i] + len(emitted[i]), device=dev)
                ids = torch.tensor(emitted[i], dtype=torch.int64, device=dev)
                lp, top = gather_logprobs(raw_logprobs[flat], ids, n)
                logprobs[i] = list(zip(top.tolist(), lp.tolist()))
        return emitted, logprobs

    def _uniforms(self, rows: list[VerifyRow], ks: list[int], kmax: int) -> torch.Tensor:
        """[R, kmax + 1]: k acceptance tests then the final draw; seeded rows from their generator."""
        u = torch.rand(len(rows), kmax + 1, device=self.device)
        for i, ((_, _, gen), k) in enumerate(zip(rows, ks)):
            if gen is not None:
                own = torch.rand(k + 1, generator=gen, device=gen.device).to(self.device)
                u[i, :k] = own[:k]
                u[i, kmax] = own[k]
        return u
