"""The execution layer's C++ CPU kernels, compiled on first use (or at `make install`) and cached:
the paged KV cache's (decode attention over the blocks, KV write; a bf16 kernel on AVX512-BF16 in
`csrc/decode_bf16.h`) and prefill attention (float32 or bf16 in; the backend widens fp16)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pagoda.cpp_build import build_cpu_extension

_CSRC = Path(__file__).parent / "csrc"


@lru_cache(maxsize=1)
def load_cpu_kernels():
    """The compiled module (`paged_decode`, `write_kv`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_paged_decode", _CSRC / "paged_decode.cpp", "CPU paged-cache kernels")


@lru_cache(maxsize=1)
def load_prefill_attention():
    """The compiled module (`prefill_attention`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_prefill_attention", _CSRC / "prefill_attention.cpp", "CPU prefill attention")


@lru_cache(maxsize=1)
def load_moe_experts():
    """The compiled module (`moe_experts_bf16`, `has_avx512_bf16`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_moe_experts", _CSRC / "moe_experts.cpp", "CPU grouped MoE experts")


@lru_cache(maxsize=1)
def load_gemm_int8():
    """The compiled W8A8 module (`gemm_int8`, `has_vnni`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_gemm_int8", _CSRC / "gemm_int8.cpp", "CPU int8 GEMM")


@lru_cache(maxsize=1)
def load_gemm_bf16():
    """The compiled module (`gemm_bf16`, `gemm_i8_bf16`, `has_avx512_bf16`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_gemm_bf16", _CSRC / "gemm_bf16.cpp", "CPU bf16 GEMM")


@lru_cache(maxsize=1)
def load_greedy():
    """The compiled module (`argmax_rows`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_greedy", _CSRC / "greedy.cpp", "CPU greedy argmax")


@lru_cache(maxsize=1)
def load_thread_binding():
    """The compiled module (`bind_threads`, `thread_cpus`), or None when it cannot be built (or PAGODA_NO_CPP=1)."""
    return build_cpu_extension("pagoda_thread_binding", _CSRC / "thread_binding.cpp", "CPU thread binding")
