"""Wiring the second KV tier: its slots in the KV layer, its memory and copies in the execution
layer, and, for the disk tier, the blocks a previous run left on disk.

`--kv-offloading-size` GiB become slots of one block each; `--kv-offloading-backend` picks host
memory (`cpu`) or files (`disk`, under `--kv-offloading-dir`). A disk tier's folder is keyed by the
model's weights and the cache settings that shape a block, so a restart with the same ones finds its
blocks again and any other configuration never reads them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pagoda.config import EngineArgs
from pagoda.contracts.step import SchedulerStats
from pagoda.exec.kv_offload import HostTierStorage, KVOffloader, TierStorage, block_bytes, block_shape
from pagoda.exec.kv_offload_disk import DiskTierStorage, cache_key, weights_fingerprint
from pagoda.exec.paged_attention import PagedKVCache
from pagoda.kv.manager import KVCacheManager
from pagoda.kv.offload import SecondTier
from pagoda.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


def second_tier(args: EngineArgs, bytes_per_block: int) -> SecondTier | None:
    """The KV layer's view of the tier (its slots), or None without `--kv-offloading-size`."""
    if args.kv_offloading_size is None:
        return None
    if not args.enable_prefix_caching and args.preemption_mode != "swap":
        raise ValueError("kv_offloading_size keeps evicted prefix blocks, so it needs prefix caching "
                         "(or --preemption-mode swap)")
    num_slots = int(args.kv_offloading_size * 2**30) // bytes_per_block
    if num_slots < 1:
        raise ValueError(f"kv_offloading_size {args.kv_offloading_size} GiB holds no KV block of "
                         f"{bytes_per_block} bytes")
    return SecondTier(num_slots, args.kv_offloading_backend)


def default_offload_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pagoda" / "kv"


def attach_offloader(args: EngineArgs, model_path: Path, kv_cache: PagedKVCache, kv: KVCacheManager,
                     hasher_name: str) -> KVOffloader:
    """The tier's memory for this cache; a disk tier's surviving blocks become ready entries."""
    tier = kv.tier.tier
    shape, dtype = block_shape(kv_cache), kv_cache.tensor.dtype
    storage: TierStorage
    if args.kv_offloading_backend == "disk":
        key = cache_key(weights_fingerprint(model_path), dtype=str(dtype), block_shape=shape, hasher=hasher_name)
        root = Path(args.kv_offloading_dir) if args.kv_offloading_dir else default_offload_dir()
        disk = DiskTierStorage(root, key, tier.num_slots, shape, dtype)
        found = disk.scan()
        newest: dict[int, int] = {}
        for slot, block_hash in found:
            newest[block_hash] = slot  # a block written twice: the later file wins
        for slot, block_hash in found:
            if newest[block_hash] == slot:
                tier.restore(block_hash, slot)
        logger.info("KV disk tier %s: %d slots, %d blocks found from an earlier run", disk.folder,
                    tier.num_slots, len(newest))
        storage = disk
    else:
        pin = kv_cache.tensor.device.type == "cuda"
        storage = HostTierStorage(tier.num_slots, shape, dtype, pin)
    logger.info("KV offloading: %s tier of %d blocks (%.2f GiB)", args.kv_offloading_backend, tier.num_slots,
                tier.num_slots * block_bytes(kv_cache) / 2**30)
    return KVOffloader(kv_cache, storage)


def check_offload_config(args: EngineArgs, backend: str) -> None:
    if args.kv_offloading_size is not None and backend != "uni":
        raise ValueError(f"kv_offloading_size works in one process only (--distributed-executor-backend uni), "
                         f"not with {backend!r}")


def tier_sources(kv: KVCacheManager) -> dict[str, dict[str, list[int]]]:
    """request id -> which of its blocks (index ranges in its table) came from which tier at its last
    admission (the second tier named by its backend); taken once, by the timeline."""
    sources, kv.admission_sources = kv.admission_sources, {}
    tier_name = kv.tier.tier.name if kv.tier is not None else None
    out = {}
    for rid, (first, second) in sources.items():
        entry = {"device": [0, first]}
        if tier_name is not None:
            entry[tier_name] = [first, first + second]
        out[rid] = entry
    return out



def offload_stats(s: SchedulerStats, bytes_per_block: int) -> dict[str, int]:
    """The second tier's counters for `EngineCoreStats` (bytes moved from the block counts)."""
    return dict(kv_offload_queries=s.kv_offload_queries, kv_offload_hits=s.kv_offload_hits,
                kv_offload_bytes_saved=s.kv_offload_saved_blocks * bytes_per_block,
                kv_offload_bytes_loaded=s.kv_offload_loaded_blocks * bytes_per_block,
                num_swaps_out=s.num_swaps_out, num_swaps_in=s.num_swaps_in)


class SwapCostMeter:
    """Measures what swap preemption weighs: the seconds to copy one block between the tiers (the
    offloader's copies before the forward) and to compute one token (steps of many tokens, which
    prefill dominates), and hands both to the scheduler, which swaps a victim out only when moving
    its blocks out and back costs less than computing its context again."""

    DECAY = 0.8

    def __init__(self, scheduler: Scheduler, offloader: KVOffloader | None) -> None:
        self.scheduler = scheduler
        self.offloader = offloader
        self.seconds_per_token: float | None = None

    def observe(self, num_tokens: int, num_rows: int, seconds: float) -> None:
        if num_tokens >= 4 * num_rows:  # mostly prefill: decode steps' time per token says little about it
            per_token = seconds / num_tokens
            old = self.seconds_per_token
            self.seconds_per_token = per_token if old is None else self.DECAY * old + (1 - self.DECAY) * per_token
        per_block = self.offloader.seconds_per_block if self.offloader is not None else None
        if per_block is not None and self.seconds_per_token is not None:
            self.scheduler.swap_costs = (per_block, self.seconds_per_token)
