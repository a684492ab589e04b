"""Tensor parallelism for the Llama family: which slice of every weight a rank holds, the collectives
the layers call, and the vocabulary-parallel embedding.

A rank of a TP group of `size` holds:
- attention: a contiguous run of KV heads and the query heads that read them (`split_for`: as even
  as the KV heads allow, so 3 KV heads over 2 ranks give 2 and 1; with fewer KV heads than ranks,
  one head replicated on `size / num_kv_heads` ranks); q/k/v rows are column-parallel, o_proj
  columns row-parallel;
- MLP: about `intermediate_size / size` rows of gate and up (column-parallel), the same columns of
  down;
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
from typing import Any, Callable, Iterable, Iterator

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
    # Mixture-of-experts layers: each rank holds whole experts (True) or a slice of every expert.
    expert_parallel: bool = False
    # An in-place sum over the group that may decline (returns False): the executor's shared-memory
    # all-reduce on one machine's CPU (pagoda/exec/shm_allreduce.py); torch.distributed otherwise.
    fast_all_reduce: Callable[[torch.Tensor], bool] | None = None
    # Likewise for the LM head's gather: the concatenation, or None when it declines.
    fast_all_gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and not (self.fast_all_reduce is not None and self.fast_all_reduce(x)):
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        if self.fast_all_gather is not None:
            gathered = self.fast_all_gather(x)
            if gathered is not None:
                return gathered
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


@dataclass(frozen=True)
class Split:
    """The rank's share of the heads and of the MLP: [start, start + count) of each."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int
    inter_start: int
    inter_count: int


def split_for(config, tp: TPGroup, intermediate_size: int | None = None) -> Split:
    """KV heads are dealt out in contiguous runs, as evenly as they go (SmolLM2's 3 over 2 ranks:
    2 and 1), each with the query heads that read it; with fewer KV heads than ranks, each KV head
    is replicated on tp / kv ranks, which split its query heads. The MLP (of `intermediate_size`,
    the config's by default) splits as evenly as it goes."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size if intermediate_size is None else intermediate_size
    r, n = tp.rank, tp.size
    i0, i1 = r * inter // n, (r + 1) * inter // n
    if kv >= n:
        group = heads // kv
        k0, k1 = r * kv // n, (r + 1) * kv // n
        return Split(k0 * group, (k1 - k0) * group, k0, k1 - k0, i0, i1 - i0)
    per = heads // n
    return Split(r * per, per, r // (n // kv), 1, i0, i1 - i0)


def check_tp_config(config, size: int) -> None:
    """Raise ValueError, in one line, for a model that `size` ranks cannot split."""
    if size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if kv < size and (size % kv or heads % size):
        raise ValueError(
            f"tensor_parallel_size {size} cannot split the model's {kv} KV heads and {heads} attention heads: "
            f"use at most {kv} ranks, or a multiple of {kv} that divides {heads}"
        )
    if config.intermediate_size < size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's intermediate_size {config.intermediate_size}")


def vocab_rows(vocab_size: int, tp: TPGroup) -> int:
    """Rows of the vocabulary each rank holds: the last rank's share is padded with zero rows."""
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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sp = split_for(config, tp)
    if module == "q_proj":
        return _rows(tensor, sp.q_start * head_dim, sp.q_count * head_dim)
    if module in ("k_proj", "v_proj"):
        return _rows(tensor, sp.kv_start * head_dim, sp.kv_count * head_dim)
    if module in ("gate_proj", "up_proj"):
        return _rows(tensor, sp.inter_start, sp.inter_count)
    if module in ("o_proj", "down_proj"):
        if leaf == "bias":  # added once, by rank 0
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)
        if module == "o_proj":
            return tensor.narrow(1, sp.q_start * head_dim, sp.q_count * head_dim)
        return tensor.narrow(1, sp.inter_start, sp.inter_count)
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
