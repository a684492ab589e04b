"""The `mp` executor: one worker process per rank on this machine (`pagoda.exec.worker`), all of
them workers, none in the engine core's process.

Why every rank is a worker, rank 0 included: the ranks are then identical (one code path, one
failure mode), the engine core's process keeps its own thread settings and never blocks inside a
collective, and a rank's death is always the same event, an EOF on its socket. The price is one
more local hop per step for rank 0's output, tens of microseconds beside a step's milliseconds.

With pipeline parallelism a step goes out as two micro-batches (`split_step`), both written before
either answer is read, so stage 1 computes the first while stage 0 computes the second; their
outputs are merged back into the step's.

Per step the step is encoded once (msgpack) and written to every rank's socket; every rank
answers (rank 0 with the output, the others with None), so that a rank that failed is noticed at
the step it failed in, not at the next collective that would wait for it forever. Waiting is on
the sockets, whose EOF is the death of their process: a killed worker fails the step at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import msgspec

from pagoda.contracts.step import SchedulerOutput
from pagoda.errors import DistributedInitError, WorkerDiedError
from pagoda.exec.model_runner import ModelRunnerOutput
from pagoda.exec.worker import WorkerInit

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 5.0
_HEALTH_TICK_S = 1.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_step(step: SchedulerOutput) -> list[SchedulerOutput]:
    """Two micro-batches of about equal tokens (requests are never split), for the pipeline; one
    when there is a single request. Requests to forget go with the first."""
    scheduled = step.scheduled
    if len(scheduled) < 2:
        return [step]
    half, acc, cut = step.total_num_scheduled_tokens / 2, 0, 1
    for i, s in enumerate(scheduled[:-1]):
        acc += s.num_new_tokens
        cut = i + 1
        if acc >= half:
            break
    parts = []
    for i, chunk in enumerate((scheduled[:cut], scheduled[cut:])):
        counts = {s.request_id: s.num_new_tokens for s in chunk}
        extra = {} if i == 0 else {"preempted_request_ids": [], "finished_request_ids": []}
        parts.append(msgspec.structs.replace(step, scheduled=chunk, num_scheduled_tokens=counts,
                                             total_num_scheduled_tokens=sum(counts.values()), **extra))
    return parts


def merge_into(out: ModelRunnerOutput, part: ModelRunnerOutput) -> None:
    """Add a micro-batch's output to the step's (every field is a dict by request id)."""
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        if isinstance(value, dict):
            getattr(out, f.name).update(value)
        elif value:
            raise TypeError(f"ModelRunnerOutput.{f.name} is not keyed by request: cannot merge micro-batches")


def _stop(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Ask every worker to stop, then make sure: SIGKILL what is still alive after a grace period."""
    for conn in conns:
        try:
            conn.send_bytes(b"S")
        except OSError:
            pass
    deadline = time.monotonic() + _STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()


class MultiprocExecutor:
    def __init__(self, base: WorkerInit, threads_per_rank: int) -> None:
        world = base.world_size
        self.backend = base.backend
        self.num_stages = world // base.tensor_parallel_size
        self.answering_rank = world - base.tensor_parallel_size  # the last stage's first TP rank
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank), MKL_NUM_THREADS=str(threads_per_rank))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        # Closed on every path (a failed start included), and at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        for rank in range(world):
            mine, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pagoda.exec.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env,
            )
            theirs.close()
            self.procs.append(proc)
            self.conns.append(Connection(mine.detach()))
            init = replace(base, rank=rank, init_method=init_method, parent_pid=os.getpid())
            self.conns[-1].send_bytes(pickle.dumps(init, protocol=pickle.HIGHEST_PROTOCOL))
        try:
            # Each rank gives up on the rendezvous after timeout_s; a rank that cannot even say so
            # (stuck importing, say) is named here, a little later.
            self._gather("met", deadline=time.monotonic() + base.timeout_s + 15.0)
            self._gather("ready", deadline=None)
        except BaseException:
            self.shutdown()
            raise
        self._encode = msgspec.msgpack.Encoder()
        logger.info("%d worker processes ready (%s backend, %d thread(s) each)", world, self.backend, threads_per_rank)

    # -- waiting on the ranks ----------------------------------------------------------------------
    def _died(self, rank: int) -> WorkerDiedError:
        proc = self.procs[rank]
        try:
            code = proc.wait(0.5)
        except subprocess.TimeoutExpired:
            code = None
        what = "closed its connection" if code is None else f"exited with code {code}"
        return WorkerDiedError(f"worker rank {rank} ({self.backend} backend, pid {proc.pid}) {what}")

    def _gather(self, kind: str, deadline: float | None) -> list[object]:
        """Each rank's next message, which must be `kind`; raise for an error, a death or the deadline."""
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        results: list[object] = [None] * len(self.conns)
        while pending:
            timeout = _HEALTH_TICK_S if deadline is None else max(0.0, min(_HEALTH_TICK_S, deadline - time.monotonic()))
            for conn in wait(list(pending), timeout):
                rank = pending.pop(conn)
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._died(rank) from None
                if msg[0] == "error":
                    if kind == "met":
                        raise DistributedInitError(msg[1])
                    raise WorkerDiedError(msg[1])
                if msg[0] != kind:
                    raise WorkerDiedError(f"worker rank {rank} answered {msg[0]!r}, expected {kind!r}")
                results[rank] = msg[1] if len(msg) > 1 else None
            if deadline is not None and time.monotonic() >= deadline and pending:
                missing = sorted(pending.values())
                raise DistributedInitError(
                    f"rank(s) {', '.join(map(str, missing))} of {len(self.conns)} ({self.backend} backend) did not "
                    f"reach the rendezvous in time"
                )
            for conn, rank in pending.items():
                if self.procs[rank].poll() is not None:
                    raise self._died(rank)
        return results

    # -- the Executor interface ---------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        parts = split_step(step) if self.num_stages > 1 else [step]
        # All parts go out before any answer is read: each stage starts the next micro-batch as soon
        # as it has handed the previous one on, so the stages compute side by side.
        for part in parts:
            self._send_all(b"E" + self._encode.encode(part))
        out = ModelRunnerOutput()
        for _ in parts:
            merge_into(out, self._gather("out", deadline=None)[self.answering_rank])
        return out

    def release(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send_all(b"R" + self._encode.encode(list(request_ids)))

    def _send_all(self, frame: bytes) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(frame)
            except OSError:
                raise self._died(rank) from None

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise self._died(rank)

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
