"""The `ray` executor: the ranks as Ray actors in one placement group, on any Ray cluster (a local
one started by `ray.init`, or the one RAY_ADDRESS names; docs/distributed.md has the recipe).

Each actor wraps the same `Worker` the `mp` backend runs in a process, so a rank behaves alike on
both. More ranks than the cluster has CPUs (GPUs) are refused up front. Start-up is bounded at
every stage that can hang on a cluster: the placement group must be placed (the resources exist
but others may hold them), and the ranks must meet, within PAGODA_DIST_INIT_TIMEOUT_S, each failure one line naming
the backend and the rank (or the resources that were missing). The rendezvous is hosted by rank
0's node, on a port free there. A lost actor fails the step it was in (Ray raises for its calls)
and the idle health check (a ping), which ends the engine as a dead `mp` worker does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import msgspec

from pagoda.contracts.step import SchedulerOutput
from pagoda.errors import DistributedInitError, WorkerDiedError
from pagoda.exec.model_runner import ModelRunnerOutput
from pagoda.exec.mp_executor import merge_into, split_step
from pagoda.exec.worker import Worker, WorkerInit, error_line

logger = logging.getLogger(__name__)

_PING_TIMEOUT_S = 10.0


class _Rank:
    """A rank inside a Ray actor (made remote in RayExecutor, so that importing this module needs no Ray)."""

    def __init__(self, init: WorkerInit, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.worker = Worker(init)
        self._decode = msgspec.msgpack.Decoder(SchedulerOutput)

    def address(self) -> tuple[str, int]:
        import ray

        from pagoda.exec.mp_executor import free_port

        return ray.util.get_node_ip_address(), free_port()

    def meet(self, init_method: str) -> str | None:
        """None once met, else the failure's one line."""
        self.worker.init = replace(self.worker.init, init_method=init_method)
        try:
            self.worker.meet()
        except Exception as exc:
            return error_line(exc, self.worker.init)
        return None

    def load(self) -> str | None:
        try:
            self.worker.load()
        except Exception as exc:
            return error_line(exc, self.worker.init)
        return None

    def execute(self, payload: bytes) -> ModelRunnerOutput | None:
        return self.worker.execute(self._decode.decode(payload))

    def release(self, request_ids: list[str]) -> None:
        self.worker.release(request_ids)

    def ping(self) -> bool:
        return True


class RayExecutor:
    def __init__(self, base: WorkerInit, threads_per_rank: int, use_gpu: bool = False) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = base.world_size
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            # RAY_ADDRESS (or `ray start` on this machine) joins a cluster; else a local one is started.
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        self.num_stages = world // base.tensor_parallel_size
        self.answering_rank = world - base.tensor_parallel_size
        self._encode = msgspec.msgpack.Encoder()
        bundle = {"CPU": threads_per_rank, **({"GPU": 1} if use_gpu else {})}
        have = ray.cluster_resources()
        for key, each in bundle.items():
            if have.get(key, 0) < world * each:  # refused up front: it could never be placed
                if self._own_ray:
                    ray.shutdown()
                raise ValueError(
                    f"ray backend: {world} ranks need {world * each:g} {key} ({each:g} per rank); "
                    f"the Ray cluster has {have.get(key, 0):g}"
                )
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        self._remove_pg = remove_placement_group
        self.actors: list = []
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=base.timeout_s)
            if not ready:
                raise DistributedInitError(
                    f"ray backend: a placement group of {world} bundles of {bundle} was not placed within "
                    f"{base.timeout_s:g} s (the cluster has {ray.cluster_resources()})"
                )
            env = {"OMP_NUM_THREADS": str(threads_per_rank)}
            if os.environ.get("PYTHONPATH"):
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            cls = ray.remote(_Rank)
            for rank in range(world):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                self.actors.append(cls.options(
                    num_cpus=threads_per_rank, num_gpus=1 if use_gpu else 0, scheduling_strategy=strategy,
                    runtime_env={"env_vars": env},
                ).remote(replace(base, rank=rank, parent_pid=os.getpid()), threads_per_rank))
            ip, port = self._get([self.actors[0].address.remote()], base.timeout_s, "meet")[0]
            refs = [a.meet.remote(f"tcp://{ip}:{port}") for a in self.actors]
            self._raise_errors(self._get(refs, base.timeout_s + 15, "meet"), DistributedInitError)
            self._raise_errors(self._get([a.load.remote() for a in self.actors], None, "load"), WorkerDiedError)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray actors ready (%d CPU(s) each)", world, threads_per_rank)

    @staticmethod
    def _raise_errors(lines: list[str | None], kind: type[Exception]) -> None:
        for line in lines:
            if line is not None:
                raise kind(line)

    def _get(self, refs: list, timeout: float | None, what: str) -> list:
        """Results in rank order; a lost actor is a WorkerDiedError naming its rank, a deadline a
        DistributedInitError naming the ranks that had not answered."""
        import ray

        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                late = ", ".join(str(rank_of[r]) for r in pending)
                raise DistributedInitError(f"ray backend: rank(s) {late} did not {what} within {timeout:g} s")
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise WorkerDiedError(f"worker rank {rank_of[ref]} (ray backend) was lost: {type(exc).__name__}") from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise WorkerDiedError(f"worker rank {rank_of[ref]} (ray backend) failed: {type(cause).__name__}: "
                                      f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''}") from None
        return results

    # -- the Executor interface ---------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        parts = split_step(step) if self.num_stages > 1 else [step]
        # Every part is submitted before any is awaited: an actor runs its calls in order, so the
        # stages overlap as in the mp backend.
        calls = []
        for part in parts:
            payload = self._encode.encode(part)
            calls.append([a.execute.remote(payload) for a in self.actors])
        out = ModelRunnerOutput()
        for refs in calls:
            merge_into(out, self._get(refs, None, "answer")[self.answering_rank])
        return out

    def release(self, request_ids: list[str]) -> None:
        if request_ids:
            ids = list(request_ids)
            for a in self.actors:
                a.release.remote(ids)  # ordered before the actor's next step

    def check_health(self) -> None:
        self._get([a.ping.remote() for a in self.actors], _PING_TIMEOUT_S, "answer a ping")

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.pg is not None:
            self._remove_pg(self.pg)
            self.pg = None
        if self._own_ray:
            ray.shutdown()
