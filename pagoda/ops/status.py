"""The periodic one-line engine status (throughput, running, waiting, KV usage, prefix-cache hit
rate, and the draft acceptance rate while speculative decoding drafts), logged every `interval` seconds while there is work, and silent while the engine is idle."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from pagoda.contracts.messages import EngineCoreStats
from pagoda.ops.metrics import ServerMetrics

logger = logging.getLogger("pagoda.status")


class StatusLine:
    """Computes the line from the metrics' running totals and the core's latest stats."""

    def __init__(self, metrics: ServerMetrics, latest_stats: Callable[[], EngineCoreStats | None]) -> None:
        self.metrics = metrics
        self.latest_stats = latest_stats
        self._last_time = time.monotonic()
        self._last_prompt = metrics.total_prompt_tokens
        self._last_generation = metrics.total_generation_tokens
        s = latest_stats() or EngineCoreStats()
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._last_drafted, self._last_accepted = s.spec_num_draft_tokens, s.spec_num_accepted_tokens

    def tick(self, now: float | None = None) -> str | None:
        """The line for the interval since the previous tick, or None when nothing happened in it
        and nothing is running or waiting."""
        now = time.monotonic() if now is None else now
        m = self.metrics
        s = self.latest_stats() or EngineCoreStats()
        elapsed = max(now - self._last_time, 1e-9)
        prompt = m.total_prompt_tokens - self._last_prompt
        generation = m.total_generation_tokens - self._last_generation
        queries = s.prefix_cache_queries - self._last_queries
        hits = s.prefix_cache_hits - self._last_hits
        self._last_time = now
        self._last_prompt, self._last_generation = m.total_prompt_tokens, m.total_generation_tokens
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        drafted = s.spec_num_draft_tokens - self._last_drafted
        accepted = s.spec_num_accepted_tokens - self._last_accepted
        self._last_drafted, self._last_accepted = s.spec_num_draft_tokens, s.spec_num_accepted_tokens
        if not (prompt or generation or s.num_running or s.num_waiting):
            return None
        hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
        return (
            f"prompt throughput: {prompt / elapsed:.1f} tokens/s, generation throughput: "
            f"{generation / elapsed:.1f} tokens/s, running: {s.num_running} reqs, waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100 * s.kv_usage:.1f}%, prefix cache hit rate: {hit_rate}"
            + (f", draft acceptance rate: {100 * accepted / drafted:.1f}%" if drafted else "")
        )


async def log_status_forever(line: StatusLine, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        text = line.tick()
        if text is not None:
            logger.info("%s", text)
