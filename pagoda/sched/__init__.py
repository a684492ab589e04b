"""Layer 4, scheduling: continuous batching under a token budget, chunked prefill, preemption, priorities.

What a step decided is plain data in `pagoda.contracts.step`, for the execution layer.
"""

from pagoda.sched.config import SchedulerConfig
from pagoda.sched.request import FINISH_REASONS, Request, RequestStatus, StopConditions
from pagoda.sched.scheduler import Scheduler

__all__ = [
    "FINISH_REASONS",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "StopConditions",
]
