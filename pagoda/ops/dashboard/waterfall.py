"""A request's timeline (`pagoda.engine.timeline`, as the engine core reports it) as waterfall
segments: waiting in the queue, each prefill chunk, each decode run, each wait after a preemption,
and the finish, in seconds from the request's arrival.

A prefill chunk's entry says when its step was scheduled; it lasts until the request's next entry
(the next chunk, the first token, a preemption). A segment still open (a live request) ends `now`.
"""

from __future__ import annotations

from typing import Any


def _at(event: dict[str, Any]) -> float:
    return event["time"] if "time" in event else event["start"]


def segments(timeline: dict[str, Any], now: float) -> list[dict[str, Any]]:
    """The segments of one sequence's timeline, in order, with `start`/`end` offsets in seconds."""
    events = sorted(timeline["events"], key=_at)
    t0 = timeline["arrival_time"]
    out: list[dict[str, Any]] = []

    def add(kind: str, start: float, end: float | None, label: str, **extra: Any) -> None:
        stop = now if end is None else end
        out.append({"kind": kind, "start": start - t0, "end": max(stop, start) - t0, "open": end is None,
                    "label": label, **extra})

    def next_time(i: int, kinds: tuple[str, ...] | None = None) -> float | None:
        for later in events[i + 1:]:
            if kinds is None or later["event"] in kinds:
                return _at(later)
        return None

    for i, e in enumerate(events):
        kind = e["event"]
        if kind == "arrived":
            add("queue", e["time"], next_time(i, ("admitted", "finished")), "queued")
        elif kind == "admitted" and e.get("cached_tokens"):
            out.append({"kind": "cache_hit", "start": e["time"] - t0, "end": e["time"] - t0, "open": False,
                        "label": f"prefix-cache hit: {e['cached_tokens']} tokens", "tokens": e["cached_tokens"]})
        elif kind == "prefill":
            first, n = e["start"], e["tokens"]
            add("prefill", e["time"], next_time(i), f"prefill tokens {first}-{first + n} ({n})", tokens=n)
        elif kind == "decode":
            n = e.get("tokens")
            add("decode", e["start"], e["end"], "decoding" if n is None else f"decode {n} tokens", tokens=n)
        elif kind == "preempted":
            add("preempted", e["time"], next_time(i, ("admitted", "finished")),
                f"preempted after {e['output_tokens']} output tokens, waiting")
        elif kind == "finished":
            out.append({"kind": "finish", "start": e["time"] - t0, "end": e["time"] - t0, "open": False,
                        "label": f"finished: {e.get('reason')} ({e.get('output_tokens')} output tokens)"})
    return out


def waterfall(request_id: str, sequences: list[dict[str, Any]], now: float) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "sequences": [
            {"request_id": tl["request_id"], "status": tl["status"], "num_preemptions": tl["num_preemptions"],
             "segments": segments(tl, now)}
            for tl in sequences
        ],
    }
