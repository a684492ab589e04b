"""When the memory of free KV blocks goes back to the OS: a recent-peak rule over the block pool.

The pool hands out reusable blocks before untouched ones (`block_pool`), so the blocks ever written
are about the peak number in use. After a burst that peak stays resident although the traffic that
needed it is gone. `WorkingSetTrimmer` keeps the peak of blocks in use over the last few windows and,
once per window, releases the reusable blocks beyond it (those free longest first): steady traffic
keeps its blocks warm (no page faults), while memory taken by a burst is given back within
`window_s * num_windows` seconds of the burst's end, and all of it on an idle engine.

Cached prefix blocks beyond the pool's `max_cached_free_blocks` are evicted first (at a window's
end, so a preempted request's blocks live on between its steps); those within it are kept: their
content is what the prefix cache is for. The trimmer only chooses block ids;
the execution layer, which owns the memory, gives their pages back.
"""

from __future__ import annotations

from collections import deque

from pagoda.kv.block_pool import BlockPool


class WorkingSetTrimmer:
    def __init__(self, pool: BlockPool, window_s: float = 10.0, num_windows: int = 6, now: float = 0.0) -> None:
        if window_s <= 0 or num_windows < 1:
            raise ValueError(f"need window_s > 0 and num_windows >= 1, got {window_s}, {num_windows}")
        self.pool = pool
        self.window_s = window_s
        self._peaks: deque[int] = deque(maxlen=num_windows)  # the peaks of the windows before this one
        self._window_start = now
        self._peak = 0  # this window's
        self.num_released = 0

    def _in_use(self) -> int:
        return self.pool.num_usable_blocks - self.pool.get_num_free_blocks()

    def observe(self) -> None:
        """Note the blocks in use now (call once per step; O(1))."""
        in_use = self._in_use()
        if in_use > self._peak:
            self._peak = in_use

    def blocks_to_release(self, now: float) -> list[int]:
        """At a window's end: the ids of reusable blocks beyond the recent peak, taken out of the
        pool's reusable blocks (the caller must give their memory back). [] otherwise."""
        self.observe()
        if now - self._window_start < self.window_s:
            return []
        # Windows that passed with no call (an idle engine) had no blocks in use beyond now's.
        elapsed = int((now - self._window_start) // self.window_s)
        self._peaks.append(self._peak)
        for _ in range(min(elapsed - 1, self._peaks.maxlen or 0)):
            self._peaks.append(self._in_use())
        self._window_start += elapsed * self.window_s
        self._peak = self._in_use()
        self.pool.evict_cached_beyond_cap()
        recent_peak = max(max(self._peaks), self._peak)
        excess = self._in_use() + self.pool.num_reusable_blocks - recent_peak
        if excess <= 0:
            return []
        released = self.pool.release_reusable(excess)
        self.num_released += len(released)
        return released
