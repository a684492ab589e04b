"""Building Pagoda's small C++ CPU extensions: compiled on first use (or at `make install`) and cached.

Shared by the model layer (fused layer ops) and the execution layer (paged KV cache kernels). Built
with torch's cpp_extension (g++ and torch's headers, both present wherever pagoda installs); when a
build fails the caller falls back to its pure PyTorch path, so nothing depends on a compiler.

A build is cached under a name keyed by everything its machine code depends on: the source and the
headers it includes, its path, the compiler flags, torch's version, and the CPU's instruction set
(`-march=native` compiles for this CPU, so a cache or image moved to a CPU without, say, AVX-512
must build afresh rather than load code that dies there with SIGILL).

PAGODA_CPU_ISA=avx2 makes an AVX-512 machine build and choose as an AVX2-only one would: the kernels
compile for x86-64-v3 (AVX2, FMA, F16C) and `cpu_flags` hides the flags such a CPU lacks, so
`dtype=auto` picks float32 there too. `make test-avx2` runs the suite that way (with torch's and
oneDNN's own kernels held to AVX2 as well).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
from contextlib import nullcontext
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from pagoda.progress import activity

logger = logging.getLogger(__name__)

# Headers shared by the kernels of several layers (pagoda/csrc/vec_math.h).
SHARED_INCLUDE = Path(__file__).parent / "csrc"

# No -ffast-math: it lets the compiler assume that no value is inf or NaN, which masked attention
# (-inf scores) and NaN propagation rely on; under it the vectorised SiLU loop (glibc's vector expf)
# gave NaN instead of -0 for gates below about -88.7. What stays leaves IEEE results alone: no errno
# from math calls (so sqrt inlines) and no FP traps (never enabled here), which frees the vectoriser.
# -mprefer-vector-width=512: GCC tunes Intel's AVX-512 CPUs (Sapphire Rapids and others) for 256-bit
# vectors, so the loops it vectorises itself (exp, the softmax's sums, the layer ops) took half the
# width the explicit AVX-512 kernels use; the lanes compute as before (the reductions keep 16 lanes
# whatever the width, vec_math.h), so the bits do not move. No effect where there is no AVX-512.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")

# The instruction-set levels PAGODA_CPU_ISA may name, as the compiler's -march, and the flags of
# /proc/cpuinfo that a CPU of that level lacks (by prefix).
_ISA_LEVELS = {"avx2": ("x86-64-v3", ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"))}


def cpu_isa() -> str:
    """The instruction-set level the kernels target: "native", or PAGODA_CPU_ISA's level."""
    isa = os.environ.get("PAGODA_CPU_ISA", "native").strip().lower() or "native"
    if isa != "native" and isa not in _ISA_LEVELS:
        raise ValueError(f"PAGODA_CPU_ISA must be native or one of {sorted(_ISA_LEVELS)}; got {isa!r}")
    return isa


def cflags() -> tuple[str, ...]:
    """The compiler flags for the target level (CFLAGS on the CPU's own)."""
    isa = cpu_isa()
    if isa == "native":
        return CFLAGS
    # The define tells run-time choices in C++ (quant_matmul.cpp) the level this build is held to.
    return tuple(f"-march={_ISA_LEVELS[isa][0]}" if f == "-march=native" else f for f in CFLAGS) + (
        "-mtune=native", f"-DPAGODA_CPU_LEVEL_{isa.upper()}")


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def cpu_flags() -> str:
    """The CPU's feature flags (x86 `flags`, Arm `Features` of /proc/cpuinfo), sorted, less those
    the PAGODA_CPU_ISA level lacks; read once per process and level. Where there is no
    /proc/cpuinfo, the machine and processor names stand in."""
    isa = cpu_isa()
    return _own_flags() if isa == "native" else _flags_at_level(isa, _own_flags())


@lru_cache(maxsize=None)
def _flags_at_level(isa: str, own: str) -> str:
    lacks = _ISA_LEVELS[isa][1]
    return " ".join(f for f in own.split() if not f.startswith(lacks))


@lru_cache(maxsize=1)
def _own_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return " ".join(sorted(set(value.split())))
    return f"{platform.machine()} {platform.processor()}"


def _included_headers(source: Path) -> list[Path]:
    """The quoted includes of `source` (and theirs) found beside it or in SHARED_INCLUDE."""
    found: list[Path] = []
    pending = [source]
    while pending:
        for name in _LOCAL_INCLUDE.findall(pending.pop().read_bytes()):
            for folder in (source.parent, SHARED_INCLUDE):
                path = (folder / name.decode()).resolve()
                if path.is_file() and path not in found:
                    found.append(path)
                    pending.append(path)
                    break
    return found


def build_key(source: Path) -> str:
    """A short digest of everything the compiled module depends on (see the module docstring)."""
    import torch

    h = hashlib.sha1()
    for path in (source, *_included_headers(source)):
        h.update(str(path.resolve()).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join(cflags()).encode() + b"\0" + torch.__version__.encode() + b"\0")
    h.update(cpu_flags().encode())
    return h.hexdigest()[:12]


def build_cpu_extension(stem: str, source: Path, what: str) -> ModuleType | None:
    """The compiled module of `source`, or None when it cannot be built or PAGODA_NO_CPP=1.

    `stem` names the module; `what` names it in the warning when the build fails."""
    if os.environ.get("PAGODA_NO_CPP") == "1":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        # The build folder is named after the extension, and its ninja file records the source's
        # path: one name per checkout, source version and CPU, or two of them rebuild each other's.
        name = f"{stem}_{build_key(source)}"
        built = (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
        # A first build compiles for tens of seconds: say so (a bar on a terminal, else a log line).
        with nullcontext() if built else activity(f"building {what} for this CPU", expected_s=60):
            return load(
                name=name,
                sources=[str(source)],
                extra_cflags=list(cflags()),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(SHARED_INCLUDE)],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("%s unavailable (%s); using the PyTorch path", what, exc)
        return None
