"""The most recent requests, for the dashboard: every live request and the last finished ones, each
with its tenant, status, token counts and latencies, newest first.

Fed like the metrics: the service layer says when a request starts and for which tenant, and the
request tracker reports its tokens and its end. Bounded: live requests are bounded by what is in
flight, finished ones by `max_finished`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from pagoda.ops.request_events import FinishedRequest, RequestSink

DEFAULT_MAX_FINISHED = 50


@dataclass
class RequestRow:
    request_id: str
    tenant: str | None
    arrival_time: float
    status: str = "waiting"  # waiting (no token yet), running, finished, aborted
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: float | None = None  # seconds
    e2e: float | None = None  # seconds, once ended
    finish_reason: str | None = None


class RecentRequests(RequestSink):
    def __init__(self, max_finished: int = DEFAULT_MAX_FINISHED, clock=time.time) -> None:
        self.max_finished = max_finished
        self.clock = clock
        self._rows: OrderedDict[str, RequestRow] = OrderedDict()  # oldest first
        self._num_ended = 0

    def _row(self, request_id: str) -> RequestRow:
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = RequestRow(request_id, None, self.clock())
        return row

    def on_request_started(self, request_id: str, tenant: str, num_prompt_tokens: int) -> None:
        old = self._rows.pop(request_id, None)  # an id reused after it ended starts afresh
        if old is not None and old.status in ("finished", "aborted"):
            self._num_ended -= 1
        self._rows[request_id] = RequestRow(request_id, tenant, self.clock(), prompt_tokens=num_prompt_tokens)

    def on_request_tokens(self, request_id: str, num_tokens: int) -> None:
        row = self._row(request_id)
        if row.status == "waiting":
            row.status = "running"
            row.ttft = self.clock() - row.arrival_time
        row.generation_tokens += num_tokens

    def _end(self, row: RequestRow, status: str) -> None:
        if row.status not in ("finished", "aborted"):
            self._num_ended += 1
        row.status = status
        while self._num_ended > self.max_finished:
            oldest = next(rid for rid, r in self._rows.items() if r.status in ("finished", "aborted"))
            del self._rows[oldest]
            self._num_ended -= 1

    def on_finished(self, r: FinishedRequest) -> None:
        row = self._row(r.request_id)
        row.prompt_tokens = r.num_prompt_tokens
        row.generation_tokens = r.num_generation_tokens
        row.ttft = r.ttft
        row.e2e = r.e2e_latency
        row.finish_reason = r.finish_reason
        self._end(row, "finished")

    def on_aborted(self, request_id: str) -> None:
        row = self._rows.get(request_id)
        if row is None:
            return
        row.e2e = self.clock() - row.arrival_time
        row.finish_reason = "abort"
        self._end(row, "aborted")

    def rows(self, limit: int | None = None) -> list[dict]:
        """Newest first, as plain dicts."""
        out = [asdict(r) for r in reversed(self._rows.values())]
        return out if limit is None else out[:limit]
