"""Building blocks of decoder models: RMSNorm, rotary embedding (default, linear, Llama-3 scaling), SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        # Normalise in float32 and round before the weight, as the reference does, so bf16 matches it.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies for rotary embedding; `rope` holds rope_theta, rope_type and its scaling keys."""
    theta = float(rope.get("rope_theta", 10000.0))
    # Always on the CPU, even while the model is built under torch.device("meta"): arithmetic on
    # meta tensors runs Python reference kernels whose first use imports torch._dynamo (~1.5 s).
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX-style) rotary embedding; cos/sin are computed per step for the step's positions."""

    def __init__(self, head_dim: int, rope: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)

    def materialize(self, device: torch.device) -> None:
        """Recompute the (float32) frequencies after the model was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        # [T, 1, D]: broadcast over heads.
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
