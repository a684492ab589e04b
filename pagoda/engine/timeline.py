"""Per-request timelines, recorded in the engine core: arrival, each admission (with its prefix-cache
hit), each prefill chunk with its token count, decode runs, preemptions and the finish.

A user reads them through `GET /v1/requests/{id}/timeline` to see why a request was slow. Decode
steps are not recorded one by one: a run of decode steps becomes one entry when it ends (at a
preemption or the finish), so a long generation costs a few entries, not one per token. Timelines
of finished requests are kept in a bounded most-recent-first store.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from pagoda.contracts.step import SchedulerOutput

DEFAULT_MAX_FINISHED = 1000


class RequestTimeline:
    __slots__ = (
        "request_id", "arrival_time", "events", "first_scheduled", "decode_start", "decode_start_tokens", "status",
    )

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time  # entered the core (core clock), for queue-time metrics
        self.events: list[dict[str, Any]] = [{"event": "arrived", "time": arrival_time}]
        self.first_scheduled: float | None = None  # first admission, for queue-time metrics
        self.decode_start: float | None = None  # an open decode run: when it began
        self.decode_start_tokens = 0  # and how many output tokens existed then
        self.status = "waiting"

    def admitted(self, now: float, cached_tokens: int, resumed: bool, blocks_from: dict | None = None) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = now
        self.status = "running"
        event = {"event": "admitted", "time": now, "cached_tokens": cached_tokens, "resumed": resumed}
        if blocks_from is not None:
            event["blocks_from"] = blocks_from  # tier -> [first, end) of its blocks in the table
        self.events.append(event)

    def prefill_chunk(self, now: float, start: int, num_tokens: int) -> None:
        self.events.append({"event": "prefill", "time": now, "start": start, "tokens": num_tokens})

    def token(self, now: float, num_output_tokens: int, num_new: int) -> None:
        """A step gave the request `num_new` tokens; the first one after an admission opens a decode run."""
        if self.decode_start is None:
            if num_output_tokens == num_new:
                self.events.append({"event": "first_token", "time": now})
            self.decode_start = now
            self.decode_start_tokens = num_output_tokens

    def _close_decode(self, now: float, num_output_tokens: int) -> None:
        if self.decode_start is None:
            return
        steps = num_output_tokens - self.decode_start_tokens
        if steps > 0:
            self.events.append({"event": "decode", "start": self.decode_start, "end": now, "tokens": steps})
        self.decode_start = None

    def preempted(self, now: float, num_output_tokens: int) -> None:
        self._close_decode(now, num_output_tokens)
        self.status = "preempted"
        self.events.append({"event": "preempted", "time": now, "output_tokens": num_output_tokens})

    def finished(self, now: float, reason: str | None, num_output_tokens: int) -> None:
        self._close_decode(now, num_output_tokens)
        self.status = "finished"
        self.events.append({"event": "finished", "time": now, "reason": reason, "output_tokens": num_output_tokens})

    def to_dict(self) -> dict[str, Any]:
        events = list(self.events)
        if self.decode_start is not None:  # still decoding: show the run so far
            events.append({"event": "decode", "start": self.decode_start, "end": None, "tokens": None})
        return {
            "request_id": self.request_id,
            "status": self.status,
            "arrival_time": self.arrival_time,
            "num_admissions": sum(1 for e in events if e["event"] == "admitted"),
            "num_preemptions": sum(1 for e in events if e["event"] == "preempted"),
            "events": events,
        }


class TimelineStore:
    """Live timelines by core request id, and the last `max_finished` finished ones."""

    def __init__(self, max_finished: int = DEFAULT_MAX_FINISHED) -> None:
        self.max_finished = max_finished
        self.live: dict[str, RequestTimeline] = {}
        self.finished: OrderedDict[str, RequestTimeline] = OrderedDict()

    def start(self, request_id: str, arrival_time: float) -> RequestTimeline:
        tl = RequestTimeline(request_id, arrival_time)
        self.live[request_id] = tl
        self.finished.pop(request_id, None)  # an id reused after it finished starts afresh
        return tl

    def end(self, request_id: str, now: float, reason: str | None, num_output_tokens: int) -> None:
        tl = self.live.pop(request_id, None)
        if tl is None:
            return
        tl.finished(now, reason, num_output_tokens)
        if self.max_finished <= 0:
            return
        self.finished[request_id] = tl
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)

    def record_step(self, so: SchedulerOutput, requests: dict, now: float,
                    blocks_from: dict[str, dict[str, list[int]]]) -> None:
        """Entries of one step: admissions (with the tiers their cached blocks came from), prefill
        chunks (not decodes) and preemptions. `requests`: the scheduler's, by id."""
        timelines = self.live
        for s in so.scheduled:
            is_new = s.is_new
            if is_new:
                resumed = requests[s.request_id].num_preemptions > 0
                timelines[s.request_id].admitted(now, s.num_computed_tokens, resumed, blocks_from.get(s.request_id))
            if is_new or s.num_new_tokens - len(s.spec_token_ids) != 1 or s.num_computed_tokens + 1 < s.num_tokens:
                timelines[s.request_id].prefill_chunk(now, s.num_computed_tokens, s.num_new_tokens)
        for rid in so.preempted_request_ids:
            timelines[rid].preempted(now, requests[rid].num_output_tokens)

    def get(self, request_id: str) -> RequestTimeline | None:
        return self.live.get(request_id) or self.finished.get(request_id)

    def lookup(self, request_id: str) -> list[dict[str, Any]]:
        """Timelines of `request_id`, or of its parts when it has several: the n > 1 sequences
        (`request_id#i`) or the prompts of a batched completion (`request_id-i`)."""
        tl = self.get(request_id)
        if tl is not None:
            return [tl.to_dict()]
        # Exactly `id-P`, `id#S` or `id-P#S`: a prefix match would make `cmpl` every `cmpl-...` request.
        part = re.compile(re.escape(request_id) + r"(?:-(\d+))?(?:#(\d+))?")
        found = []
        for store in (self.live, self.finished):
            for rid, t in store.items():
                m = part.fullmatch(rid) if rid.startswith(request_id) else None
                if m is not None and (m.group(1) or m.group(2)):
                    found.append(((int(m.group(1) or -1), int(m.group(2) or -1)), t))
        return [t.to_dict() for _, t in sorted(found, key=lambda kv: kv[0])]  # prompt 2 before prompt 10
