"""Whether the device the user named exists, checked before anything is built on it; and keeping
the API process's torch (if a tokenizer loaded it) off the cores the engine core computes on.

One check for both front doors: `LLMEngine` (offline) and `AsyncLLM` (the server, in the API
process, before the engine-core process is spawned). Without it, `--device cuda` on a machine
without CUDA surfaces as torch's AssertionError from deep inside the model loader, in the server's
case only after the HTTP server is up.

torch is imported only when a CUDA device is named: the API process otherwise never imports it
(seconds of start-up), and `auto` or `cpu` always have a device to run on.
"""

from __future__ import annotations

import os
import sys


def check_device_available(device: str) -> None:
    """Raise ValueError (a usage error: one line, exit 2 from the CLI) when `device` is `cuda` or
    `cuda:N` and torch cannot see that device."""
    device = str(device)
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device; use --device cpu or auto")
    _, _, index = device.partition(":")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        # Else torch's "invalid device ordinal" comes from the first tensor put there, mid-load.
        raise ValueError(f"device {device!r} was asked for but torch sees {count} CUDA device(s): cuda:0 to cuda:{count - 1}")


def limit_torch_threads() -> None:
    """If torch is loaded in the API process (a tokenizer may import it), keep it to one thread: the
    cores belong to the engine core. Importing torch only for this would cost seconds of start-up."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # only settable before the first parallel op; harmless if already fixed


def share_cpu_threads(num_replicas: int) -> None:
    """In a data-parallel replica's core process: its share of the CPU's cores, so that N replicas
    on one machine do not each start a thread per core and fight over them."""
    if num_replicas <= 1:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // num_replicas))
