"""How the CPU engine takes memory from the OS, and gives it back: the KV cache in a lazily zeroed
mapping of small pages (whose free blocks' pages can be returned, `release_ranges`), and a malloc
that keeps freed activation memory for the next step.

Both are about page faults: the first touch of a fresh page is a fault, and on the VMs measured here
a 4 KiB fault costs ~10 us, so writing a 2,048-token step's K/V into fresh memory (~94 MB for
SmolLM2 in fp32) takes ~250 ms, and glibc handing a step's large activations back to the OS after
each layer, to fault them in again, cost ~80,000 more faults per 2,048-token step. Transparent huge
pages fault 512 times less often, but each fault may have to compact memory first: here that made
the same write take anywhere from 15 to 900 ms, and residency grew in 2 MiB steps per layer (peak
RSS 30-130 MiB higher in A/B runs). docs/perf-notes.md, "Page faults", has the measurements.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit; larger blocks are always mapped
_TRIM_THRESHOLD = 1 << 30


def lazy_zeros(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` zeros that costs no time to make and becomes resident only
    where written: fresh anonymous memory, which the OS zeroes on first touch (torch.zeros writes
    every byte: ~1 s and the whole size resident at once for a 2 GiB cache).

    The mapping opts out of transparent huge pages, which numpy's zeros would ask for."""
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # MAP_PRIVATE: not on Windows
        return torch.zeros(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            region.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel without THP: small pages anyway
            pass
    return torch.frombuffer(region, dtype=torch.uint8)  # holds `region` as long as the tensor lives


_PAGE = mmap.PAGESIZE


def release_ranges(tensor: torch.Tensor, byte_ranges: list[tuple[int, int]]) -> int:
    """Give the pages lying wholly inside each [start, end) byte range of `tensor` (a `lazy_zeros`
    tensor or a view of one) back to the OS; they read as zeros and fault in afresh when next
    written. Pages shared with bytes outside a range stay. Returns the bytes released (0 off Linux).

    MADV_DONTNEED on private anonymous memory drops the pages at once (MADV_FREE would leave them
    counted in RSS until the kernel is short of memory, which is what this is meant to avoid)."""
    if not byte_ranges or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    madvise = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    if madvise is None:
        return 0
    base = tensor.data_ptr()
    released = 0
    for start, end in byte_ranges:
        lo = -(-(base + start) // _PAGE) * _PAGE
        hi = (base + end) // _PAGE * _PAGE
        if hi > lo and madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED) == 0:
            released += hi - lo
    return released


def _libc(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's function `name` (Linux only), or None where it has none (musl has no mallopt,
    glibc < 2.33 no mallinfo2)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> tuple[int, int] | None:
    """(bytes in use, free bytes) of malloc's heaps (glibc's mallinfo2), None where unknown."""
    fn = _libc("mallinfo2", [], _MallInfo2)
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks), int(info.fordblks)


def heap_free_bytes() -> int | None:
    """Free bytes held in malloc's heaps, None where unknown."""
    heap = heap_bytes()
    return None if heap is None else heap[1]


def trim_heap() -> bool:
    """Return the free memory of malloc's heaps to the OS (glibc's malloc_trim), which
    `keep_freed_memory` otherwise keeps for the next step: for when a burst is over. Returns whether
    anything was released (False off glibc)."""
    malloc_trim = _libc("malloc_trim", [ctypes.c_size_t])
    return malloc_trim is not None and malloc_trim(0) == 1


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks (up to its 32 MiB mapping ceiling) in the heap for reuse instead
    of unmapping or trimming them, so each step's activations land on pages already resident.

    Process-wide: memory freed after a burst stays with the process (peak RSS is unchanged). Returns
    whether the settings took (False off glibc)."""
    mallopt = _libc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the thresholds; freed memory goes back to the OS")
    return ok
