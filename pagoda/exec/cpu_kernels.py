"""A small C++ extension for the CPU paged KV cache (decode attention, KV write), compiled on first use and cached."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pagoda.cpp_build import build_cpu_extension

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@lru_cache(maxsize=1)
def load_cpu_kernels():
    """The compiled module (`paged_decode`, `write_kv`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_paged_decode", _SOURCE, "CPU paged-cache kernels")
