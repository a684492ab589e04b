"""An all-reduce (and the logits' all-gather) through shared memory, for the tensor-parallel ranks of one machine on the CPU.

gloo's all-reduce goes through TCP loopback sockets and its own threads: for the small tensors of
a decode step ([batch, hidden], a few KiB, twice per layer) its fixed cost dominates. Here every
rank of the group maps one /dev/shm file: it copies its tensor into its slot, publishes a sequence
number, waits until every rank has published the same one, and sums the slots in rank order, so
that every rank computes bit-identical results (the ranks must keep sampling the same tokens).

Two sets of slots alternate by sequence number. A rank writes set s % 2 only after it has seen
every rank publish s - 1, that is after every rank has finished reading set (s - 2) % 2: no slot is
overwritten while someone still reads it. x86's ordered stores make "data, then flag" visible in
that order. Tensors larger than a slot fall back to torch.distributed.
"""

from __future__ import annotations

import os

import torch

_FLAG_STRIDE = 8  # int64s between two ranks' flags: one 64-byte cache line each
_SPINS_BEFORE_YIELD = 64
_SPINS_BETWEEN_PARENT_CHECKS = 1 << 16


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, create: bool) -> None:
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.parent_pid = os.getppid()
        header = world * _FLAG_STRIDE * 8
        total = header + 2 * world * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        storage = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.flags = storage[:header].view(torch.int64)
        self.slots = storage[header:].view(2, world, slot_bytes)
        self.seq = 0

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (views of the slots, valid until the call after next); None when `x`
        does not fit a slot."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            return None
        self.seq += 1
        seq, flags = self.seq, self.flags
        slots = self.slots[seq % 2, :, :nbytes]
        slots[self.rank].view(x.dtype).view(x.shape).copy_(x)
        flags[self.rank * _FLAG_STRIDE] = seq
        for r in range(self.world):
            spins = 0
            while int(flags[r * _FLAG_STRIDE]) < seq:
                spins += 1
                if spins > _SPINS_BEFORE_YIELD:
                    os.sched_yield()  # ranks may share cores: let the late one run
                if spins % _SPINS_BETWEEN_PARENT_CHECKS == 0 and os.getppid() != self.parent_pid:
                    # A peer that died is the executor's to notice (it stops us); with the executor
                    # gone too, nobody would: leave rather than wait forever.
                    raise RuntimeError("the engine process is gone while waiting for a peer rank")
        return [slots[r].view(x.dtype).view(x.shape) for r in range(self.world)]

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dimension, in rank order; None: too big."""
        parts = self._exchange(x.contiguous())
        return None if parts is None else torch.cat(parts, dim=-1)

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks, in place; False (nothing done) when it does not fit a slot."""
        if not x.is_contiguous():
            return False
        parts = self._exchange(x)
        if parts is None:
            return False
        if x.dtype == torch.float32:
            torch.add(parts[0], parts[1], out=x)
            for p in parts[2:]:
                x.add_(p)
        else:  # accumulate in float32, round once
            acc = parts[0].float()
            for p in parts[1:]:
                acc.add_(p)
            x.copy_(acc)
        return True
