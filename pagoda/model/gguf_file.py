"""Reading GGUF files: metadata becomes a transformers config, tensors are dequantized and renamed."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pagoda.model.errors import ModelLoadError

# GGUF architecture -> (transformers config class name, architecture name)
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


@lru_cache(maxsize=2)
def open_gguf(path: Path):
    """Parse a GGUF file once per process (parsing the tokenizer's arrays takes seconds)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises assorted errors on a file that is not GGUF
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, path: Path):
    """Build the transformers config that the GGUF metadata describes."""
    import transformers

    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHS))}"
        )
    config_cls, hf_arch = _ARCHS[arch]
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    kwargs = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    key_len = _field(reader, f"{arch}.attention.key_length")
    if key_len is not None:
        kwargs["head_dim"] = int(key_len)
    config = getattr(transformers, config_cls)(**kwargs)
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None  # GGUF says nothing of it; llama.cpp attends over everything too
    return config


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp's converter gives Q/K of Llama models (interleaved rotary pairs)."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        inner = _LAYER_NAMES.get(m.group(2))
        return None if inner is None else f"model.layers.{m.group(1)}.{inner}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def gguf_tensors(reader, path: Path, config, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, dequantized tensor) pairs, one tensor at a time."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has GGUF type {kind}, which pagoda cannot dequantize "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape = tuple(int(d) for d in reversed(t.shape))
        if kind == "BF16":
            raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            array = raw.view(np.float32).reshape(shape)
        else:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch in ("llama", "mistral"):
            if t.name.endswith("attn_q.weight"):
                array = _unpermute_rotary(array, config.num_attention_heads)
            elif t.name.endswith("attn_k.weight"):
                array = _unpermute_rotary(array, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(array, copy=True) if not array.flags.writeable else array).to(dtype)
