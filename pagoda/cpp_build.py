"""Building Pagoda's small C++ CPU extensions: compiled on first use (or at `make install`) and cached.

Shared by the model layer (fused layer ops) and the execution layer (paged KV cache kernels). Built
with torch's cpp_extension (g++ and torch's headers, both present wherever pagoda installs); when a
build fails the caller falls back to its pure PyTorch path, so nothing depends on a compiler.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


def build_cpu_extension(stem: str, source: Path, what: str) -> ModuleType | None:
    """The compiled module of `source`, or None when it cannot be built or PAGODA_NO_CPP=1.

    `stem` names the module; `what` names it in the warning when the build fails."""
    if os.environ.get("PAGODA_NO_CPP") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # The build folder is named after the extension, and its ninja file records the source's
        # path: one name per checkout and source version, or two checkouts rebuild each other's.
        key = hashlib.sha1(str(source.resolve()).encode() + source.read_bytes()).hexdigest()[:12]
        return load(
            name=f"{stem}_{key}",
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("%s unavailable (%s); using the PyTorch path", what, exc)
        return None
