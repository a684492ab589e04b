"""Layer 4, scheduling: continuous batching under a token budget, chunked prefill, preemption, priorities."""

from pagoda.sched.config import SchedulerConfig
from pagoda.sched.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from pagoda.sched.request import FINISH_REASONS, Request, RequestStatus
from pagoda.sched.scheduler import Scheduler

__all__ = [
    "FINISH_REASONS",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
