"""Tiny random-weight models of each supported architecture, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny_config(arch: str, max_position_embeddings: int = 512):
    """`max_position_embeddings` bounds the max_model_len an engine accepts for the model (512 keeps the
    default max_model_len of the tests that rely on it small)."""
    import transformers

    common = {**_COMMON, "max_position_embeddings": max_position_embeddings}
    if arch == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "llama_linear":
        rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    # Mixtures of experts: 4 experts of 32, top-2 (so some get no token in a short step).
    moe = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=4,
                                          sliding_window=None, **moe)
    if arch == "qwen2_moe":  # a shared expert with its gate; top-k weights not renormalised
        return transformers.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, norm_topk_prob=False, **moe)
    if arch == "qwen3_moe":  # renormalised; three layers: 0 dense (mlp_only_layers), 1 and 2 sparse
        return transformers.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=32, num_experts=4,
                                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0], **moe)
    raise ValueError(arch)


def save_tiny_model(arch: str, folder: Path, seed: int = 0, shard: bool = False, max_position_embeddings: int = 512,
                    **overrides):
    """Random weights with a larger init than the default so greedy choices are not near-ties. The
    weights do not depend on `max_position_embeddings` (rotary embeddings have no parameters).
    `overrides`: config fields to change (e.g. num_key_value_heads=1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, max_position_embeddings)
    for key, value in overrides.items():
        setattr(config, key, value)
    if "num_hidden_layers" in overrides and getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers  # one per layer
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": "100KB"} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return model.eval()


def save_tiny_tokenizer(folder: Path, vocab_size: int = 512) -> None:
    """A word-level tokenizer over words w0..w{vocab-1} (w0 = <unk>, w1 = <s>, w2 = </s>), so a tiny model
    served over HTTP streams non-empty text for every token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(folder)
