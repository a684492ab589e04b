"""Waiting queues: the order in which waiting (new or preempted) requests are admitted."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Container, Iterator

from pagoda.sched.request import Request


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove_all(self, request_ids: Container[str]) -> None:
        self._q = deque(r for r in self._q if r.request_id not in request_ids)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest priority value first, then earliest arrival, then insertion order.

    A preempted request goes back under its own key: it is ahead of every later arrival of the
    same priority, but never ahead of a more urgent request.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_all(self, request_ids: Container[str]) -> None:
        self._heap = [e for e in self._heap if e[3].request_id not in request_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order (sorts a copy: for tests and stats, not the hot path)."""
        return (e[3] for e in sorted(self._heap))


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
