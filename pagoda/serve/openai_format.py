"""OpenAI response shapes, built as plain dicts from pagoda's `RequestOutput`s: completion and chat
objects and their streamed chunks, usage, and logprobs in the two shapes OpenAI uses:

- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
"""

from __future__ import annotations

import math

import msgspec

from pagoda.outputs import Logprob

# JSON has no -inf; a token the model rules out entirely gets this instead (vLLM does the same).
_MIN_LOGPROB = -9999.0


def weight_version_of(outputs: list) -> str | None:
    """The weights that produced these RequestOutputs: one version, or "A+B" where they differ
    (an in-place update during a request, or a batch's prompts on both sides of a swap)."""
    seen: list[str] = []
    for out in outputs:
        for v in (out.weight_version or "").split("+"):
            if v and v not in seen:
                seen.append(v)
    return "+".join(seen) or None


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def _token_str(entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else ""


def _name(token_id: int, entry: Logprob, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else _token_str(entry)


def _top(entries: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entries.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [kv for kv in ranked if kv[1].rank is not None and kv[1].rank <= n][:n]


class CompletionLogprobs:
    """Accumulates the completions-style logprobs object of one choice across deltas."""

    def __init__(self, num_top: int, text_offset: int = 0, tokens_as_ids: bool = False) -> None:
        self.num_top = num_top
        self.offset = text_offset
        self.as_ids = tokens_as_ids

    def make(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
             prompt: tuple[list[int], list[dict[int, Logprob] | None], str] | None = None) -> dict:
        """`prompt`: (ids, RequestOutput.prompt_logprobs, the first token's text) when the choice
        echoes its prompt: its tokens come first, the first one without a logprob (as OpenAI's)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        if prompt is not None:
            ids, entries, first_text = prompt
            tokens.append(f"token_id:{ids[0]}" if self.as_ids else first_text)
            token_lps.append(None)
            tops.append(None)
            offsets.append(self.offset)
            self.offset += len(first_text)
            self._add(ids[1:], entries[1:], tokens, token_lps, tops, offsets)
        self._add(token_ids, logprobs or [], tokens, token_lps, tops, offsets)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _add(self, token_ids: list[int], logprobs: list, tokens: list, token_lps: list, tops: list,
             offsets: list) -> None:
        for tid, entries in zip(token_ids, logprobs):
            sampled = entries.get(tid)
            text = _token_str(sampled) if sampled is not None else ""
            tok = f"token_id:{tid}" if self.as_ids else text
            tokens.append(tok)
            token_lps.append(_lp(sampled.logprob) if sampled is not None else None)
            top = {_name(i, e, self.as_ids): _lp(e.logprob) for i, e in _top(entries, self.num_top)}
            # As vLLM: the sampled token is always among its own top_logprobs.
            if sampled is not None:
                top.setdefault(tok, _lp(sampled.logprob))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None, num_top: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding that token and the top-num_top alternatives."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        first = next(iter(entry))  # the prompt token itself
        out.append({
            str(tid): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
            for tid, e in entry.items()
            if tid == first or (e.rank is not None and e.rank <= num_top)
        })
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, num_top: int, tokens_as_ids: bool = False
) -> dict:
    content = []
    for tid, entries in zip(token_ids, logprobs or []):
        sampled = entries.get(tid)
        text = _token_str(sampled) if sampled is not None else ""
        content.append(
            {
                "token": f"token_id:{tid}" if tokens_as_ids else text,
                "logprob": _lp(sampled.logprob) if sampled is not None else _MIN_LOGPROB,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _name(i, e, tokens_as_ids),
                        "logprob": _lp(e.logprob),
                        "bytes": list(_token_str(e).encode("utf-8")),
                    }
                    for i, e in _top(entries, num_top)
                ],
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def finish_reason(reason: str | None) -> str | None:
    # "abort" never reaches a client that is still listening; anything else is OpenAI's vocabulary.
    return reason


_encode = msgspec.json.Encoder().encode


def sse(data: dict) -> bytes:
    """One server-sent event: compact UTF-8 JSON. msgspec, not json.dumps: a streamed token's chunk
    is encoded in ~0.4 us against ~4 (the API process encodes one per token of every stream)."""
    return b"data: " + _encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
