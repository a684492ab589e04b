"""Building blocks of decoder models: RMSNorm, rotary embedding (default, linear, Llama-3 scaling), SwiGLU.

float32 and bfloat16 on the CPU go through the fused kernels of `cpu_layer_ops` where they build; the
PyTorch code below is the reference they are tested against and the path for every other dtype and
device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.cpu_layer_ops import FUSED_DTYPES, fused_ops_for, load_layer_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _fused_ops(self, x: torch.Tensor):
        return fused_ops_for(x) if x.dim() == 2 and self.weight.dtype == x.dtype else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._fused_ops(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the fused kernel does it in place, in x and residual."""
        ops = self._fused_ops(x)
        if ops is not None:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in PyTorch. Below float32 it normalises in float32 and rounds before the weight, as
    transformers does, so that bf16 matches it."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies for rotary embedding; `rope` holds rope_theta, rope_type and its scaling keys."""
    theta = float(rope.get("rope_theta", 10000.0))
    # Always on the CPU, even while the model is built under torch.device("meta"): arithmetic on
    # meta tensors runs Python reference kernels whose first use imports torch._dynamo (~1.5 s).
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    factors = rope.get("freq_factors")
    if factors is not None:  # per-frequency divisors, as a GGUF's rope_freqs tensor gives them
        factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope frequency factors: {tuple(factors.shape)} values for {inv_freq.numel()} frequencies")
        inv_freq = inv_freq / factors
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
    """Rotate-half (NeoX-style) rotary embedding: cos/sin per step for the step's positions, or (fused
    path) rows of a cached cos/sin table."""

    def __init__(self, head_dim: int, rope: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        self._table = torch.empty(0, head_dim)  # see table(); not a buffer: rebuilt on demand, never saved

    def materialize(self, device: torch.device) -> None:
        """Recompute the (float32) frequencies after the model was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.rope).to(device)
        self._table = torch.empty(0, self.head_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        # [T, 1, D]: broadcast over heads.
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)

    def table(self, num_positions: int) -> torch.Tensor:
        """[positions, D] rows [cos(p f), sin(p f)] for p < at least num_positions, for the fused kernel.

        Grown by doubling when a step reaches past it. It pays because cos/sin of large arguments take
        a slow reduction path: per step they cost more than all of the rotary arithmetic."""
        if self._table.shape[0] < num_positions:
            size = max(1024, 1 << (num_positions - 1).bit_length())
            freqs = torch.arange(size, dtype=torch.int64).float().unsqueeze(-1) * self.inv_freq.cpu().unsqueeze(0)
            self._table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
        return self._table

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryStep":
        """What the step's attention layers need to rotate q and k at `positions`."""
        if dtype in FUSED_DTYPES and positions.device.type == "cpu" and load_layer_ops() is not None:
            return RotaryStep(positions=positions, table=self.table(int(positions.max()) + 1 if positions.numel() else 1))
        cos, sin = self.cos_sin(positions, dtype)
        return RotaryStep(cos=cos, sin=sin)


class RotaryStep:
    """One step's rotary embedding: the fused in-place kernel over a float32 cos/sin table (float32
    and bfloat16 on the CPU), or PyTorch over precomputed cos and sin."""

    def __init__(self, cos=None, sin=None, positions=None, table=None) -> None:
        self.cos, self.sin, self.positions, self.table = cos, sin, positions, table

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated; the fused kernel rotates them in place."""
        if self.table is not None:
            ops = fused_ops_for(q)
            ops.rotary_(q, self.positions, self.table)
            ops.rotary_(k, self.positions, self.table)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ops = fused_ops_for(x) if x.dim() == 2 else None
    if ops is not None:
        return ops.silu_and_mul(x)
    return silu_and_mul_reference(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
