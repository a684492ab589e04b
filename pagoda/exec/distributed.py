"""Bringing the ranks of a distributed executor together: the torch.distributed process group
(gloo on the CPU, NCCL on CUDA) with a bounded rendezvous, and the TP group the model layers use.

The rendezvous is a TCPStore hosted by rank 0 at `init_method` (tcp://host:port). torch waits for
all ranks up to `timeout_s` and then raises a long, internal-looking error; here that becomes one
`DistributedInitError` line naming the rank, the world and the executor backend, because a start
that hangs or fails obscurely is the commonest report about multi-process engines.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch

from pagoda.errors import DistributedInitError
from pagoda.model.pipeline import PPStage
from pagoda.model.tensor_parallel import TPGroup

logger = logging.getLogger(__name__)

DEFAULT_INIT_TIMEOUT_S = 120.0


def init_timeout_s() -> float:
    """The rendezvous limit: PAGODA_DIST_INIT_TIMEOUT_S, default 120 s (it covers the slowest
    rank's start: imports, not weights, which load after everyone has met)."""
    raw = os.environ.get("PAGODA_DIST_INIT_TIMEOUT_S")
    try:
        return float(raw) if raw else DEFAULT_INIT_TIMEOUT_S
    except ValueError:
        raise DistributedInitError(f"PAGODA_DIST_INIT_TIMEOUT_S must be a number of seconds, got {raw!r}") from None


def init_distributed(rank: int, world_size: int, init_method: str, executor_backend: str, timeout_s: float,
                     device: torch.device, tp_size: int | None = None) -> tuple[TPGroup, PPStage]:
    """Join the process group; raise DistributedInitError when the others do not arrive within
    `timeout_s`. Ranks are laid out stage by stage: rank = stage * tp_size + TP rank."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    where = f"rank {rank} of {world_size} ({executor_backend} backend, torch.distributed {backend} at {init_method})"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        # The store-based barrier in init_process_group only proves each rank reached the store; a
        # first collective proves the group's connections work too, while still inside the limit.
        dist.barrier()
    except Exception as exc:  # DistStoreError, RuntimeError (connect refused, timed out), ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedInitError(
            f"{where}: the ranks did not meet within {timeout_s:g} s ({type(exc).__name__}: {first})"
        ) from None
    logger.info("%s: joined", where)
    tp_size = tp_size or world_size
    stages = world_size // tp_size
    group = None  # one stage: the TP group is the whole world
    if stages > 1:
        # Every rank creates every stage's group, in the same order (torch.distributed requires it).
        for stage in range(stages):
            g = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == rank // tp_size:
                group = g
    fast = None
    if executor_backend == "mp" and device.type == "cpu" and tp_size > 1 and cpu_all_reduce() == "shm":
        fast = _shm_all_reduce(init_method, rank, tp_size)
    tp = TPGroup(rank=rank % tp_size, size=tp_size, group=group, fast_all_reduce=fast,
                 fast_all_gather=fast.all_gather_last if fast is not None else None)
    return tp, PPStage(stage=rank // tp_size, size=stages, rank=rank, tp_size=tp_size)


def cpu_all_reduce() -> str:
    """PAGODA_CPU_ALLREDUCE: shm (default: shared memory between the mp ranks of one machine) or gloo."""
    value = os.environ.get("PAGODA_CPU_ALLREDUCE", "shm")
    if value not in ("shm", "gloo"):
        raise DistributedInitError(f"PAGODA_CPU_ALLREDUCE must be shm or gloo, got {value!r}")
    return value


_SHM_SLOT_BYTES = 16 * 2**20  # a 2,048-token step of hidden size 2,048 in float32; larger: gloo


def _shm_all_reduce(init_method: str, rank: int, tp_size: int):
    """Each TP group's shared-memory all-reduce; the file is named by the rendezvous (unique per
    start) and the stage, and unlinked once every rank has mapped it."""
    import torch.distributed as dist

    from pagoda.exec.shm_allreduce import ShmAllReduce

    tag = init_method.rsplit(":", 1)[-1]
    path = f"/dev/shm/pagoda-allreduce-{os.getppid()}-{tag}-{rank // tp_size}"
    creator = rank % tp_size == 0
    reducer = ShmAllReduce(path, rank % tp_size, tp_size, _SHM_SLOT_BYTES, create=True) if creator else None
    dist.barrier()
    if not creator:
        reducer = ShmAllReduce(path, rank % tp_size, tp_size, _SHM_SLOT_BYTES, create=False)
    dist.barrier()
    if creator:
        os.unlink(path)
    return reducer


def close_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
