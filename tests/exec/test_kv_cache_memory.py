"""How the CPU engine takes memory (pagoda/exec/cpu_memory.py): the KV cache zero-filled on demand,
resident only where written, in small pages (no transparent huge pages, whose faults may compact
memory); freed activation memory kept for reuse instead of being faulted in again every step."""

from __future__ import annotations

import mmap
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagoda.exec.paged_attention import PagedKVCache
from tests.conftest import proc_status_kib


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


linux_only = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self (Linux)")


@linux_only
def test_big_cache_is_zero_and_resident_only_where_written():
    before = proc_status_kib("RssAnon")
    # 30 layers x 2 x 2,048 blocks x 16 x 3 x 64 float32: 1.4 GiB, like SmolLM2's default budget.
    cache = PagedKVCache(30, 2048, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert cache.tensor.is_contiguous()
    assert proc_status_kib("RssAnon") - before < 64 * 1024  # nothing touched yet
    k, v = cache.layer(7)
    k[5].fill_(1.5)
    v[2047].fill_(-2.0)
    assert float(k[5].sum()) == 1.5 * 16 * 3 * 64 and float(v[2047].sum()) == -2.0 * 16 * 3 * 64
    assert float(k[4].abs().sum()) == 0.0 and float(cache.tensor[29, 1, 0].abs().sum()) == 0.0
    # Two written 12 KiB blocks (the reads map the shared zero page).
    assert proc_status_kib("RssAnon") - before < 4 * 1024


@linux_only
@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no MADV_NOHUGEPAGE on this platform")
def test_cache_opts_out_of_huge_pages():
    cache = PagedKVCache(2, 64, 16, 3, 64, torch.float32, torch.device("cpu"))  # 3 MiB
    assert "nh" in _vm_flags(cache.tensor.data_ptr())


def test_small_cache_is_zeros():
    cache = PagedKVCache(1, 4, 4, 2, 8, torch.float16, torch.device("cpu"))
    assert cache.tensor.dtype == torch.float16 and cache.tensor.shape == (1, 2, 4, 4, 2, 8)
    assert float(cache.tensor.abs().sum()) == 0.0


_FAULT_PROBE = """
import ctypes, sys
from pagoda.exec.cpu_memory import keep_freed_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def minor_faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])

def step_faults():
    # Like a layer's activations: large blocks alive together, written, then all freed.
    before = minor_faults()
    blocks = [libc.malloc(20 << 20) for _ in range(3)]
    for block in blocks:
        libc.memset(block, 1, 20 << 20)
    for block in blocks:
        libc.free(block)
    return minor_faults() - before

if sys.argv[1] == "keep":
    assert keep_freed_memory()
print(*(step_faults() for _ in range(3)))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize("mode", ["default", "keep"])
def test_keep_freed_memory_reuses_pages_instead_of_faulting(mode):
    # Fresh processes: glibc's defaults hold until keep_freed_memory changes them.
    done = subprocess.run([sys.executable, "-c", _FAULT_PROBE, mode], capture_output=True, text=True, check=True)
    faults = [int(x) for x in done.stdout.split()]
    pages = 3 * (20 << 20) // 4096  # 15,360
    assert faults[0] > pages * 0.9  # the first step always writes new memory
    if mode == "default":
        # glibc's trim threshold follows its mapping threshold (2 x 20 MiB here): the 60 MiB freed
        # at the heap's top goes back to the OS, and every step faults it in again.
        assert all(f > pages * 0.9 for f in faults[1:])
    else:
        assert all(f < 100 for f in faults[1:])


def test_cpu_runner_keeps_freed_memory(monkeypatch, tmp_path):
    from pagoda.exec import model_runner
    from pagoda.model.loader import load_model
    from tests.conftest import make_engine
    from tests.tiny_models import save_tiny_model

    calls = []
    monkeypatch.setattr(model_runner, "keep_freed_memory", lambda: calls.append(True) or True)
    save_tiny_model("llama3", tmp_path)
    make_engine(load_model(str(tmp_path), dtype="float32"), num_gpu_blocks_override=8)
    assert calls == [True]
