"""Tensor-parallel overhead on one machine's CPU: a decode step's time at TP=1 (T threads) against
TP=2 (T/2 threads per rank), and the share of a TP=2 step spent in communication, for gloo and for
the shared-memory all-reduce (PAGODA_CPU_ALLREDUCE).

    flock /tmp/pagoda-bench.lock .venv/bin/python benchmarks/bench_tp.py /tmp/pagoda-llama-1b

Each rank is the very worker the mp executor runs (pagoda.exec.worker.Worker: rendezvous, shard
loading, ModelRunner over its KV cache shard), driven here with hand-built steps: one prefill of
`--batch` prompts of `--prompt-len` tokens, then `--steps` decode steps of one token per request.
With --pp, PP=2 runs the same steps as one micro-batch and as two (the mp executor's split), timed
on the last stage after a barrier; its "comm" is the TP collectives only, so none.
Communication time is what the TP collectives (TPGroup.all_reduce / all_gather_last, wrapped here
with a timer) take on rank 0, waiting for the other rank included. Medians over the decode steps
after `--warmup`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time


def _rank(rank: int, world: int, threads: int, port: int, args: dict, comm: str, queue, tp: int, parts: int) -> None:
    os.environ["PAGODA_CPU_ALLREDUCE"] = comm
    import torch

    torch.set_num_threads(threads)
    from pagoda.contracts.step import NewRequestData, ScheduledRequest, SchedulerOutput
    from pagoda.exec.worker import Worker, WorkerInit
    from pagoda.model import tensor_parallel
    from pagoda.sampling_params import SamplingParams

    spent = [0.0]

    def timed(fn):
        def wrapper(self, x):
            t0 = time.perf_counter()
            try:
                return fn(self, x)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    tensor_parallel.TPGroup.all_reduce = timed(tensor_parallel.TPGroup.all_reduce)
    tensor_parallel.TPGroup.all_gather_last = timed(tensor_parallel.TPGroup.all_gather_last)

    batch, plen, steps, bs = args["batch"], args["prompt_len"], args["steps"], 16
    nb = (plen + steps + bs) // bs + 1
    init = WorkerInit(
        model=args["model"], dtype=args["dtype"], device="cpu", kv_cache_dtype="bfloat16" if args["dtype"] == "bfloat16" else "float32",
        num_blocks=batch * nb + 1, block_size=bs, max_num_seqs=batch, max_model_len=plen + steps + bs,
        enforce_eager=True, seed=0, rank=rank, world_size=world, tensor_parallel_size=tp,
        init_method=f"tcp://127.0.0.1:{port}", backend="mp", timeout_s=120.0, parent_pid=os.getppid(),
    )
    import torch.distributed as dist

    worker = Worker(init)
    worker.meet()
    worker.load()
    blocks = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(plen)] for i in range(batch)]
    prefill = SchedulerOutput(scheduled=[
        ScheduledRequest(f"r{i}", 0, plen, prompts[i], blocks[i], blocks[i], plen,
                         new_request=NewRequestData(prompts[i], [], params, 2))
        for i in range(batch)
    ], total_num_scheduled_tokens=batch * plen)
    from pagoda.exec.mp_executor import split_step

    for part in split_step(prefill) if parts == 2 else [prefill]:
        worker.execute(part)
    step_ms, comm_ms = [], []
    for k in range(steps):
        step = SchedulerOutput(scheduled=[
            ScheduledRequest(f"r{i}", plen + k, 1, [100 + k], [], blocks[i], plen + k + 1) for i in range(batch)
        ], total_num_scheduled_tokens=batch)
        if world > tp:  # a pipeline: the step ends when the last stage is done, so time it there
            dist.barrier()
        spent[0] = 0.0
        t0 = time.perf_counter()
        # As the mp executor does for a pipeline: each stage runs the micro-batches in turn, handing
        # each on as it finishes, so stage 1 computes the first while stage 0 computes the second.
        for part in split_step(step) if parts == 2 else [step]:
            worker.execute(part)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        comm_ms.append(spent[0] * 1e3)
    if rank == (world - 1 if world > tp else 0):
        queue.put((step_ms[args["warmup"]:], comm_ms[args["warmup"]:]))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def run(world: int, threads: int, comm: str, args: dict, tp: int | None = None, parts: int = 1) -> dict:
    from pagoda.exec.mp_executor import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    tp = world if tp is None else tp
    procs = [ctx.Process(target=_rank, args=(r, world, threads, port, args, comm, queue, tp, parts))
             for r in range(world)]
    for p in procs:
        p.start()
    step_ms, comm_ms = queue.get(timeout=1800)
    for p in procs:
        p.join(60)
    step = statistics.median(step_ms)
    comm_share = statistics.median(c / s for c, s in zip(comm_ms, step_ms))
    return {"tp": tp, "pp": world // tp, "micro_batches": parts, "threads_per_rank": threads,
            "comm": comm if world > 1 else "-",
            "step_ms": round(step, 1), "tok_s": round(args["batch"] * 1e3 / step, 1),
            "comm_ms": round(statistics.median(comm_ms), 2), "comm_share": round(comm_share, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="threads of the TP=1 run; TP=2 ranks get half each")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the configurations, alternating")
    ap.add_argument("--pp", action="store_true", help="also PP=2 (1 thread per stage), with one and two micro-batches")
    args = ap.parse_args()
    params = vars(args)
    rows = []
    for _ in range(args.rounds):
        rows.append(run(1, args.threads, "-", params))
        n = len(rows)
        for comm in ("gloo", "shm"):
            rows.append(run(2, max(1, args.threads // 2), comm, params))
        if args.pp:
            for parts in (1, 2):
                rows.append(run(2, max(1, args.threads // 2), "shm", params, tp=1, parts=parts))
        for row in rows[n - 1:]:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
