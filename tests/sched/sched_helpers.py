"""Helpers for scheduler tests: a scheduler over a fake KV pool and hand-made sampled tokens."""

from __future__ import annotations

from pagoda.contracts.step import SchedulerOutput
from pagoda.kv import KVCacheManager
from pagoda.sampling_params import SamplingParams
from pagoda.sched import Request, Scheduler, SchedulerConfig


def make_scheduler(num_blocks: int = 64, block_size: int = 4, caching: bool = True, **config):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**config), kv), kv


def make_request(
    rid: str,
    prompt: int | list[int],
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival: float | None = None,
    eos: int | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        # Distinct per request id, so requests only share blocks when a test says so.
        base = sum(map(ord, rid)) * 1000
        prompt = [base + i for i in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, prompt, sp, eos_token_id=eos, arrival_time=arrival, priority=priority)


def step(sched: Scheduler, tokens: dict[str, list[int]] | None = None, token: int = 7):
    """One engine iteration. Every scheduled request gets `token` (or tokens[rid]), including
    mid-prompt ones, whose token the scheduler must throw away."""
    out = sched.schedule()
    sampled = {s.request_id: [token] for s in out.scheduled}
    sampled.update(tokens or {})
    changed = sched.update(out, sampled)
    return out, changed


def split(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]
