"""Reading GGUF files: metadata becomes a transformers config, tensors are dequantized and renamed."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pagoda.model.errors import ModelLoadError
from pagoda.model.quantized import QuantizedTensor

# GGUF architecture -> (transformers config class name, architecture name)
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
_MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")  # llama.cpp writes Mixtral as "llama" with experts

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
# Mixtures of experts only (a dense model refuses these): the router, each projection stacked over
# the experts ([E, I, H] or [E, H, I]), Qwen2-MoE's shared expert and its gate.
_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# GGUF tensors that are not parameters: rope_freqs becomes the config's rope_freq_factors.
_DERIVED = ("rope_freqs.weight",)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K")


# llama.cpp's gguf-split (and gguf-py's writer) name the parts of a split model so.
_SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf")


class SplitGGUF:
    """A model split over several GGUF files, read as one: the first part's metadata, every part's
    tensors in order (`parts`: the readers, each mapping its own file)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.fields = parts[0].fields
        self.tensors = [t for part in parts for t in part.tensors]


def split_parts(path: Path) -> list[Path]:
    """The files of the model whose first part is `path` (just `path` unless it is named as a part)."""
    m = _SPLIT_NAME.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if int(m["index"]) != 1:
        raise ModelLoadError(f"{path}: part {int(m['index'])} of a split GGUF; give its first part, "
                             f"{m['stem']}-00001-of-{m['count']}.gguf")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: split GGUF of {count} parts lacks {', '.join(missing)}")
    return parts


def open_gguf(path: Path, light: bool = False):
    """Parse a GGUF file (or every part of a split one) once per process (parsing the tokenizer's
    arrays takes seconds); a file replaced or rewritten since is parsed again. `light`: without the
    arrays of strings (gguf_index.GGUFIndex), for loading weights without the tokenizer."""
    parts = split_parts(Path(path))
    signatures = []
    for part in parts:
        try:
            st = part.stat()
        except OSError as exc:
            raise ModelLoadError(f"{part}: cannot read ({exc})") from None
        signatures.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return _open_gguf(tuple(parts), tuple(signatures), light)


@lru_cache(maxsize=2)
def _open_gguf(paths: tuple[Path, ...], signatures: tuple, light: bool = False):
    import gguf

    from pagoda.model.gguf_index import GGUFIndex

    readers = []
    for path in paths:
        try:
            readers.append(GGUFIndex(path) if light else gguf.GGUFReader(str(path)))
        except Exception as exc:  # the reader raises assorted errors on a file that is not GGUF
            raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    return readers[0] if len(readers) == 1 else SplitGGUF(readers)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _number(reader, path: Path, key: str, kind, default=None):
    """A numeric metadata value; ModelLoadError naming the key when it is required and absent, or not
    a number."""
    value = _field(reader, key, default)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}")
    if isinstance(value, (str, bytes, list)):
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is {value!r}, not a number")
    return kind(value)


def _rope_parameters(reader, path: Path, arch: str, theta: float) -> dict:
    """Rotary scaling from the GGUF: rope.scaling.* keys (linear), as transformers would spell it."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _number(reader, path, f"{arch}.rope.scaling.factor", float),
                "rope_theta": theta}
    raise ModelLoadError(f"{path}: GGUF rope scaling type {kind!r} is not supported (supported: none, linear)")


def _rope_freq_factors(reader, path: Path) -> list[float] | None:
    """The per-frequency divisors of a `rope_freqs` tensor (how llama.cpp stores Llama 3.1 scaling)."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name != "F32":
        raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' has GGUF type {tensor.tensor_type.name}, expected F32")
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' holds values that are not positive finite numbers")
    return [float(x) for x in factors]


def _moe_kwargs(reader, path: Path, arch: str, names: set[str]) -> dict:
    """The config fields of a mixture of experts (none for a dense model). Routing as llama.cpp does
    it: top-k weights renormalised for Mixtral and Qwen3-MoE, not for Qwen2-MoE, unless the file's
    expert_weights_norm says otherwise; every layer sparse."""
    count = _field(reader, f"{arch}.expert_count")
    if not count:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch + '.expert_count'!r}")
        return {}
    used = _number(reader, path, f"{arch}.expert_used_count", int)
    if arch == "llama":
        return {"num_local_experts": int(count), "num_experts_per_tok": used}
    out = {"num_experts": int(count), "num_experts_per_tok": used, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "moe_intermediate_size": _number(reader, path, f"{arch}.expert_feed_forward_length", int),
           "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", arch == "qwen3moe"))}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = _number(reader, path, f"{arch}.expert_shared_feed_forward_length", int)
        out["qkv_bias"] = "blk.0.attn_q.bias" in names
    return out


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
    experts = _moe_kwargs(reader, path, arch, names)
    if experts and arch == "llama":
        config_cls, hf_arch = _MIXTRAL
    heads = _number(reader, path, f"{arch}.attention.head_count", int)
    hidden = _number(reader, path, f"{arch}.embedding_length", int)
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    theta = _number(reader, path, f"{arch}.rope.freq_base", float, 10000.0)
    kwargs = dict(
        architectures=[hf_arch],
        vocab_size=_number(reader, path, f"{arch}.vocab_size", int, vocab),
        hidden_size=hidden,
        intermediate_size=_number(reader, path, f"{arch}.feed_forward_length", int),
        num_hidden_layers=_number(reader, path, f"{arch}.block_count", int),
        num_attention_heads=heads,
        num_key_value_heads=_number(reader, path, f"{arch}.attention.head_count_kv", int, heads),
        rms_norm_eps=_number(reader, path, f"{arch}.attention.layer_norm_rms_epsilon", float, 1e-6),
        max_position_embeddings=_number(reader, path, f"{arch}.context_length", int, 2048),
        rope_theta=theta,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    kwargs.update(experts)
    rope = _rope_parameters(reader, path, arch, theta)
    if rope["rope_type"] != "default":
        kwargs["rope_parameters"] = rope
    key_len = _field(reader, f"{arch}.attention.key_length")
    if key_len is not None:
        kwargs["head_dim"] = _number(reader, path, f"{arch}.attention.key_length", int)
    factors = _rope_freq_factors(reader, path)
    if factors is not None:
        kwargs["rope_freq_factors"] = factors
    try:
        config = getattr(transformers, config_cls)(**kwargs)
    except Exception as exc:  # transformers' validation of the values (e.g. heads that do not divide)
        raise ModelLoadError(f"{path}: GGUF metadata does not make a valid {hf_arch} config ({exc})") from None
    head_dim = getattr(config, "head_dim", None) or hidden // max(heads, 1)
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and _number(reader, path, f"{arch}.rope.dimension_count", int) != head_dim:
        raise ModelLoadError(
            f"{path}: rotary embedding over {rope_dims} of {head_dim} head dimensions is not supported"
        )
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None  # GGUF says nothing of it; llama.cpp attends over everything too
    return config


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp's converter gives Q/K of Llama models (interleaved rotary pairs)."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(name: str, moe: bool = False) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        inner = _LAYER_NAMES.get(m.group(2)) or (_MOE_LAYER_NAMES.get(m.group(2)) if moe else None)
        return None if inner is None else f"model.layers.{m.group(1)}.{inner}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def gguf_tensors(reader, path: Path, config, dtype: torch.dtype,
                 keep_quantized: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (Hugging Face name, dequantized tensor) pairs, one tensor at a time; the GGUF tensors
    named in `keep_quantized` come as their packed blocks (a QuantizedTensor) instead."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    moe = getattr(config, "num_local_experts", None) is not None or getattr(config, "num_experts", None) is not None
    for t in reader.tensors:
        name = _hf_name(t.name, moe)
        if name is None:
            if t.name in _DERIVED or re.fullmatch(r"blk\.\d+\.attn_rot_embd(\.weight)?", t.name):
                continue  # read into the config (rope_freqs), or recomputed from it
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for a {arch} model")
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has GGUF type {kind}, which pagoda cannot dequantize "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.name in keep_quantized:
            yield name, _packed(t, kind, shape, arch, config)
            continue
        if kind == "BF16":
            raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            array = raw.view(np.float32).reshape(shape)
        else:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(1, -1)  # a [1, H] linear, which llama.cpp stores as a vector
        if arch in ("llama", "mistral"):
            if t.name.endswith("attn_q.weight"):
                array = _unpermute_rotary(array, config.num_attention_heads)
            elif t.name.endswith("attn_k.weight"):
                array = _unpermute_rotary(array, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(array, copy=True) if not array.flags.writeable else array).to(dtype)


def _packed(t, kind: str, shape: tuple[int, ...], arch: str, config) -> QuantizedTensor:
    """A tensor's blocks as they lie in the file, rows in Hugging Face order (a copy, so the file's
    pages need not stay resident). A 3-D one (an MoE's `ffn_*_exps`, [E, rows, cols]) comes as its
    experts' rows one after another."""
    rows = np.asarray(t.data).reshape(int(np.prod(shape[:-1])), -1)
    if arch in ("llama", "mistral"):
        if t.name.endswith("attn_q.weight"):
            rows = _unpermute_rotary(rows, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            rows = _unpermute_rotary(rows, config.num_key_value_heads)
    data = torch.from_numpy(np.array(rows, dtype=np.uint8, copy=True))
    return QuantizedTensor(kind, rows.shape[0], shape[-1], data)
