"""The executor interface the engine core drives, its in-process backend (`uni`), and the checks
that refuse a parallel configuration up front.

An executor receives the scheduler's plain-data step and returns the sampled tokens (and logprobs)
as a `ModelRunnerOutput`, whichever backend runs the ranks:
- `uni`: today's `ModelRunner` in this process (one rank);
- `mp`: one worker process per rank on this machine (`pagoda.exec.mp_executor`);
- `ray`: the same workers as Ray actors in a placement group (`pagoda.exec.ray_executor`).
Tensor and pipeline parallelism combine: rank = stage * tensor_parallel_size + TP rank.
One scheduler and one KV block manager, in the engine core, serve all ranks: every rank holds its
shard of every KV block under the same block ids, so the step is the same message for each.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Protocol

import torch

from pagoda.config import EXECUTOR_BACKENDS, EngineArgs
from pagoda.contracts.step import SchedulerOutput
from pagoda.exec.kv_offload import KVOffloader
from pagoda.exec.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)



class Executor(Protocol):
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the sampled tokens (every rank samples the same)."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Drop the state of requests that ended (idempotent)."""
        ...

    def check_health(self) -> None:
        """Raise WorkerDiedError when a rank is gone; cheap, called between steps."""
        ...

    def shutdown(self) -> None:
        """Stop the ranks (idempotent)."""
        ...


class UniExecutor:
    """One rank, in this process: the model runner itself."""

    def __init__(self, runner: ModelRunner, offloader: KVOffloader | None = None) -> None:
        self.runner = runner
        self.offloader = offloader  # the copies between the KV tiers that steps order

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        offloader = self.offloader
        if offloader is None:
            return self.runner.execute(step)
        offloader.before_forward(step)
        try:
            out = self.runner.execute(step)
        finally:
            failed = offloader.after_forward()
        out.kv_failed_saves = failed
        return out

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.offloader is not None:
            self.offloader.shutdown()


def resolve_backend(backend: str | None, world_size: int) -> str:
    """vLLM's default: `uni` for one rank, `mp` for several on one machine."""
    if backend is None:
        return "uni" if world_size == 1 else "mp"
    return backend


def available_ranks(device: torch.device) -> int:
    """How many ranks this machine can give one device each: its GPUs, or on the CPU its cores (a
    rank runs one thread per core it is given; more ranks than cores only wait on each other)."""
    if device.type == "cuda":
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_parallel_config(tp: int, pp: int, backend: str, device: torch.device, config=None,
                          expert_parallel: bool = False) -> None:
    """Raise ValueError, one line, for a configuration the executor cannot run."""
    world = tp * pp
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got {backend!r}")
    if backend == "uni" and world > 1:
        raise ValueError(
            f"the uni executor runs one rank; tensor_parallel_size x pipeline_parallel_size = {world} needs mp or ray"
        )
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("distributed_executor_backend=ray needs Ray: pip install 'pagoda[ray]'")
    if backend == "mp" and world > available_ranks(device) and config is None:  # said once
        if device.type == "cuda":
            raise ValueError(f"{world} ranks need {world} GPUs; this machine has {available_ranks(device)}")
        # On the CPU more ranks than cores still run (one thread each), only slower: allowed, said.
        logger.warning("%d ranks on %d CPU cores: the ranks will share cores", world, available_ranks(device))
    if config is not None:
        from pagoda.model.tensor_parallel import check_tp_config

        from pagoda.model.moe import check_expert_split

        check_tp_config(config, tp)
        check_expert_split(config, tp, expert_parallel)
        if config.num_hidden_layers < pp:
            raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {config.num_hidden_layers} layers")


def make_distributed_executor(args: EngineArgs, backend: str, num_blocks: int, max_model_len: int,
                              kv_cache_dtype: str) -> Executor:
    """The `mp` or `ray` executor for `args`, each rank with a KV cache of `num_blocks` blocks for its
    own heads and layers. mp ranks share this machine's cores evenly (one thread each at least);
    a Ray rank asks for as many CPUs (RAY_CPUS_PER_RANK, default 1)."""
    from pagoda.exec.distributed import init_timeout_s
    from pagoda.exec.mp_executor import MultiprocExecutor
    from pagoda.exec.worker import WorkerInit

    world = args.tensor_parallel_size * args.pipeline_parallel_size
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend == "ray":
        threads = int(os.environ.get("RAY_CPUS_PER_RANK", "1"))
    else:
        threads = max(1, available_ranks(torch.device("cpu")) // world)
    init = WorkerInit(
        model=args.model, dtype=args.dtype, device=device.type, kv_cache_dtype=kv_cache_dtype,
        num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len, enforce_eager=args.enforce_eager, seed=args.seed, rank=0,
        world_size=world, tensor_parallel_size=args.tensor_parallel_size, init_method="", backend=backend, timeout_s=init_timeout_s(), parent_pid=0,
        enable_expert_parallel=args.enable_expert_parallel,
        tokenizer=args.tokenizer,
    )
    if backend == "ray":
        from pagoda.exec.ray_executor import RayExecutor

        return RayExecutor(init, threads, use_gpu=device.type == "cuda")
    return MultiprocExecutor(init, threads)
