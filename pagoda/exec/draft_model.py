"""The draft-model proposer: a smaller model with the target's tokenizer proposes k tokens greedily.

Owns the draft model, its own paged KV cache (the same number of blocks of the same size as the
target's, but the draft's layers and heads) with its own block allocator, and a `ModelRunner` over
them, which it drives with steps it builds itself (plain `ScheduledRequest`s, as the scheduler's).
Per engine step and for all requests at once: one forward over each request's tokens the draft has
not computed (its whole prompt the first time; afterwards the target's newly verified tokens), which
proposes the first draft token, then k - 1 one-token forwards for the others.

The draft's KV stays valid across steps up to the first position where the tokens it computed (the
context, then its own drafts) differ from the verified context; it recomputes from there. Drafts are
the draft's argmax, a point-mass proposal, so verification accepts draft d with probability p(d)
(see `pagoda.exec.rejection_sampler`) and sampled output keeps the target's distribution.

A request whose blocks do not fit in the draft's pool, or whose drafts would pass max_model_len,
gets no drafts that step.
"""

from __future__ import annotations

import torch

from pagoda.contracts.step import NewRequestData, ScheduledRequest, SchedulerOutput
from pagoda.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


class _DraftState:
    __slots__ = ("tokens", "verified", "blocks", "started")

    def __init__(self) -> None:
        self.tokens: list[int] = []  # tokens whose KV the draft cache holds, by position
        self.verified = 0  # how many leading tokens are known to equal the request's (last round's context)
        self.blocks: list[int] = []
        self.started = False  # the draft runner holds a mirror of the request


class DraftModelProposer:
    def __init__(self, runner, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 max_model_len: int) -> None:
        """`runner`: a ModelRunner over the draft model and its own KV cache of `num_blocks` blocks."""
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0 stays unused, as the pool's null block
        self.states: dict[str, _DraftState] = {}

    def drop(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.free_blocks.extend(reversed(st.blocks))
            self.runner.release([request_id])

    def propose(self, request_id: str, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
        return self.propose_batch([(request_id, prompt_ids, output_ids)]).get(request_id, [])

    @torch.inference_mode()
    def propose_batch(self, rows: list[tuple[str, list[int], list[int]]]) -> dict[str, list[int]]:
        """Drafts for each (request id, prompt ids, output ids so far)."""
        k, bs = self.k, self.block_size
        first: list[ScheduledRequest] = []
        lengths: dict[str, int] = {}
        for rid, prompt, output in rows:
            length = len(prompt) + len(output)
            if length + k > self.max_model_len:
                continue
            st = self.states.get(rid)
            if st is None:
                st = self.states[rid] = _DraftState()
            valid = _common_prefix(st.tokens, st.verified, prompt, output, length - 1)  # compute >= 1 token
            need = -(-(length + k - 1) // bs) - len(st.blocks)
            if need > len(self.free_blocks):
                continue
            new_blocks = [self.free_blocks.pop() for _ in range(max(need, 0))]
            st.blocks.extend(new_blocks)
            new_ids = prompt[valid:] + output if valid < len(prompt) else output[valid - len(prompt) :]
            new_request = None
            if not st.started:
                # The runner's mirror is only read for penalties and min_tokens, which greedy drafts lack.
                new_request = NewRequestData(prompt[:1], [], _GREEDY)
                st.started = True
            first.append(ScheduledRequest(rid, valid, length - valid, new_ids, new_blocks, st.blocks[:], length,
                                          None, new_request))
            st.tokens = st.tokens[:valid] + new_ids
            st.verified = length
            lengths[rid] = length
        if not first:
            return {}
        drafts = {rid: toks[:1] for rid, toks in self.runner.execute(SchedulerOutput(first)).sampled_token_ids.items()}
        for j in range(1, k):
            step = []
            for rid, d in drafts.items():
                st = self.states[rid]
                pos = lengths[rid] + j - 1
                step.append(ScheduledRequest(rid, pos, 1, [d[-1]], [], st.blocks[:], pos + 1))
                st.tokens.append(d[-1])
            sampled = self.runner.execute(SchedulerOutput(step)).sampled_token_ids
            for rid, toks in sampled.items():
                drafts[rid].append(toks[0])
        return drafts


def _common_prefix(tokens: list[int], known: int, prompt: list[int], output: list[int], limit: int) -> int:
    """How many leading `tokens` equal prompt + output, at most `limit`; the first `known` do."""
    n = min(len(tokens), limit)
    num_prompt = len(prompt)
    i = min(known, n)
    while i < n and tokens[i] == (prompt[i] if i < num_prompt else output[i - num_prompt]):
        i += 1
    return i
