"""Turns the engine's outputs into per-request lifecycle events (first token, tokens, finished,
aborted) and hands them to sinks: the Prometheus metrics, the request log and the tracer.

It listens on `AsyncLLM.output_listeners` and `AsyncLLM.abort_listeners`, in the API process. Times
are wall-clock seconds: arrival and token times are taken here, the queue entry and first admission
come from the engine core (same machine, same clock).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pagoda.contracts.messages import EngineCoreOutputs
from pagoda.outputs import RequestOutput

logger = logging.getLogger("pagoda.requests")


@dataclass
class FinishedRequest:
    request_id: str
    finish_reason: str
    arrival_time: float
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    max_tokens: int | None
    queued_time: float | None  # core clock: entered the core's queue
    scheduled_time: float | None  # core clock: first admitted
    first_token_time: float | None
    last_token_time: float | None
    # Per sequence (n > 1 has several): the sum of (last token - first token) times, and of
    # (tokens - 1). None: derive them from the request's decode time and token count (n = 1).
    decode_seconds_per_sequence: float | None = None
    decode_steps_per_sequence: int | None = None
    num_sequences: int = 1  # the request's n
    max_sequence_tokens: int | None = None  # the most tokens one of its sequences generated
    weight_version: str | None = None  # the weights that produced it ("A+B": updated in place meanwhile)

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.scheduled_time is None or self.queued_time is None:
            return None
        return max(0.0, self.scheduled_time - self.queued_time)

    @property
    def prefill_time(self) -> float | None:
        if self.scheduled_time is None or self.first_token_time is None:
            return None
        return max(0.0, self.first_token_time - self.scheduled_time)

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def time_per_output_token(self) -> float | None:
        """Decode time per token after the first, of each sequence (not of all n sequences' tokens
        together, which would divide one sequence's time by n times its tokens)."""
        if self.decode_steps_per_sequence is not None and self.decode_seconds_per_sequence is not None:
            if self.decode_steps_per_sequence <= 0:
                return None
            return self.decode_seconds_per_sequence / self.decode_steps_per_sequence
        if self.decode_time is None or self.num_generation_tokens <= 1:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)

    @property
    def inference_time(self) -> float | None:
        if self.scheduled_time is None or self.last_token_time is None:
            return None
        return max(0.0, self.last_token_time - self.scheduled_time)


class RequestSink:
    """What a consumer of request events may implement (every method is optional)."""

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None: ...

    def on_tokens(self, num_tokens: int, since_previous: float | None) -> None: ...

    def on_request_tokens(self, request_id: str, num_tokens: int) -> None: ...

    def on_iteration_tokens(self, counts: list[int]) -> None: ...

    def on_finished(self, r: FinishedRequest) -> None: ...

    def on_aborted(self, request_id: str) -> None: ...


_EVENTS = tuple(name for name in vars(RequestSink) if name.startswith("on_"))


@dataclass
class _Seq:
    """One sequence of a request (n > 1 has several): its first and latest token times and count."""

    first_token_time: float
    last_token_time: float
    num_tokens: int


@dataclass
class _Live:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    seqs: dict[int, _Seq] = field(default_factory=dict)


class RequestTracker:
    """Per-request state between the first output and the end; bounded by the requests in flight."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = sinks  # fixed here: each event's handlers are looked up once
        self._live: dict[str, _Live] = {}
        # Per event, the sinks' bound methods, without RequestSink's empty defaults: some events
        # come for every token of every stream, so a lookup or a call that does nothing costs.
        self._handlers: dict[str, list[Callable[..., None]]] = {}
        for name in _EVENTS:
            fns = []
            for sink in sinks:
                fn = getattr(sink, name, None)
                if fn is not None and getattr(type(sink), name, None) is not getattr(RequestSink, name):
                    fns.append(fn)
            self._handlers[name] = fns

    def attach(self, engine: Any) -> None:
        engine.output_listeners.append(self.on_output)
        engine.abort_listeners.append(self.on_abort)

    def _emit(self, method: str, *args: Any) -> None:
        for fn in self._handlers[method]:
            try:
                fn(*args)
            except Exception:
                logger.exception("request sink %s.%s failed", type(getattr(fn, "__self__", fn)).__name__, method)

    def on_output(self, msg: EngineCoreOutputs, results: list[RequestOutput]) -> None:
        if msg.iteration_tokens:
            self._emit("on_iteration_tokens", msg.iteration_tokens)
        if not results:
            return
        now = time.time()
        for res in results:
            live = self._live.get(res.request_id)
            if live is None:
                arrival = res.metrics.get("arrival_time") or now
                live = _Live(arrival, len(res.prompt_token_ids), res.metrics.get("max_tokens"))
                self._live[res.request_id] = live
            n_new = sum(len(o.token_ids) for o in res.outputs)
            if n_new:
                self._emit("on_request_tokens", res.request_id, n_new)
                if live.first_token_time is None:
                    live.first_token_time = now
                    self._emit("on_first_token", now - live.arrival_time, live.num_prompt_tokens)
                # Inter-token latency is per sequence: with n > 1, the time since this sequence's
                # previous token (not since a sibling's).
                for o in res.outputs:
                    k = len(o.token_ids)
                    if not k:
                        continue
                    seq = live.seqs.get(o.index)
                    if seq is None:
                        live.seqs[o.index] = _Seq(now, now, k)
                        self._emit("on_tokens", k, None)
                    else:
                        self._emit("on_tokens", k, now - seq.last_token_time)
                        seq.last_token_time = now
                        seq.num_tokens += k
                live.last_token_time = now
                live.num_generation_tokens += n_new
            if res.finished:
                del self._live[res.request_id]
                reasons = [o.finish_reason for o in res.outputs if o.finish_reason]
                m = res.metrics
                self._emit(
                    "on_finished",
                    FinishedRequest(
                        request_id=res.request_id,
                        finish_reason=reasons[0] if reasons else "stop",
                        arrival_time=live.arrival_time,
                        finished_time=now,
                        num_prompt_tokens=live.num_prompt_tokens,
                        num_generation_tokens=live.num_generation_tokens,
                        num_cached_tokens=res.num_cached_tokens,
                        max_tokens=live.max_tokens,
                        queued_time=m.get("queued_time"),
                        scheduled_time=m.get("scheduled_time"),
                        first_token_time=live.first_token_time,
                        last_token_time=live.last_token_time,
                        decode_seconds_per_sequence=sum(
                            q.last_token_time - q.first_token_time for q in live.seqs.values()
                        ),
                        decode_steps_per_sequence=sum(q.num_tokens - 1 for q in live.seqs.values()),
                        num_sequences=max(len(res.outputs), 1),
                        max_sequence_tokens=max((q.num_tokens for q in live.seqs.values()), default=0),
                        weight_version=res.weight_version,
                    ),
                )

    def on_abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._emit("on_aborted", request_id)


class RequestLogger(RequestSink):
    """One line per finished or aborted request, carrying its id (INFO when enabled, else DEBUG)."""

    def __init__(self, enabled: bool) -> None:
        self.level = logging.INFO if enabled else logging.DEBUG

    def on_finished(self, r: FinishedRequest) -> None:
        if not logger.isEnabledFor(self.level):
            return
        ttft = r.ttft
        logger.log(
            self.level,
            "finished: reason=%s prompt_tokens=%d cached_tokens=%d generation_tokens=%d ttft=%s e2e=%.3fs "
            "weight_version=%s",
            r.finish_reason, r.num_prompt_tokens, r.num_cached_tokens, r.num_generation_tokens,
            "-" if ttft is None else f"{ttft:.3f}s", r.e2e_latency, r.weight_version or "-",
            extra={"request_id": r.request_id},
        )

    def on_aborted(self, request_id: str) -> None:
        logger.log(self.level, "aborted before finishing", extra={"request_id": request_id})
