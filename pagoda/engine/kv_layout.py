"""The KV cache's shape from the model and the flags: its dtype, the bytes of one block, how many
blocks the budget holds (a flag, a CUDA profiling forward, or the CPU's sizing rule), and the cache
tensors themselves. The engine core asks once at start."""

from __future__ import annotations

import logging

import torch

from pagoda.config import EngineArgs
from pagoda.exec.cpu_kv_sizing import cpu_kv_budget
from pagoda.exec.paged_attention import PagedKVCache
from pagoda.model.loader import LoadedModel

logger = logging.getLogger(__name__)


def kv_cache_dtype(args: EngineArgs, loaded: LoadedModel, device: torch.device) -> torch.dtype:
    name = args.kv_cache_dtype
    if name == "auto":
        return loaded.dtype
    if name in ("fp8", "fp8_e4m3"):
        if device.type != "cuda":
            raise ValueError(f"kv_cache_dtype={name!r} needs a CUDA GPU (e4m3, read by the Triton kernels); "
                             f"on the {device.type} use 'int8'")
        return torch.float8_e4m3fn
    if device.type != "cpu":
        # The Triton kernels have not been checked against a 16-bit or int8 cache other than the model's dtype.
        raise ValueError(f"kv_cache_dtype={name!r} is supported on the CPU only; use 'auto' or 'fp8' on {device.type}")
    return getattr(torch, name)


def head_dim(loaded: LoadedModel) -> int:
    cfg = loaded.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def make_kv_cache(args: EngineArgs, loaded: LoadedModel, device: torch.device, num_blocks: int) -> PagedKVCache:
    cfg = loaded.config
    return PagedKVCache(cfg.num_hidden_layers, num_blocks, args.block_size, cfg.num_key_value_heads,
                        head_dim(loaded), kv_cache_dtype(args, loaded, device), device)


def bytes_per_block(args: EngineArgs, loaded: LoadedModel, device: torch.device) -> int:
    cfg = loaded.config
    return PagedKVCache.bytes_per_block(cfg.num_hidden_layers, args.block_size, cfg.num_key_value_heads,
                                        head_dim(loaded), kv_cache_dtype(args, loaded, device))


def num_kv_blocks(args: EngineArgs, loaded: LoadedModel, device: torch.device, max_model_len: int) -> int:
    """Blocks of the whole model's K/V that fit the budget (a TP rank holds a shard of each)."""
    cfg = loaded.config
    kv_dtype = kv_cache_dtype(args, loaded, device)
    per_block = bytes_per_block(args, loaded, device)
    if args.num_gpu_blocks_override:
        num_blocks = args.num_gpu_blocks_override
    else:
        budget = args.kv_cache_memory
        if budget is None:
            if device.type == "cuda" and loaded.model is not None:  # the runner is in this process
                from pagoda.exec.kv_sizing import profile_kv_budget  # a profiling forward at the token budget

                budget = profile_kv_budget(loaded.model, args, max_model_len, cfg.num_hidden_layers,
                                           cfg.num_key_value_heads, head_dim(loaded), kv_dtype, device)
            else:
                budget, why = cpu_kv_budget(per_block // args.block_size, args.max_num_seqs, max_model_len)
                logger.debug("CPU KV budget from %s", why)
        num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(f"KV cache too small: {num_blocks} blocks of {per_block} bytes")
    logger.info(
        "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
        num_blocks, args.block_size, str(kv_dtype).removeprefix("torch."), num_blocks * per_block / 2**20,
    )
    return num_blocks
