"""Typed engine configuration, with vLLM's argument names and defaults where they exist."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# The names `--dtype` takes (vLLM's) and the short ones the loader also accepts.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_DTYPE_ALIASES = ("fp16", "bf16", "fp32")
_INT_FIELDS = (
    "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "long_prefill_token_threshold",
    "kv_cache_memory", "num_gpu_blocks_override", "max_logprobs",
)


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; bfloat16/float16 halve an fp32 model's cache (CPU)
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # per-request cap on prefill tokens per step; 0: none
    scheduling_policy: str = "fcfs"  # or "priority"
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: a default for the device
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (wins over memory sizing)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    served_model_name: str | None = None
    max_logprobs: int = 20  # the most logprobs a request may ask for (vLLM's default); -1: the vocabulary

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed is None:
            raise ValueError("seed must be an integer, got None")
        if isinstance(self.dtype, str) and self.dtype not in DTYPES + _DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or unset for the model's), got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes (or unset), got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1 (or unset), got {self.num_gpu_blocks_override}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for no limit; got {self.max_logprobs}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
