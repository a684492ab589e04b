"""One rank of a distributed executor (`Worker`: its model shard, its KV cache shard and a
`ModelRunner` over them), and the worker process of the `mp` executor that drives one through a
socket; the `ray` executor drives the same `Worker` inside an actor.

Started as `python -m pagoda.exec.worker FD` with FD one end of a socketpair (a
multiprocessing `Connection`). The engine core's process is a daemonic multiprocessing child,
which may not start multiprocessing children of its own, hence a plain subprocess.

Messages, driver -> worker: first a pickled `WorkerInit`; then frames of one kind byte and a msgpack
payload: `E` + a `SchedulerOutput` (run it, answer), `R` + request ids (release, no answer), `S`
(stop). Worker -> driver, pickled tuples: ("met",) once the ranks have met, ("ready",) once loaded,
("out", ModelRunnerOutput | None) per step (the last pipeline stage's first TP rank sends the
output, the others None: every rank of that stage sampled the same tokens), ("error", one line)
before exiting 1.

A worker exits by itself when the driver goes: its socket reads EOF, or its parent process changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # idle wake-up period, only to notice that the driver died


@dataclass(frozen=True)
class WorkerInit:
    """Everything a rank needs to build itself; plain data, the same for every rank but `rank`."""

    model: str | None
    dtype: str
    device: str
    kv_cache_dtype: str  # resolved: float32, bfloat16, float16
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool
    seed: int
    rank: int
    world_size: int
    tensor_parallel_size: int
    init_method: str
    backend: str  # the executor backend, for messages
    timeout_s: float
    parent_pid: int
    enable_expert_parallel: bool = False  # MoE layers: whole experts per rank (TPGroup.expert_parallel)
    tokenizer: str | None = None  # --tokenizer; None: the model's


class Worker:
    """One rank, whatever carries its messages (this module's socket loop, or a Ray actor)."""

    def __init__(self, init: WorkerInit) -> None:
        self.init = init
        self.runner = None
        self.answers = False
        self.tp = self.pp = None

    def meet(self) -> None:
        """Join the other ranks (DistributedInitError when they do not come)."""
        import torch

        from pagoda.exec.distributed import init_distributed

        init = self.init
        device = self.device()
        # Every rank samples, from the same logits: the same seed keeps unseeded draws in step.
        torch.manual_seed(init.seed)
        self.tp, self.pp = init_distributed(init.rank, init.world_size, init.init_method, init.backend,
                                            init.timeout_s, device, init.tensor_parallel_size)
        self.tp = dataclasses.replace(self.tp, expert_parallel=init.enable_expert_parallel)
        # The last stage's first TP rank answers for all: every rank of that stage sampled the same.
        self.answers = init.rank == init.world_size - init.tensor_parallel_size

    def device(self):
        import torch

        device = torch.device(self.init.device)
        if device.type == "cuda":
            device = torch.device("cuda", self.init.rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        return device

    def load(self) -> None:
        """Load this rank's shard and build its KV cache and runner."""
        import torch

        from pagoda.exec.model_runner import ModelRunner
        from pagoda.exec.paged_attention import PagedKVCache
        from pagoda.exec.structured_output import StructuredOutputs
        from pagoda.model.loader import load_tokenizer
        from pagoda.model.model_source import tokenizer_source
        from pagoda.model.shard_loader import load_model_shard

        init = self.init
        device = self.device()
        loaded = load_model_shard(init.model, init.dtype, device, self.tp, self.pp)
        model, cfg = loaded.model, loaded.config
        first, end = model.model.first_layer, model.model.end_layer  # this stage's layers
        attn = model.model.layers[first].self_attn
        kv_cache = PagedKVCache(end - first, init.num_blocks, init.block_size, attn.num_kv_heads,
                                attn.head_dim, getattr(torch, init.kv_cache_dtype), device)

        def tokenizer_and_eos():
            tokenizer = load_tokenizer(tokenizer_source(loaded.source, init.tokenizer))
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                eos = getattr(cfg, "eos_token_id", None)
                eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
            return tokenizer, None if eos is None else int(eos)

        self.runner = ModelRunner(
            model, kv_cache, vocab_size=cfg.vocab_size, max_num_seqs=init.max_num_seqs,
            max_model_len=init.max_model_len, device=device, enforce_eager=init.enforce_eager,
            structured_outputs=StructuredOutputs(tokenizer_and_eos, cfg.vocab_size),
        )

    def execute(self, step):
        """Run a step; its output on the answering rank, None on the others."""
        out = self.runner.execute(step)
        return out if self.answers else None

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)


def error_line(exc: BaseException, init: WorkerInit) -> str:
    """What a rank's failure says in one line (the expected kinds as they are, others with their type)."""
    from pagoda.errors import DistributedInitError
    from pagoda.model.errors import ModelLoadError

    if isinstance(exc, (DistributedInitError, ModelLoadError, ValueError)):
        return str(exc)
    logger.error("rank %d failed:\n%s", init.rank, traceback.format_exc())
    return f"rank {init.rank} ({init.backend} backend) failed: {type(exc).__name__}: {exc}"


def _send(conn: Connection, msg: tuple) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _serve(conn: Connection, worker: Worker) -> None:
    import msgspec

    from pagoda.contracts.step import SchedulerOutput

    decode_step = msgspec.msgpack.Decoder(SchedulerOutput)
    decode_ids = msgspec.msgpack.Decoder(list[str])
    while True:
        while not conn.poll(_POLL_S):
            if os.getppid() != worker.init.parent_pid:
                return  # the driver is gone
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            return
        kind, payload = frame[:1], memoryview(frame)[1:]
        if kind == b"E":
            _send(conn, ("out", worker.execute(decode_step.decode(payload))))
        elif kind == b"R":
            worker.release(decode_ids.decode(payload))
        elif kind == b"S":
            return


def main(fd: int) -> int:
    # The driver alone stops a worker (S, else SIGKILL); Ctrl-C in a terminal reaches the whole
    # process group, and obeying it would look like a crash in the middle of a graceful stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    init: WorkerInit = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {init.rank}] %(name)s: %(message)s")
    worker = Worker(init)
    try:
        worker.meet()
        _send(conn, ("met",))
        worker.load()
        _send(conn, ("ready",))
        _serve(conn, worker)
    except BaseException as exc:
        try:
            _send(conn, ("error", error_line(exc, init)))
        except OSError:
            pass
        return 1
    finally:
        from pagoda.exec.distributed import close_distributed

        try:
            close_distributed()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
