"""KV cache sizing on the CPU: how many bytes the pool gets, and how much of it the prefix cache may
keep resident while free.

The pool is a lazily zeroed mapping (`cpu_memory.lazy_zeros`): its size is address space, and what
becomes resident follows the blocks written, which the block pool keeps close to what is in use
(`pagoda.kv.block_pool`). So the default can be generous, but not beyond what could ever be used
(every sequence at the longest length) nor beyond what the machine could hold (a quarter of its
memory). vLLM's `VLLM_CPU_KVCACHE_SPACE` (GiB) and an explicit `kv_cache_memory` win over it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 * 1024**3
# The prefix cache may keep this share of the pool's blocks resident while no request holds them;
# beyond it the least recently used one is evicted rather than fresh memory touched. An eighth keeps
# a 2 GiB pool's cached prefixes within 256 MiB and still holds thousands of tokens of prompts.
CACHED_FREE_SHARE = 8


def mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_kv_budget(
    bytes_per_token: int,
    max_num_seqs: int,
    max_model_len: int,
    env: Mapping[str, str] = os.environ,
    mem_total: int | None = None,
) -> tuple[int, str]:
    """(bytes, where the figure came from) for a CPU KV pool when `kv_cache_memory` is unset."""
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if space:
        try:
            gib = float(space)
        except ValueError:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
        if gib > 0:  # 0 means "choose for me", as in vLLM
            return int(gib * 1024**3), "VLLM_CPU_KVCACHE_SPACE"
    budget, why = DEFAULT_CPU_KV_BYTES, "default"
    need = bytes_per_token * max_num_seqs * max_model_len
    if need < budget:
        budget, why = need, "max_num_seqs x max_model_len"
    mem = mem_total if mem_total is not None else mem_total_bytes()
    if mem is not None and mem // 4 < budget:
        # Never below one longest sequence: a smaller pool could not run a full-length request.
        budget, why = max(mem // 4, bytes_per_token * max_model_len), "a quarter of the machine's memory"
    return budget, why


def max_cached_free_blocks(num_blocks: int) -> int:
    return max(num_blocks // CACHED_FREE_SHARE, 1)
