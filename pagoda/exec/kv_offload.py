"""The second KV tier's memory and the copies between it and the KV cache, as the step orders them.

The KV layer (`pagoda.kv.offload`) decides which block goes to which slot; this module holds the
slots' bytes and moves them: `HostTierStorage` in host RAM (pinned when the cache is on a GPU),
`DiskTierStorage` (`kv_offload_disk.py`) as one file per slot. `KVOffloader` carries out one step's
orders in the order `contracts.step.SchedulerOutput` defines: the saves of blocks the step may
reuse and the loads before the forward, the other saves on a background thread beside it, awaited
when the step ends (their blocks are pinned by the KV layer until then).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from pagoda.contracts.step import KVTransfer, SchedulerOutput
from pagoda.exec.paged_attention import PagedKVCache

logger = logging.getLogger(__name__)


class TierStorage(Protocol):
    num_slots: int

    def save(self, slot: int, key: int, block: torch.Tensor) -> None:
        """Store one block's K/V ([layers, 2, block_size, heads, head_dim]) in `slot` under `key`."""

    def load(self, slot: int, key: int, out: torch.Tensor) -> None:
        """Copy the block stored in `slot` (under `key`) into `out`."""


def block_shape(kv_cache: PagedKVCache) -> tuple[int, ...]:
    t = kv_cache.tensor
    return (t.shape[0], t.shape[1], *t.shape[3:])


def block_bytes(kv_cache: PagedKVCache) -> int:
    t = kv_cache.tensor
    return t[:, :, 0].numel() * t.element_size()


class HostTierStorage:
    """`num_slots` blocks in host memory (pinned for a GPU cache, so copies can be asynchronous)."""

    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.num_slots = num_slots
        # Pages are faulted in as slots are written: an unused tier costs no resident memory.
        self.data = torch.empty((num_slots, *shape), dtype=dtype, pin_memory=pin)

    def save(self, slot: int, key: int, block: torch.Tensor) -> None:
        self.data[slot].copy_(block, non_blocking=block.device.type == "cuda")

    def load(self, slot: int, key: int, out: torch.Tensor) -> None:
        out.copy_(self.data[slot], non_blocking=out.device.type == "cuda")


class KVOffloader:
    """Carries out a step's copies between the KV cache and a `TierStorage`."""

    def __init__(self, kv_cache: PagedKVCache, storage: TierStorage) -> None:
        self.kv_cache = kv_cache
        self.storage = storage
        self.block_bytes = block_bytes(kv_cache)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-kv-offload")
        self._saves: Future | None = None
        self._failed: list[int] = []
        cuda = kv_cache.tensor.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv_cache.tensor.device) if cuda else None
        # Measured cost of one block copy in the step's critical path (an average that follows drift).
        self.seconds_per_block: float | None = None

    def _block(self, block_id: int) -> torch.Tensor:
        return self.kv_cache.tensor[:, :, block_id]

    def _save(self, transfers: list[KVTransfer]) -> list[int]:
        failed = []
        for t in transfers:
            try:
                self.storage.save(t.slot, t.block_hash, self._block(t.block_id))
            except OSError as exc:  # a full or failing disk: the block is simply not in the tier
                logger.warning("KV offload: cannot save block %d to slot %d (%s)", t.block_id, t.slot, exc)
                failed.append(t.slot)
        return failed

    def _save_in_background(self, transfers: list[KVTransfer]) -> list[int]:
        if self._stream is None:
            return self._save(transfers)
        with torch.cuda.stream(self._stream):
            failed = self._save(transfers)
        self._stream.synchronize()
        return failed

    def before_forward(self, so: SchedulerOutput) -> None:
        """Saves of blocks this step may reuse, then loads, then the background saves' start."""
        if self._saves is not None:
            raise RuntimeError("KV offload: a step began before the previous step's saves were awaited")
        start = time.perf_counter()
        self._failed = self._save(so.kv_saves_first) if so.kv_saves_first else []
        for t in so.kv_loads:
            self.storage.load(t.slot, t.block_hash, self._block(t.block_id))
        n = len(so.kv_saves_first) + len(so.kv_loads)
        if n:
            if self._stream is None and self.kv_cache.tensor.device.type == "cuda":
                torch.cuda.synchronize(self.kv_cache.tensor.device)
            per_block = (time.perf_counter() - start) / n
            old = self.seconds_per_block
            self.seconds_per_block = per_block if old is None else 0.8 * old + 0.2 * per_block
        if so.kv_saves:
            if self._stream is not None:
                # The copies read what earlier steps' kernels wrote on the compute stream.
                self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.tensor.device))
            self._saves = self._thread.submit(self._save_in_background, so.kv_saves)

    def after_forward(self) -> list[int]:
        """Wait for the step's background saves; the slots of those that failed."""
        failed, self._failed = self._failed, []
        if self._saves is not None:
            future, self._saves = self._saves, None
            failed += future.result()
        return failed

    def shutdown(self) -> None:
        if self._saves is not None:
            self.after_forward()
        self._thread.shutdown(wait=True)
