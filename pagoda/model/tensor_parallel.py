"""Tensor parallelism for the Llama family: which slice of every weight a rank holds, the collectives
the layers call, and the vocabulary-parallel embedding.

A rank of a TP group of `size` holds:
- attention: its `num_heads / size` query heads and the KV heads they read (a contiguous run of
  `num_kv_heads / size` heads, or, with fewer KV heads than ranks, one head replicated on
  `size / num_kv_heads` ranks); q/k/v rows are column-parallel, o_proj columns row-parallel;
- MLP: `intermediate_size / size` rows of gate and up (column-parallel), the same columns of down;
- the embedding and LM head: `ceil(vocab / size)` rows of the vocabulary (padded with zero rows).
Row-parallel outputs are summed over the group (all-reduce); the LM head's partial logits are
gathered, so every rank holds the whole logits row and samples the same token. Norms and rotary
tables are replicated. A row-parallel bias is held by rank 0 only (zeros elsewhere), so the sum adds
it once.

Weights arrive one checkpoint tensor at a time (`shard_tensor` cuts the rank's slice out of it), so
no rank ever holds more than its shard plus one full tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group; `group` is a torch.distributed process
    group (None for the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def check_tp_config(config, size: int) -> None:
    """Raise ValueError, in one line, for a model that `size` ranks cannot split evenly."""
    if size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's intermediate_size {config.intermediate_size}"
        )


def local_kv_heads(num_kv_heads: int, tp: TPGroup) -> int:
    return max(1, num_kv_heads // tp.size)


def first_kv_head(num_kv_heads: int, tp: TPGroup) -> int:
    """The first KV head rank `tp.rank` holds (replicated ones: the head its query heads read)."""
    if num_kv_heads >= tp.size:
        return tp.rank * (num_kv_heads // tp.size)
    return tp.rank // (tp.size // num_kv_heads)


def vocab_rows(vocab_size: int, tp: TPGroup) -> int:
    return -(-vocab_size // tp.size)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding: ids outside them look up zeros, and the sum over ranks
    gives every token its one row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = vocab_rows(vocab_size, tp)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t.narrow(0, start, n)


def shard_tensor(name: str, tensor: torch.Tensor, config, tp: TPGroup) -> torch.Tensor:
    """The rank's slice of the checkpoint tensor `name` (Hugging Face names, unmerged projections)."""
    if tp.size == 1:
        return tensor
    parts = name.rsplit(".", 2)
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q_local = heads // tp.size * head_dim
    inter = config.intermediate_size // tp.size
    if module == "q_proj":
        return _rows(tensor, tp.rank * q_local, q_local)
    if module in ("k_proj", "v_proj"):
        n = local_kv_heads(kv, tp)
        return _rows(tensor, first_kv_head(kv, tp) * head_dim, n * head_dim)
    if module in ("gate_proj", "up_proj"):
        return _rows(tensor, tp.rank * inter, inter)
    if module in ("o_proj", "down_proj"):
        if leaf == "bias":  # added once, by rank 0
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)
        width = q_local if module == "o_proj" else inter
        return tensor.narrow(1, tp.rank * width, width)
    if module in ("embed_tokens", "lm_head"):
        rows = vocab_rows(config.vocab_size, tp)
        start = tp.rank * rows
        piece = tensor[start : start + rows]
        if piece.shape[0] < rows:  # the last rank's padding: zero rows, never a real token's
            pad = tensor.new_zeros(rows - piece.shape[0], *tensor.shape[1:])
            piece = torch.cat([piece, pad])
        return piece
    return tensor  # norms: replicated


def unmerge_params(weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterator[tuple[str, torch.Tensor]]:
    """Pagoda's own layout (merged qkv_proj and gate_up_proj, as the GGUF load cache stores it) back
    into the checkpoint names `shard_tensor` and the model's load_weights read."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for name, tensor in weights:
        prefix, _, rest = name.rpartition(".")
        prefix, _, module = prefix.rpartition(".")
        if module == "qkv_proj":
            sizes = [heads * head_dim, kv * head_dim, kv * head_dim]
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes)):
                yield f"{prefix}.{part}.{rest}", piece
        elif module == "gate_up_proj":
            for part, piece in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                yield f"{prefix}.{part}.{rest}", piece
        else:
            yield name, tensor
