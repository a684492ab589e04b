"""Building the engine's speculative decoder from its configuration (kept apart from
`pagoda.exec.spec_decode`, which the model runner imports, because a draft model needs a runner)."""

from __future__ import annotations

import torch

from pagoda.exec.draft_model import DraftModelProposer
from pagoda.exec.model_runner import ModelRunner
from pagoda.exec.paged_attention import PagedKVCache
from pagoda.exec.spec_decode import SpecDecoder
from pagoda.model.loader import load_model


def make_spec_decoder(args, vocab_size: int, device: torch.device, kv_cache, max_model_len: int,
                      target_dtype: torch.dtype) -> SpecDecoder | None:
    """The engine's speculative decoder from its `EngineArgs`, or None when speculation is off. A
    draft model gets a KV cache of as many blocks as the target's `kv_cache`, in its own shape."""
    config = args.speculative_config
    if config is None:
        return None
    draft = None
    if config.method == "draft_model":
        loaded = load_model(config.model, target_dtype, device)
        cfg = loaded.config
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({cfg.vocab_size} tokens) is not "
                             f"the target's ({vocab_size}); a draft model must share the tokenizer")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = PagedKVCache(cfg.num_hidden_layers, kv_cache.num_blocks, kv_cache.block_size,
                             cfg.num_key_value_heads, head_dim, loaded.dtype, device)
        runner = ModelRunner(loaded.model, cache, cfg.vocab_size, args.max_num_seqs, max_model_len, device,
                             enforce_eager=True)
        draft = DraftModelProposer(runner, config.num_speculative_tokens, kv_cache.num_blocks,
                                   kv_cache.block_size, max_model_len)
    return SpecDecoder(config, vocab_size, device, draft)
