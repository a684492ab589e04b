"""The attention-backend interface the model calls, and a simple contiguous-cache backend.

Model code hands each layer's q, k, v to `AttentionContext`; which backend stores K/V (a contiguous
per-sequence cache here, the paged cache of `pagoda.exec`) is decided by whoever runs the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the step's T flattened tokens; returns [T, Hq, D]."""
        ...


@dataclass
class AttentionContext:
    """What one forward pass needs for attention: the backend and this step's metadata."""

    backend: AttentionBackend
    metadata: Any

    def __call__(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        return self.backend.forward(layer_idx, q, k, v, self.metadata, scale)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference attention of q [Q, Hq, D] over k/v [S, Hkv, D] whose last Q positions are the queries."""
    num_q, hq, _ = q.shape
    hkv = k.shape[1]
    s = k.shape[0]
    qh = q.transpose(0, 1)  # [Hq, Q, D]
    kh = k.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    # Query i sits at absolute position s - num_q + i and sees keys 0..that position.
    q_pos = torch.arange(s - num_q, s).unsqueeze(1)
    mask = torch.arange(s).unsqueeze(0) <= q_pos
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@dataclass
class ContiguousMetadata:
    """A batch of sequences, each adding `query_lens[i]` tokens after what its cache already holds."""

    seq_ids: list[Any]
    query_lens: list[int]


@dataclass
class ContiguousKVBackend:
    """Keeps each sequence's K/V in growing tensors; simple and slow, the reference for paged attention."""

    caches: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def forward(self, layer_idx, q, k, v, metadata: ContiguousMetadata, scale: float) -> torch.Tensor:
        outs = []
        start = 0
        for seq_id, n in zip(metadata.seq_ids, metadata.query_lens):
            layers = self.caches.setdefault(seq_id, [])
            k_new, v_new = k[start : start + n], v[start : start + n]
            if layer_idx < len(layers):
                k_all = torch.cat([layers[layer_idx][0], k_new])
                v_all = torch.cat([layers[layer_idx][1], v_new])
                layers[layer_idx] = (k_all, v_all)
            else:
                k_all, v_all = k_new, v_new
                layers.append((k_all, v_all))
            outs.append(dense_causal_attention(q[start : start + n], k_all, v_all, scale))
            start += n
        return torch.cat(outs)

    def free(self, seq_id) -> None:
        self.caches.pop(seq_id, None)
