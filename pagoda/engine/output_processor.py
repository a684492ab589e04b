"""Turns the core's token-id outputs into RequestOutputs: detokenization, stop strings, n > 1 groups.

It lives on the front-end side (in-process for `LLM`, in the API process for the server), so text work
never stalls the core's step loop. Stop strings found here are reported back so the core ends those
requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.contracts.messages import EngineCoreOutput
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}#{index}"


@dataclass
class _Sequence:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for delta outputs


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    delta: bool
    seqs: list[_Sequence]
    arrival_time: float
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    queued_time: float | None = None  # core clock: entered the core's queue
    scheduled_time: float | None = None  # core clock: first admitted (the earliest of its sequences)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once
    weight_versions: list[str] = field(default_factory=list)  # in the order they produced tokens

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._child_to_seq: dict[str, tuple[_Group, _Sequence]] = {}
        self._token_text: dict[int, str] = {}  # single tokens decoded, for logprob entries

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        delta: bool = False,
    ) -> list[str]:
        """Register a request; returns the ids of its n sequences as the core knows them."""
        seqs = []
        for i in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                    eos_token_id=eos_token_id,
                    min_tokens=params.min_tokens,
                )
            seqs.append(_Sequence(i, detok, logprobs=[] if params.logprobs is not None else None))
        group = _Group(request_id, prompt, prompt_token_ids, params, delta, seqs, time.time())
        self._groups[request_id] = group
        ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        for cid, seq in zip(ids, seqs):
            self._child_to_seq[cid] = (group, seq)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its children's core ids (for the core to abort)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        ids = [child_request_id(request_id, s.index, len(group.seqs)) for s in group.seqs]
        for cid in ids:
            self._child_to_seq.pop(cid, None)
        return ids

    def process(self, outputs: list[EngineCoreOutput],
                weight_version: str = "") -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs (computed by the weights `weight_version`). Returns updated
        RequestOutputs and core ids stopped by a stop string."""
        touched: dict[str, _Group] = {}
        stopped: list[str] = []
        now = time.time()
        for out in outputs:
            entry = self._child_to_seq.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            group, seq = entry
            if weight_version and out.new_token_ids and weight_version not in group.weight_versions:
                group.weight_versions.append(weight_version)
            if group.first_token_time is None and out.new_token_ids:
                group.first_token_time = now
            if out.scheduled_time and (group.scheduled_time is None or out.scheduled_time < group.scheduled_time):
                group.scheduled_time = out.scheduled_time
                group.queued_time = out.queued_time
            if seq.index == 0:
                # The first sequence's hits are the prompt's: its siblings reuse the blocks it just
                # computed (n > 1), which the client never had cached.
                group.num_cached_tokens = out.num_cached_tokens
            seq.token_ids.extend(out.new_token_ids)
            if out.new_logprobs and seq.logprobs is not None:
                self._add_logprobs(seq, out.new_logprobs)
            if out.prompt_logprobs is not None and group.prompt_logprobs is None:
                group.prompt_logprobs = self._prompt_logprobs(out.prompt_logprobs)
            finished = out.finish_reason is not None
            if seq.detok is not None and seq.finish_reason is None:
                stop = seq.detok.update(out.new_token_ids, finished)
                if stop is not None and not finished:
                    # A stop string ended it here; the core still thinks it runs.
                    stopped.append(out.request_id)
                    seq.finish_reason, seq.stop_reason = "stop", stop
                elif stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
            if finished and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            touched[group.request_id] = group
        results = [self._make_output(g) for g in touched.values()]
        for g in touched.values():
            if g.finished:
                self.abort(g.request_id)
        return results, stopped

    def _add_logprobs(self, seq: _Sequence, new: list[tuple[list[int], list[float]]]) -> None:
        text = self._texts([t for ids, _ in new for t in ids])
        for ids, lps in new:
            entry = {ids[0]: Logprob(lps[0], rank=None, decoded_token=text(ids[0]))}
            for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if tid in entry:
                    entry[tid].rank = rank
                else:
                    entry[tid] = Logprob(lp, rank=rank, decoded_token=text(tid))
            if entry[ids[0]].rank is None:
                # Rank of the sampled token is 1 + how many alternatives beat it.
                entry[ids[0]].rank = 1 + sum(1 for lp in lps[1:] if lp > lps[0])
            seq.logprobs.append(entry)
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lps[0]

    def _prompt_logprobs(self, rows: list[tuple[list[int], list[float], int]]) -> list[dict[int, Logprob] | None]:
        text = self._texts([t for ids, _, _ in rows for t in ids])
        entries: list[dict[int, Logprob] | None] = [None]  # the first prompt token has no context
        for ids, lps, rank in rows:
            entry = {ids[0]: Logprob(lps[0], rank=rank, decoded_token=text(ids[0]))}
            for top_rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                entry.setdefault(tid, Logprob(lp, rank=top_rank, decoded_token=text(tid)))
            entries.append(entry)
        return entries

    def _texts(self, token_ids: list[int]):
        """A lookup of each token's own text. Decoded texts are kept (at most one per vocabulary
        entry): a long prompt's logprobs name thousands of tokens, mostly the same few."""
        if self.tokenizer is None:
            return lambda tid: None
        cache = self._token_text
        for t in token_ids:
            if t not in cache:
                cache[t] = self.tokenizer.decode([t])
        return cache.__getitem__

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for seq in group.seqs:
            if group.delta:
                if seq.detok is not None:
                    text = seq.detok.get_delta_text()
                else:
                    text = ""
                token_ids = seq.token_ids[seq.sent_tokens :]
                logprobs = seq.logprobs[seq.sent_tokens :] if seq.logprobs is not None else None
                seq.sent_tokens = len(seq.token_ids)
            else:
                text = seq.detok.output_text if seq.detok is not None else ""
                token_ids = list(seq.token_ids)
                logprobs = seq.logprobs
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = {
            "arrival_time": group.arrival_time,
            "first_token_time": group.first_token_time,
            "queued_time": group.queued_time,
            "scheduled_time": group.scheduled_time,
            "max_tokens": group.params.max_tokens,
        }
        prompt_logprobs = group.prompt_logprobs
        if group.delta:
            if group.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                group.prompt_logprobs_sent = True
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            outs,
            group.finished,
            num_cached_tokens=group.num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            weight_version="+".join(group.weight_versions) or None,
        )
