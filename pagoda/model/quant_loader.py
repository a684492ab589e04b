"""Loading a model whose weights stay quantized in memory (`--quantization`, vLLM's flag).

`gguf`: a GGUF's linear, embedding and MoE expert weights in a format with kernels
(quantized.GGUF_KERNEL_TYPES) are kept as the file's blocks, never dequantized, so resident weight
memory is about the file's size; norms, routers and any float tensors load as usual. `int8` (and
`fp8`, e4m3 on a GPU): any model's linears and experts (not the embedding, the LM head or an MoE's
router; a width not a multiple of 32 under int8) become int8 (fp8) with one float32 scale per
output channel, computed at load. The execution layer gives each format its kernels (CPU: C++;
CUDA: Triton and torch._scaled_mm).
"""

from __future__ import annotations

import logging
import mmap
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from pagoda.model.errors import ModelLoadError
from pagoda.model.mmap_weights import release_pages
from pagoda.model.moe import FusedMoE, is_moe
from pagoda.model.quantized import (
    BLOCK_LAYOUT, GGUF_KERNEL_TYPES, QUANTIZATIONS, QuantEmbedding, QuantExperts, QuantizedTensor, QuantLinear,
    quantize_fp8, quantize_int8,
)

logger = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF tensor name -> (our module under model.layers.N, shard within it, shards): the merged
# projections take several GGUF tensors each.
_LAYER_TARGETS = {
    "attn_q": ("self_attn.qkv_proj", 0, 3), "attn_k": ("self_attn.qkv_proj", 1, 3),
    "attn_v": ("self_attn.qkv_proj", 2, 3), "attn_output": ("self_attn.o_proj", 0, 1),
    "ffn_gate": ("mlp.gate_up_proj", 0, 2), "ffn_up": ("mlp.gate_up_proj", 1, 2),
    "ffn_down": ("mlp.down_proj", 0, 1),
    "ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0, 2),
    "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1, 2),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", 0, 1),
}
# An MoE layer's experts, stacked over the experts in 3-D tensors: all three go to the FusedMoE.
_EXPERT_TARGETS = {"ffn_gate_exps": ("mlp", 0, 3), "ffn_up_exps": ("mlp", 1, 3), "ffn_down_exps": ("mlp", 2, 3)}
# An MoE's routers stay in float: a rounded router score would move tokens between experts.
_ROUTERS = ("gate", "shared_expert_gate")
_TOP_TARGETS = {"token_embd": ("model.embed_tokens", 0, 1), "output": ("lm_head", 0, 1)}


def check_quantization(quantization: str | None, device: torch.device, source_is_gguf: bool,
                       parallel: int = 1) -> None:
    """One line (ModelLoadError) for a quantization this model, device or layout cannot run."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization {quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"quantization {quantization} runs on the CPU or a CUDA GPU; the device is {device.type}")
    if quantization == "fp8":
        if device.type != "cuda":
            raise ModelLoadError(f"quantization fp8 needs a CUDA GPU (e4m3 weights); the device is {device.type}")
        if source_is_gguf:
            raise ModelLoadError("quantization fp8 needs a Hugging Face folder of float weights; "
                                 "a .gguf keeps its own blocks with --quantization gguf")
    if quantization == "gguf" and not source_is_gguf:
        raise ModelLoadError("quantization gguf needs a .gguf model; for a Hugging Face folder use --quantization int8")
    if parallel > 1:
        raise ModelLoadError(f"quantization {quantization} runs on one rank only so far (tensor/pipeline parallel size 1)")


def _target(gguf_name: str, ndim: int) -> tuple[str, int, int] | None:
    targets = _LAYER_TARGETS if ndim == 2 else _EXPERT_TARGETS if ndim == 3 else {}
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in targets:
        module, shard, shards = targets[m.group(2)]
        return f"model.layers.{m.group(1)}.{module}", shard, shards
    if ndim != 2:
        return None
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m.group(1) in _TOP_TARGETS:
        return _TOP_TARGETS[m.group(1)]
    return None


def gguf_kept_tensors(reader, path) -> dict[str, tuple[str, int, int]]:
    """The GGUF tensors to keep quantized -> their target module. A merged projection is kept only
    when all its parts have kernels; a quantized type without one is refused, naming it."""
    groups: dict[str, list[tuple[str, str]]] = {}
    targets: dict[str, tuple[str, int, int]] = {}
    for t in reader.tensors:
        target = _target(t.name, len(t.shape))
        if target is None:
            continue
        kind = t.tensor_type.name
        if kind not in GGUF_KERNEL_TYPES and kind not in _FLOAT_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has GGUF type {kind}, which --quantization gguf cannot run "
                f"quantized (supported: {', '.join(GGUF_KERNEL_TYPES)}); without --quantization it is dequantized"
            )
        groups.setdefault(target[0], []).append((t.name, kind))
        targets[t.name] = target
    kept = {}
    for members in groups.values():
        if all(kind in GGUF_KERNEL_TYPES for _, kind in members):
            kept.update({name: targets[name] for name, _ in members})
    return kept


def gguf_blocks(path, config, types: tuple[str, ...], modules: set[str] | None = None) -> dict[str, list[QuantizedTensor]]:
    """The blocks of the GGUF's 2-D weights of the given types as they lie in the file, by target
    module (a merged projection's parts in order, only where all of them are of those types; only the
    `modules` named, if given): for the execution layer to keep beside a dequantized model's weights
    (exec/gguf_block_linears.py)."""
    from pagoda.model.gguf_file import _field, _packed, open_gguf

    reader = open_gguf(path, light=True)
    arch = _field(reader, "general.architecture")
    found: dict[str, dict[int, QuantizedTensor | None]] = {}
    counts: dict[str, int] = {}
    for t in reader.tensors:
        target = _target(t.name, len(t.shape))
        if target is None or (modules is not None and target[0] not in modules):
            continue
        module, shard, count = target
        counts[module] = count
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))
        found.setdefault(module, {})[shard] = _packed(t, kind, shape, arch, config) if kind in types else None
    release_file_pages(reader)
    return {module: [parts[i] for i in range(counts[module])] for module, parts in found.items()
            if sorted(parts) == list(range(counts[module])) and all(p is not None for p in parts.values())}


def replace_gguf_modules(net: nn.Module, kept: dict[str, tuple[str, int, int]], dtype: torch.dtype) -> None:
    """Swap (on the meta device, before any storage exists) the modules whose weights stay packed."""
    for module_path in {target for target, _, _ in kept.values()}:
        parent_path, _, attr = module_path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        old = getattr(parent, attr)
        if isinstance(old, FusedMoE):
            # No float experts will be loaded: they need no storage (install_packed sets them).
            old.packed_at_load = True
            old.w13_weight = nn.Parameter(old.w13_weight.new_empty(0, *old.w13_weight.shape[1:]), requires_grad=False)
            old.w2_weight = nn.Parameter(old.w2_weight.new_empty(0, *old.w2_weight.shape[1:]), requires_grad=False)
            continue
        if isinstance(old, nn.Embedding):
            new = QuantEmbedding(old.num_embeddings, old.embedding_dim, dtype)
        elif isinstance(old, nn.Linear):
            with torch.device("meta"):
                new = QuantLinear(old.in_features, old.out_features, old.bias is not None, dtype)
        else:
            raise ModelLoadError(f"{module_path}: cannot hold a quantized weight ({type(old).__name__})")
        setattr(parent, attr, new)
    embed = getattr(net.model, "embed_tokens", None)
    if isinstance(embed, QuantEmbedding) and net.lm_head is None:
        # The tied head reads the embedding's blocks: one copy serves both.
        net.lm_head = QuantLinear(embed.embedding_dim, embed.num_embeddings)


def divert_quantized(weights: Iterable, kept: dict[str, tuple[str, int, int]], by_hf_name: dict[str, str],
                     pending: dict[str, dict[int, QuantizedTensor]]) -> Iterator:
    """Pass float tensors on (to load_weights); collect the packed ones by target module and shard."""
    for name, tensor in weights:
        if isinstance(tensor, QuantizedTensor):
            target, shard, _ = kept[by_hf_name[name]]
            pending.setdefault(target, {})[shard] = tensor
        else:
            yield name, tensor


def install_packed(net: nn.Module, kept: dict[str, tuple[str, int, int]], pending: dict[str, dict[int, QuantizedTensor]],
                   path) -> None:
    shards = {target: count for target, _, count in kept.values()}
    for target, count in shards.items():
        got = pending.get(target, {})
        if sorted(got) != list(range(count)):
            raise ModelLoadError(f"{path}: {target} lacks some of its {count} quantized parts")
        module = net.get_submodule(target)
        parts = [got[i] for i in range(count)]
        try:
            if isinstance(module, QuantEmbedding):
                module.weight_q = parts[0]
            elif isinstance(module, FusedMoE):
                module.packed_experts = _stacked_experts(module, parts)
            else:
                module.set_parts(parts)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: {target}: {exc}") from None
    embed = getattr(net.model, "embed_tokens", None)
    if isinstance(embed, QuantEmbedding) and isinstance(net.lm_head, QuantLinear) and not net.lm_head.parts:
        net.lm_head.set_parts([embed.weight_q])


def _stacked_experts(layer: FusedMoE, parts: list[QuantizedTensor]) -> QuantExperts:
    gate, up, down = parts
    experts, inter, hidden = layer.num_experts, layer.inter_count, layer.gate.in_features
    want = [(experts * inter, hidden)] * 2 + [(experts * hidden, inter)]
    got = [(p.rows, p.cols) for p in parts]
    if got != want:
        raise ValueError(f"expert tensors (gate, up, down) are {got}, expected {want} (rows, columns)")
    return QuantExperts.from_stacked(gate, up, down, experts)


def release_file_pages(reader) -> None:
    """Drop the GGUF mappings' resident pages (each part's of a split file): every packed tensor
    was copied out of them."""
    for part in getattr(reader, "parts", [reader]):
        mapping = getattr(getattr(part, "data", None), "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # a closed or foreign mapping: only memory is at stake
                pass


def _fits(quantize, *widths: int) -> bool:
    """int8 rows are read in blocks of 32 values (BLOCK_LAYOUT): a weight of another width stays float."""
    return quantize is not quantize_int8 or all(w % BLOCK_LAYOUT["int8"][0] == 0 for w in widths)


def quantize_linears(net: nn.Module, quantize=quantize_int8) -> int:
    """Replace every nn.Linear but the LM head and MoE routers with a QuantLinear of
    `quantize(weight)` (int8 or fp8), and every MoE layer's experts with QuantExperts of theirs;
    returns how many linears."""
    targets = [
        (parent, name, child)
        for parent in net.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and name != "lm_head" and not (isinstance(parent, FusedMoE) and name in _ROUTERS)
        and _fits(quantize, child.in_features)
    ]
    dropped = []
    for parent, name, child in targets:
        new = QuantLinear(child.in_features, child.out_features, False)
        new.set_parts([quantize(child.weight)])
        new.bias = child.bias
        setattr(parent, name, new)
        dropped.append(child.weight)
    moe = [m for m in net.modules() if isinstance(m, FusedMoE) and m.packed_experts is None
           and _fits(quantize, m.w13_weight.shape[2], m.w2_weight.shape[2])]
    for layer in moe:
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        layer.packed_experts = QuantExperts([[quantize(w)] for w in w13], [quantize(w) for w in w2])
        dropped += [w13, w2]
        layer.w13_weight.data, layer.w2_weight.data = w13.new_empty(0, *w13.shape[1:]), w2.new_empty(0, *w2.shape[1:])
    release_pages(dropped)  # weights mapped from the load cache would otherwise stay resident
    return len(targets)


def load_packed_gguf(net: nn.Module, path, config, dtype: torch.dtype, device: torch.device, materialize) -> nn.Module:
    """`net` (built on the meta device) with the GGUF's weights: kernel-ready blocks packed, the
    rest dequantized to `dtype`; `materialize(net, device)` fills in what the model computes itself."""
    from pagoda.model.gguf_file import _hf_name, gguf_tensors, open_gguf

    reader = open_gguf(path, light=True)
    kept = gguf_kept_tensors(reader, path)
    replace_gguf_modules(net, kept, dtype)
    net = net.to_empty(device=device)
    materialize(net, device)
    pending: dict[str, dict[int, QuantizedTensor]] = {}
    by_hf_name = {_hf_name(name, moe=is_moe(config)): name for name in kept}
    weights = gguf_tensors(reader, path, config, dtype, keep_quantized=frozenset(kept))
    with torch.no_grad():
        net.load_weights(divert_quantized(weights, kept, by_hf_name, pending), source=str(path))
    install_packed(net, kept, pending, path)
    release_file_pages(reader)
    return net


def requantize(loaded, quantization: str | None):
    """A loaded model (loader.LoadedModel) with its linears made int8 (fp8) under --quantization int8 (fp8)."""
    if quantization in ("int8", "fp8"):
        quantize_linears(loaded.model, quantize_fp8 if quantization == "fp8" else quantize_int8)
    return loaded
