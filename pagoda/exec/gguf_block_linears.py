"""A second copy of a GGUF-loaded bf16 model's linears and LM head, in the file's own blocks, for the
few-row GEMMs of a decode step (exec/csrc/block_tile.h).

Why: loaded from a GGUF, the weights are dequantized to bf16 once, and a decode step of a few rows
is bound by reading them (SmolLM2 from its Q4_1 file: 269 MB a token in bf16 against 98 MB as
blocks, about 8.6 ms against 3 ms at a 2-core slice's ~31 GB/s). The kernel widens each block in
registers to the bf16 value the loader made of it and sums exactly as the bf16 GEMM does, so the
results are the same bits; `cpu_linear.block_copy` checks, before any use, that the blocks widen to
the loaded weight value for value (in C++, `blocks_widen_to`), and keeps none where they do not.
`widen_blocks` is the same widening in torch: the layout's reference, for tests and benchmarks.

Formats: Q4_0, Q4_1 and Q8_0 (value = d * q + m; gguf-py computes it in float32, where d * q is
exact, and torch rounds it to bf16). One format per linear (a merged projection's parts alike).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pagoda.model.quantized import BLOCK_LAYOUT, QuantizedTensor

_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # the formats the kernel takes, and its bits a value for each
BLOCK_TYPES = tuple(_BITS)
_TASK_COLS = 64  # output columns per task (block_tile.h)
_K = 32  # k per block
_HEADER = 4 * _TASK_COLS  # a task's k-block's scales and offsets, float16 (block_tile.h's kHeader)
# Bytes per weight in the layout (the values and their share of the header), by format.
BYTES_PER_WEIGHT = {kind: bits / 8 + _HEADER / (_TASK_COLS * _K) for kind, bits in _BITS.items()}


def source_blocks(model: nn.Module, modules: set[str]) -> dict[str, list[QuantizedTensor]]:
    """The blocks of those `modules` that the GGUF `model` was dequantized from (the loader's
    `gguf_file`) holds in a format here, by module name; {} for any other model, or with
    PAGODA_NO_GGUF_BLOCKS=1."""
    path = getattr(model, "gguf_file", None)
    if path is None or os.environ.get("PAGODA_NO_GGUF_BLOCKS") == "1":
        return {}
    from pagoda.model.quant_loader import gguf_blocks

    return gguf_blocks(path, model.config, BLOCK_TYPES, modules)


def _fields(part: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, offset) float16 [rows, K/32] and q [rows, K/32, 32] (uint8 0-15, or int8) of one part."""
    rows, nb = part.rows, part.cols // _K
    raw = part.data.reshape(rows, nb, BLOCK_LAYOUT[part.qtype][1])
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if part.qtype == "Q8_0":
        q = raw[..., 2:34].contiguous().view(torch.int8)
        # -0.0: d * q + (-0.0) is d * q to the sign of a zero product, as gguf-py's x * d.
        return d, torch.full_like(d, -0.0), q
    nibbles = raw[..., 4:20] if part.qtype == "Q4_1" else raw[..., 2:18]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # byte j holds q[j] and q[j + 16]
    if part.qtype == "Q4_1":
        return d, raw[..., 2:4].contiguous().view(torch.float16)[..., 0], q
    return d, (d.float() * -8).to(torch.float16), q  # Q4_0: d * (q - 8)


def pack_blocks(parts: list[QuantizedTensor]) -> torch.Tensor | None:
    """The parts' rows, one after another, in the kernel's layout: uint8 [ceil(N/64), K/32, bytes]
    (block_tile.h); None for a format or shape the kernel does not take."""
    kinds = {p.qtype for p in parts}
    cols = {p.cols for p in parts}
    if len(kinds) != 1 or kinds.pop() not in BLOCK_TYPES or len(cols) != 1 or cols.pop() % _K:
        return None
    fields = [_fields(p) for p in parts]
    scale, offset, q = (torch.cat([f[i] for f in fields]) for i in range(3))
    n, nb = scale.shape
    pad = -n % _TASK_COLS
    if pad:
        scale, offset = (torch.cat([t, t.new_zeros(pad, nb)]) for t in (scale, offset))
        q = torch.cat([q, q.new_zeros(pad, nb, _K)])
    tasks = (n + pad) // _TASK_COLS
    header = torch.stack([scale, offset]).view(2, tasks, _TASK_COLS, nb).permute(1, 3, 0, 2)  # [T, nb, 2, 64]
    header = header.contiguous().view(torch.uint8).reshape(tasks, nb, -1)
    # [T, nb, pair, block of 16 columns, half (columns 0-7, 8-15), column in the half, k even/odd]
    pairs = q.view(tasks, 4, 2, 8, nb, _K // 2, 2).permute(0, 4, 5, 1, 2, 3, 6)
    if q.dtype == torch.int8:
        values = pairs.contiguous().view(torch.uint8).reshape(tasks, nb, -1)
    else:
        values = (pairs[:, :, :, :, 0] | (pairs[:, :, :, :, 1] << 4)).reshape(tasks, nb, -1)
    return torch.cat([header, values], dim=-1).contiguous()


def widen_blocks(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The bf16 [n, K] matrix that `blocks` (pack_blocks) stands for, as the kernel widens it."""
    tasks, nb, nbytes = blocks.shape
    header = blocks[..., :_HEADER].contiguous().view(torch.float16).reshape(tasks, nb, 2, 4, 2, 8)
    values = blocks[..., _HEADER:].reshape(tasks, nb, _K // 2, 4, -1)
    if values.shape[-1] == 16:  # 4 bits: columns 0-7 of a block in the low nibbles, 8-15 in the high
        q = torch.stack([values & 0x0F, values >> 4], dim=4).view(tasks, nb, _K // 2, 4, 2, 8, 2).float()
    else:
        q = values.contiguous().view(torch.int8).view(tasks, nb, _K // 2, 4, 2, 8, 2).float()
    scale = header[:, :, 0].float()[:, :, None, :, :, :, None]
    offset = header[:, :, 1].float()[:, :, None, :, :, :, None]
    w = (q * scale + offset).to(torch.bfloat16)  # [T, nb, pair, block, half, column, k even/odd]
    return w.permute(0, 3, 4, 5, 1, 2, 6).reshape(tasks * _TASK_COLS, nb * _K)[:n]
