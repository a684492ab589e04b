"""Which CPU each of the engine core's compute threads runs on: vLLM's `VLLM_CPU_OMP_THREADS_BIND`,
read where an engine core runs the model in its own process (`pagoda serve`'s core, one rank).

- `auto` (the default): when torch has one thread per CPU this process may use (the core owns the
  machine's cores, as `pagoda serve` starts it), thread i is bound to the i-th of those CPUs; else
  (data-parallel replicas sharing the cores, a single CPU) nothing is bound.
- `nobind`: nothing is bound.
- a CPU list (`0-3`, `0,2,4-5`): torch takes one thread per CPU listed, thread i bound to the i-th.

Why bind: a step of the engine runs a few hundred parallel regions, each ended by a barrier, on
the same cores as the API process and, in a benchmark, the load's client. Unbound, a thread that
loses its core to them may be queued behind its sibling on the other core, and the two take turns
there while the freed core idles; bound, it waits on its own core only (csrc/thread_binding.cpp;
docs/perf-notes.md, 2026-12-07 evening: a served batch on two cores 4-7 % faster).

The offline `LLM` runs its engine in the caller's process, whose threads (and the processes it
starts later, which inherit a thread's CPUs) are not ours to bind: it never binds.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6], in the order given; ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{THREADS_BIND_ENV} must be auto, nobind or a CPU list such as 0-3 or 0,2,4-5; got {text!r}")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"{THREADS_BIND_ENV}: the range {part.strip()!r} is empty")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{THREADS_BIND_ENV}: a CPU is listed twice in {text!r}")
    return cpus


def _setting(value: str) -> str:
    """The variable's value as read: `auto` when unset or empty, `nobind`, or a CPU list."""
    return value.strip().lower() or "auto"


def binding_plan(value: str, allowed: list[int], threads: int) -> list[int] | None:
    """The CPUs to bind torch's threads to (thread i to the i-th), or None to leave them unbound.
    `allowed`: the CPUs this process may run on; `threads`: torch's thread count."""
    value = _setting(value)
    if value == "nobind":
        return None
    if value == "auto":
        return sorted(allowed) if threads == len(allowed) > 1 else None
    cpus = parse_cpu_list(value)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(f"{THREADS_BIND_ENV}: CPU {outside[0]} is not one this process may run on "
                         f"({','.join(map(str, sorted(allowed)))})")
    return cpus


def check_threads_bind(single_rank: bool, env: Mapping[str, str] = os.environ) -> None:
    """Before the model loads: ValueError for a value that cannot be honoured. `single_rank`: the
    model will run in this process, as one rank of one replica; otherwise only `auto` and `nobind`
    are accepted, and nothing is bound (several ranks or replicas would need a list each)."""
    value = _setting(env.get(THREADS_BIND_ENV, ""))
    if value in ("auto", "nobind"):
        return
    parse_cpu_list(value)
    if not single_rank:
        raise ValueError(f"{THREADS_BIND_ENV} lists CPUs for one engine core running one rank; "
                         f"with data, tensor or pipeline parallelism use auto or nobind")


def bind_engine_threads(env: Mapping[str, str] = os.environ) -> list[int] | None:
    """Bind this process's torch threads as `VLLM_CPU_OMP_THREADS_BIND` says (the model runs here, one
    rank of one replica: see check_threads_bind); returns the CPUs bound, thread i to the i-th, or None.
    Called once the model is loaded: threads and processes started afterwards from this thread (a
    kernel built on first use) inherit its one CPU."""
    import torch

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    plan = binding_plan(env.get(THREADS_BIND_ENV, "auto"), allowed, torch.get_num_threads()) if allowed else None
    if plan is None:
        return None
    from pagoda.exec.cpu_kernels import load_thread_binding

    module = load_thread_binding()
    if module is None:
        logger.info("engine threads left unbound: the C++ kernels are not built")
        return None
    if torch.get_num_threads() != len(plan):
        torch.set_num_threads(len(plan))
    try:
        module.bind_threads(plan)
    except RuntimeError as exc:  # a thread did not join the region (OMP_DYNAMIC), or the kernel refused: run unbound
        logger.warning("engine threads left unbound: %s", exc)
        os.sched_setaffinity(0, allowed)  # this thread may have been bound before another failed
        return None
    logger.info("engine threads bound one to a CPU: %s (%s=nobind leaves them to the OS)",
                ",".join(map(str, plan)), THREADS_BIND_ENV)
    return plan
