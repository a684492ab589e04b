"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on pagoda's layers, over a flattened token batch.

One class serves the family; architecture differences are flags read from the config: QKV bias
(Qwen2, or `attention_bias`), per-head q/k RMSNorm (Qwen3), tied embeddings.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import nn

from pagoda.model.attention import AttentionContext
from pagoda.model.errors import ModelLoadError
from pagoda.model.layers import RMSNorm, RotaryEmbedding, RotaryStep, silu_and_mul
from pagoda.model.pipeline import SINGLE_STAGE, PPStage, layer_range
from pagoda.model.tensor_parallel import (
    SINGLE, TPGroup, VocabParallelEmbedding, check_tp_config, shard_tensor, split_for, vocab_rows,
)

logger = logging.getLogger(__name__)


def rope_parameters(config) -> dict:
    """Rotary settings whichever way the config spells them (transformers 5 `rope_parameters`, or older)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    factors = getattr(config, "rope_freq_factors", None)  # a GGUF's rope_freqs tensor (Llama 3.1 scaling)
    if factors is not None:
        params["freq_factors"] = factors
    return params


def check_config(config) -> None:
    """Raise ValueError for a config this model cannot follow, rather than build a wrong model."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads"):
        value = getattr(config, key, None)
        if type(value) is not int or value <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and (type(head_dim) is not int or head_dim <= 0 or head_dim % 2):
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim!r}")
    if head_dim is None and config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size ({config.hidden_size}) is not a multiple of num_attention_heads ({config.num_attention_heads})"
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (this model computes SiLU)")


class LlamaAttention(nn.Module):
    """Under tensor parallelism, this rank's heads (see tensor_parallel): q/k/v column-parallel,
    o_proj row-parallel and summed over the ranks."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        split = split_for(config, tp)
        self.num_heads, self.num_kv_heads = split.q_count, split.kv_count
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: RotaryStep, attn: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))


class LlamaMLP(nn.Module):
    """`intermediate_size`: the config's by default (an MoE's shared expert has its own)."""

    def __init__(self, config, tp: TPGroup = SINGLE, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.tp = tp
        bias = getattr(config, "mlp_bias", False)
        inter = split_for(config, tp, intermediate_size).inter_count
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # A packed CPU linear may fuse the activation into its GEMM (exec/cpu_linear.PackedLinear).
        h = gate_up.silu_and_mul(x) if getattr(gate_up, "fuses_silu", False) else silu_and_mul(gate_up(x))
        return self.tp.all_reduce(self.down_proj(h))


# (config, global layer index, tp) -> the layer's feed-forward block: a dense MLP, or an MoE's (moe.py)
MLPFactory = Callable[[object, int, TPGroup], nn.Module]


def dense_mlp(config, layer: int, tp: TPGroup) -> nn.Module:
    return LlamaMLP(config, tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool, tp: TPGroup = SINGLE,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp) if mlp is None else mlp

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep, attn: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's output, not yet added to the residual stream (None before the
        first layer, where h is the embedding). Returns (this layer's output, residual), so that each
        add goes with the RMSNorm after it (one fused pass on the CPU)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Under pipeline parallelism, this stage's layers (the others are empty placeholders, so that
    names keep their layer numbers); the embedding and the norm only on the stages that use them."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool, tp: TPGroup = SINGLE, pp: PPStage = SINGLE_STAGE,
                 tied_head: bool = False, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.pp = pp
        self.hidden_size = config.hidden_size
        self.first_layer, self.end_layer = layer_range(config.num_hidden_layers, pp.stage, pp.size)
        if not pp.is_first and not (pp.is_last and tied_head):
            self.embed_tokens = None
        elif tp.size > 1:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        else:
            # Passing the (uninitialised) weight skips nn.Embedding's normal_() init: on the meta device
            # that init goes through Python decompositions whose first use imports ~1.4 s of torch modules.
            self.embed_tokens = nn.Embedding(
                config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
            )
        first, end = self.first_layer, self.end_layer
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - first, qkv_bias, qk_norm, tp, make_mlp(config, i, tp))
            if first <= i < end else nn.Module()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(head_dim, rope_parameters(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor | None:
        """Hidden states [T, H]; None on a stage before the last, which hands them to the next."""
        pp = self.pp
        if pp.is_first:
            h, residual = self.embed_tokens(input_ids), None
        else:
            h, residual = pp.recv(input_ids.shape[0], self.hidden_size, self.rotary_dtype)
        rope = self.rotary.for_step(positions, h.dtype)
        for layer in self.layers[self.first_layer : self.end_layer]:
            h, residual = layer(h, residual, rope, attn)
        if not pp.is_last:
            pp.send(h, residual)
            return None
        return self.norm(h) if residual is None else self.norm.add_forward(h, residual)[0]

    @property
    def rotary_dtype(self) -> torch.dtype:
        """The activations' dtype: the parameters'."""
        return next(self.parameters()).dtype


# checkpoint name suffix -> (our parameter suffix, shard index within the merged parameter)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    def __init__(self, config, architecture: str = "LlamaForCausalLM", tp: TPGroup = SINGLE,
                 pp: PPStage = SINGLE_STAGE) -> None:
        super().__init__()
        check_config(config)
        check_tp_config(config, tp.size)
        self.config = config
        self.tp, self.pp = tp, pp
        if config.num_hidden_layers < pp.size:
            raise ValueError(f"pipeline_parallel_size {pp.size} exceeds the model's {config.num_hidden_layers} layers")
        qkv_bias, qk_norm = self.attention_flags(config, architecture)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, qkv_bias, qk_norm, tp, pp, self.tie_word_embeddings, self.make_mlp)
        rows = vocab_rows(config.vocab_size, tp)
        has_head = pp.is_last and not self.tie_word_embeddings
        self.lm_head = nn.Linear(config.hidden_size, rows, bias=False) if has_head else None
        # Under TP the head gives this rank's slice of the vocabulary; the runner's packed head
        # (exec/cpu_linear) gathers its output through this too. None: nothing to gather.
        self.gather_logits = self._gather_logits if tp.size > 1 else None

    @staticmethod
    def attention_flags(config, architecture: str) -> tuple[bool, bool]:
        """(q/k/v have a bias, q and k have a per-head RMSNorm) for this architecture."""
        qkv_bias = architecture == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        return qkv_bias, architecture == "Qwen3ForCausalLM"

    make_mlp: MLPFactory = staticmethod(dense_mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [T] for the step's flattened tokens; returns hidden states [T, H]."""
        return self.model(input_ids, positions, attn)

    def lm_head_weight(self) -> torch.Tensor | None:
        """None on a pipeline stage before the last, which has no head."""
        if not self.pp.is_last:
            return None
        # A head kept quantized (model/quantized.QuantLinear) has no float weight: None here too.
        return self.model.embed_tokens.weight if self.lm_head is None else getattr(self.lm_head, "weight", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None and not isinstance(self.lm_head, nn.Linear):
            return self.lm_head(hidden)  # quantized: its own kernel
        logits = hidden @ self.lm_head_weight().t()
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def _gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice, in order, without the last one's padding rows."""
        return self.tp.all_gather_last(local)[..., : self.config.vocab_size]

    def _shard_sizes(self, merged: str, param: torch.Tensor) -> list[int]:
        attn = self.model.layers[self.model.first_layer].self_attn
        if merged == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = param.shape[0] // 2  # gate and up halves: a dense MLP's, or an MoE's shared expert's
        return [inter, inter]

    def _checkpoint_params(self) -> dict[str, torch.Tensor]:
        """The parameters load_weights fills from checkpoint names (all of them here)."""
        return dict(self.named_parameters())

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_tensor(name, tensor, self.config, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Copy (name, tensor) pairs with Hugging Face names into the merged parameters, one at a time."""
        params = self._checkpoint_params()
        loaded: dict[str, str] = {}  # "target#offset" -> the checkpoint name that filled it
        tied_head = None
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self._holds(name):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                if tied_head is not None:
                    raise ModelLoadError(f"{source}: tensor {name!r} appears more than once")
                tied_head = self._shard(name, tensor)  # compared with the embedding once loaded
                continue
            tensor = self._shard(name, tensor)
            target, offset, rows = name, 0, None
            parts = name.rsplit(".", 2)
            if len(parts) == 3 and parts[1] in _MERGED:
                merged, shard = _MERGED[parts[1]]
                target = f"{parts[0]}.{merged}.{parts[2]}"
                sizes = self._shard_sizes(merged, params[target]) if target in params else [0, 0, 0]
                offset, rows = sum(sizes[:shard]), sizes[shard]
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} for this architecture")
            dest = param.data if rows is None else param.data.narrow(0, offset, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            key = f"{target}#{offset}"
            if key in loaded:
                raise ModelLoadError(f"{source}: tensor {name!r} appears more than once")
            dest.copy_(tensor)
            loaded[key] = name
        expected = {}  # "target#offset" -> checkpoint name, for the message
        for pname in params:
            base = pname.rsplit(".", 2)
            if len(base) == 3 and base[1] in ("qkv_proj", "gate_up_proj"):
                sizes = self._shard_sizes(base[1], params[pname])
                for part, (merged, shard) in _MERGED.items():
                    if merged == base[1]:
                        expected[f"{pname}#{sum(sizes[:shard])}"] = f"{base[0]}.{part}.{base[2]}"
            else:
                expected[f"{pname}#0"] = pname
        missing = [expected[k] for k in expected if k not in loaded]
        if missing:
            names = ", ".join(missing[:5])
            raise ModelLoadError(f"{source}: missing tensor(s) {names}{' ...' if len(missing) > 5 else ''}")
        if tied_head is not None:
            self._untie_if_different(tied_head, source)

    def _holds(self, name: str) -> bool:
        """Whether this pipeline stage holds checkpoint tensor `name` (every stage, without PP)."""
        if self.pp.size == 1:
            return True
        if name.startswith("model.layers."):
            return self.model.first_layer <= int(name.split(".")[2]) < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        return self.pp.is_last  # the final norm, lm_head

    def _untie_if_different(self, head: torch.Tensor, source: str) -> None:
        """The config ties the head to the embedding but the checkpoint also holds lm_head.weight. As
        transformers does, a head equal to the embedding stays tied, and a different one is used."""
        embed = self.model.embed_tokens.weight
        if tuple(head.shape) != tuple(embed.shape):
            raise ModelLoadError(
                f"{source}: tensor 'lm_head.weight' has shape {tuple(head.shape)}, expected {tuple(embed.shape)}"
            )
        if torch.equal(head.to(embed.device, embed.dtype), embed.data):
            return
        logger.warning(
            "%s: config.json ties lm_head to the embedding, but the checkpoint's lm_head.weight differs; "
            "using it (as transformers does). Set tie_word_embeddings to false to silence this.", source
        )
        self.lm_head = nn.utils.skip_init(
            nn.Linear, embed.shape[1], embed.shape[0], bias=False, device=embed.device, dtype=embed.dtype
        )
        self.lm_head.weight.requires_grad_(embed.requires_grad)
        with torch.no_grad():
            self.lm_head.weight.copy_(head)
        self.tie_word_embeddings = False
