"""The shared-memory all-reduce between real processes: the sum of every rank's tensor, bit-identical
on every rank, over many calls (the two alternating slot sets); the all-gather in rank order; and
declining what does not fit."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pagoda.exec.shm_allreduce import ShmAllReduce


def _rank(rank: int, world: int, path: str, barrier, queue) -> None:
    torch.set_num_threads(1)
    if rank == 0:
        reducer = ShmAllReduce(path, rank, world, 4096, create=True)
    barrier.wait()
    if rank != 0:
        reducer = ShmAllReduce(path, rank, world, 4096, create=False)
    results = []
    for i in range(200):  # odd and even calls use different slots; a wrong reuse would mix them
        gen = torch.Generator().manual_seed(1000 * i + rank)
        dtype = torch.float32 if i % 2 else torch.bfloat16
        x = torch.randn(3, 17, generator=gen).to(dtype)
        assert reducer(x)
        results.append(x.float().numpy().copy())  # numpy: a queue would pass a tensor by a handle that dies with us
    gathered = reducer.all_gather_last(torch.full((2, 3), float(rank)))
    assert torch.equal(gathered, torch.tensor([[0.0] * 3 + [1.0] * 3 + [2.0] * 3] * 2))
    big = torch.zeros(2048)  # 8 KiB > a 4 KiB slot
    queue.put((rank, results, reducer(big) or reducer.all_gather_last(big) is not None))


def test_sums_agree_bitwise_on_every_rank_and_big_tensors_are_declined(tmp_path):
    world = 3
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(world), ctx.Queue()
    path = str(tmp_path / "allreduce")
    procs = [ctx.Process(target=_rank, args=(r, world, path, barrier, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((rank, (results, declined)) for rank, results, declined in (queue.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    for i in range(200):
        dtype = torch.float32 if i % 2 else torch.bfloat16
        parts = [torch.randn(3, 17, generator=torch.Generator().manual_seed(1000 * i + r)).to(dtype) for r in range(world)]
        want = (parts[0].float() + parts[1].float() + parts[2].float()).to(dtype)
        for rank in range(world):
            assert (got[rank][0][i] == got[0][0][i]).all()
        assert torch.equal(torch.from_numpy(got[0][0][i]), want.float())
    assert [got[r][1] for r in range(world)] == [False] * world
