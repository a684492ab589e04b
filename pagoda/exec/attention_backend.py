"""Which paged-attention backend a KV cache gets: the Triton kernels on CUDA (when triton imports),
the PyTorch/C++ one otherwise."""

from __future__ import annotations

import logging

from pagoda.exec.paged_attention import PagedKVCache, TorchPagedAttention

logger = logging.getLogger(__name__)


def make_attention_backend(kv_cache: PagedKVCache):
    """Triton kernels on CUDA when triton imports; the PyTorch backend otherwise (and on CPU)."""
    if kv_cache.tensor.device.type == "cuda":
        try:
            from pagoda.exec.triton_attention import TritonPagedAttention
        except ImportError as exc:
            logger.warning("triton unavailable (%s): CUDA attention falls back to PyTorch, without CUDA graphs", exc)
        else:
            return TritonPagedAttention(kv_cache)
    return TorchPagedAttention(kv_cache)
