"""The n-gram proposer (prompt lookup): draft tokens copied from earlier in the request itself.

For a context t_0..t_{L-1}, find the longest n in [prompt_lookup_min, prompt_lookup_max] such that
the last n tokens also occur earlier, ending at some position e < L - 1; propose the up to k tokens
that followed them, t_{e+1}..t_{e+k}. Among equally long matches the earliest wins (vLLM's choice:
in an input-grounded answer, the prompt's copy of a passage comes first). It costs one vectorised
comparison of the context with its last token, then a few narrowing passes over the candidates.

Each request's tokens are kept here as a growing numpy buffer, appended to as the runner learns
tokens, so a lookup never converts a whole Python list again.
"""

from __future__ import annotations

import numpy as np


class _Buffer:
    __slots__ = ("array", "length")

    def __init__(self, tokens: list[int]) -> None:
        self.array = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.array[: len(tokens)] = tokens
        self.length = len(tokens)

    def extend(self, tokens: list[int]) -> None:
        n = self.length + len(tokens)
        if n > len(self.array):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        self.array[self.length : n] = tokens
        self.length = n


def propose_ngram(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for `context` (1-D int64), or [] when no suffix of >= min_n tokens recurs."""
    length = len(context)
    if length < min_n + 1 or k < 1:
        return []
    # Candidate ends e < L - 1 of an earlier occurrence, narrowed one token further back per pass.
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])
    best = ends if min_n <= 1 else None
    n = 1
    while ends.size and n < max_n:
        starts = ends - n
        ok = starts >= 0
        ends = ends[ok]
        ends = ends[context[starts[ok]] == context[length - 1 - n]]
        n += 1
        if ends.size and n >= min_n:
            best = ends
    if best is None or best.size == 0:
        return []
    e = int(best[0])
    return context[e + 1 : e + 1 + k].tolist()


class NgramProposer:
    """Per-request token buffers and the lookup over them."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.buffers: dict[str, _Buffer] = {}

    def propose(self, request_id: str, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
        """Drafts to follow a request's tokens so far (its prompt, then its outputs; only the outputs
        this proposer has not seen are read)."""
        num_prompt = len(prompt_ids)
        buf = self.buffers.get(request_id)
        if buf is None or buf.length > num_prompt + len(output_ids):
            buf = self.buffers[request_id] = _Buffer(prompt_ids + output_ids)
        elif buf.length < num_prompt + len(output_ids):
            buf.extend(output_ids[buf.length - num_prompt :])
        return propose_ngram(buf.array[: buf.length], self.k, self.min_n, self.max_n)

    def drop(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)
