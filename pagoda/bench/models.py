"""Random-weight models of a given shape, saved as Hugging Face folders (config + safetensors).

Speed depends on shapes, not on weight values, so a random model of the right shape stands in for
checkpoints that cannot be downloaded here (docs/architecture.md, "Models without a network").
A fixed seed makes the weights, and so the greedy outputs, the same on every machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Each preset: the transformers config class name and its arguments.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # The smoke-test model: seconds to build and to run.
    "tiny-llama": (
        "LlamaConfig",
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        ),
    ),
    # The GPU-offline workload's model: Qwen3-0.6B's shape (issue 7).
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    # About 1.2B parameters in Llama-3.2-1B's shape: the tensor-parallel overhead benchmark (issue 23).
    "llama-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}


def make_random_model(preset: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32", **overrides: Any) -> Path:
    """Build the preset's config (with `overrides`), initialise weights from `seed` and save it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    cls_name, kwargs = PRESETS[preset]
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    # Seed the global generator: transformers' initialisers draw from it.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out
