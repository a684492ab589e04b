"""Which model class serves which `architectures` entry of a config."""

from __future__ import annotations

from torch import nn

from pagoda.model.errors import ModelLoadError
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.moe import MoEForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
}


def resolve_architecture(config, source: str) -> tuple[str, type[nn.Module]]:
    archs = getattr(config, "architectures", None) or []
    archs = [archs] if isinstance(archs, str) else list(archs)
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ModelLoadError(
        f"{source}: unsupported architecture {archs or 'none given'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
