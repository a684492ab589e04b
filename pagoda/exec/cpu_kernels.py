"""A small C++ extension for the CPU paged KV cache (decode attention, KV write), compiled on first use and cached.

Built with torch's cpp_extension (g++ and torch's headers, both present wherever pagoda installs);
when the build fails the backend falls back to the pure PyTorch path, so nothing depends on it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@lru_cache(maxsize=1)
def load_cpu_kernels():
    """The compiled module (`paged_decode`, `write_kv`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    if os.environ.get("PAGODA_NO_CPP") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # The build folder is named after the extension, and its ninja file records the source's
        # path: one name per checkout and source version, or two checkouts rebuild each other's.
        key = hashlib.sha1(str(_SOURCE.resolve()).encode() + _SOURCE.read_bytes()).hexdigest()[:12]
        module = load(
            name=f"pagoda_paged_decode_{key}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        return module
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("CPU paged-cache kernels unavailable (%s); using the PyTorch path", exc)
        return None
