"""The CPU linears: the LM head and the layers' projections, each weight packed once, into oneDNN's
blocked layout (vLLM's CPU backend packs its linears the same way) or, for bf16 on CPUs with
AVX512-BF16, into the task layout of our own bf16 GEMM (last paragraph).

Measured on 2 AVX2 cores, SmolLM2 in fp32, against torch's default F.linear (MKL): the LM head with
64 rows takes 27 ms instead of 55; a decode step of ~60 sequences ~200 instead of ~250-300 ms, and
a step of decodes plus a few hundred prefill tokens ~20 % less; a pure 2,048-token prefill step is
~5 % slower (one-off A/B scripts, 2026-11-30; docs/perf-notes.md).

bfloat16 is packed too where the CPU has native bf16 instructions (AVX512-BF16 or AMX, where
`dtype=auto` picks bf16). On a 2-core AVX512-BF16 EPYC, SmolLM2's shapes, packed against F.linear:
1.6-1.9x as fast for one row, 1.14-1.26x for 64 rows, 1.04x for 512, with bitwise identical results
(both are oneDNN's bf16 GEMM accumulating in float32; docs/perf-notes.md). Without native bf16
oneDNN emulates it, so there bf16 keeps F.linear. PAGODA_NO_ONEDNN=1 turns every packing off.

oneDNN builds (JIT-compiles and caches) one primitive per input shape. A server's steps come in
every row count, and a primitive per count made memory grow for as long as it ran: 800 row counts
through SmolLM2's four projections left ~550 MB of cached primitives and ~1.8 GB of fragmented free
heap (bf16, AVX512-BF16). So rows are padded up to a few dozen counts (`bucket_rows`: exact up to
16, then 8 steps per doubling, at most 12.5 % padding), and the primitives a server ever builds are
bounded.

With AVX512-BF16, bf16 linears and the LM head run through our own GEMM instead
(exec/csrc/gemm_bf16.cpp, over weights packed once into its task layout, `pack_gemm`): it measured
faster than oneDNN's packed GEMM from one row (2x: a decode step is a chain of matrix-vector
products bound by reading the weights, where oneDNN's blocking for many rows falls short) to 256 and
within a few per cent at 2,048, and it builds nothing per row count. One packed copy per weight: the
plain one is dropped (the tied head's is the embedding's, which stays). PAGODA_NO_BF16_GEMM=1 gives
those linears back to oneDNN. A model dequantized from a GGUF file keeps a second copy in the file's
blocks where they widen to the same bf16 values, which the GEMM reads for up to 8 rows
(gguf_block_linears: SmolLM2's Q4_1 linears and Q8_0 head, 98 MB against 269 MB a decode step).

Where oneDNN has AMX it wins instead, and the bf16 linears and the head stay with it
(PAGODA_BF16_GEMM=1 still picks our GEMM, which the quantized paths use either way); their GGUF
blocks, where kept, still serve a few rows through our kernel (`gemm_bf16_blocks`), which reads the
smaller copy faster than oneDNN reads the bf16 one. It sums them on AMX tiles as oneDNN does
(csrc/amx_blocks.h), with oneDNN's bits (checked once per shape, `tiles_agree`), so up to 32 rows
of any step read them (`block_rows`): SmolLM2's 30 layers, 2-core Xeon, 7.0 ms for one row and 8.9
for 16 against oneDNN's 20-21 ms at either. Without the tiles our kernel's bits differ from
oneDNN's in rare elements, and only up to 8 rows of a step of decodes read them (`decode_step`). On that Xeon, SmolLM2's projections, our GEMM
against oneDNN's packed GEMM: 2-3.7x oneDNN's time at 16-64 rows, 5-12x at 512 and 2,048 (oneDNN
~2,200 GFLOP/s there), 0.34-1.3x for 1-8 rows; the head 1.7-4x at any count (docs/perf-notes.md, "AMX").
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Callable, Iterator

import torch
from torch import nn

from pagoda.exec.cpu_kernels import load_gemm_bf16
from pagoda.exec.gguf_block_linears import pack_blocks, source_blocks
from pagoda.model import loader
from pagoda.model.llama import LlamaMLP
from pagoda.model.loader import cpu_has_amx, cpu_has_bf16
from pagoda.model.mmap_weights import release_pages

logger = logging.getLogger(__name__)

_ROWS_HINT = 64  # oneDNN picks its blocking for about this many rows; any count works
_TASK_COLS = 64  # output columns per task of the bf16 GEMM (gemm_bf16.cpp's kCols)
_PAIR_COLS = _TASK_COLS // 2  # gate (and up) columns per task of gemm_bf16_silu
BLOCK_ROWS = 8  # the most rows GGUF blocks serve (gemm_bf16.cpp's kBlockRowsMax)
DECODE_ROWS_OURS = 1  # a step of decodes' rows that our kernel sums where AMX tiles could (block_rows)
DECODE_TILE_ROWS = 64  # a step of decodes' rows at most on AMX tiles (block_rows)


@lru_cache(maxsize=1)
def _native_bf16() -> bool:
    return cpu_has_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@lru_cache(maxsize=1)
def gemm_kernel():
    """The bf16 GEMM kernel module where the CPU has AVX512-BF16 and it builds, else None."""
    if os.environ.get("PAGODA_NO_BF16_GEMM") == "1" or not _native_bf16():
        return None
    kernel = load_gemm_bf16()
    return kernel if kernel is not None and kernel.has_avx512_bf16() else None


def kernel_takes(weight: torch.Tensor) -> bool:
    """Whether the bf16 GEMM kernel can compute with `weight` [N, K] (bf16, K even, the kernel here)."""
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and gemm_kernel() is not None


def gemm_applies(weight: torch.Tensor) -> bool:
    """Whether `weight` runs on the bf16 GEMM: where the kernel takes it and oneDNN has no AMX (last
    paragraph of the module's docstring), or PAGODA_BF16_GEMM=1 asks for it."""
    return kernel_takes(weight) and (not cpu_has_amx() or os.environ.get("PAGODA_BF16_GEMM") == "1")


def pack_tasks(w: torch.Tensor, group: int = 2) -> torch.Tensor:
    """[E, N, K] (N a multiple of 64) -> [E, N/64, K/group, 4, 16, group]: each task's 4 blocks of 16
    output columns, one group of k of all four contiguous, so that a task streams one range (the
    layout of csrc/bf16_tile.h, pairs of k; the grouped MoE kernel splits each task in two halves,
    cpu_grouped_moe.pack_halves; the W8A8 GEMM takes groups of 4 bytes, csrc/gemm_int8.cpp)."""
    e, n, k = w.shape
    return w.reshape(e, n // _TASK_COLS, 4, _TASK_COLS // 4, k // group, group).permute(0, 1, 4, 2, 3, 5).contiguous()


def pack_gemm(weight: torch.Tensor, group: int = 2) -> torch.Tensor:
    """[N, K] (bf16, or int8 for gemm_i8_bf16 and, group 4, the W8A8 GEMM) -> [ceil(N/64), K/group, 4,
    16, group]: `pack_tasks` of the one matrix, zero rows padding N."""
    n, k = weight.shape
    weight = weight.detach()
    if n % _TASK_COLS:
        weight = torch.cat([weight, weight.new_zeros(_TASK_COLS - n % _TASK_COLS, k)])
    return pack_tasks(weight.unsqueeze(0), group)[0]


def pair_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """An MLP's gate_up weight [2I, K] (gate rows, then up rows) -> [ceil(I/32) * 64, K]: every 64 rows
    32 gate rows then the same 32 up rows (zero rows past I), the tasks of csrc/gemm_bf16.cpp's
    gemm_bf16_silu once packed (pack_gemm), each of which so sees both halves of its outputs."""
    inter, k = weight.shape[0] // 2, weight.shape[1]
    halves = [weight[:inter], weight[inter:]]
    if inter % _PAIR_COLS:
        halves = [torch.cat([h, h.new_zeros(_PAIR_COLS - inter % _PAIR_COLS, k)]) for h in halves]
    return torch.stack([h.reshape(-1, _PAIR_COLS, k) for h in halves], 1).reshape(-1, k)


def _onednn_usable(weight: torch.Tensor, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _native_bf16()))
        and torch.backends.mkldnn.is_available()
        and os.environ.get("PAGODA_NO_ONEDNN") != "1"
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)


def bucket_rows(m: int) -> int:
    """The row count a packed linear computes for m rows: m up to 16, else m rounded up to a multiple
    of an eighth of the power of two below it (17 -> 18, 100 -> 104, 1000 -> 1024, 2048 -> 2048)."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    m = x.shape[0]
    x = x.contiguous()
    rows = bucket_rows(m)
    if rows != m:
        # Zero rows: no NaNs or denormals to compute on; their outputs are dropped.
        padded = x.new_zeros((rows, x.shape[1]))
        padded[:m] = x
        x = padded
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if rows != m:
        out = out[:m]
    return out.reshape(*shape[:-1], out.shape[-1])


def _gemm_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                 blocks: torch.Tensor | None, gemm: bool = True, tiles: bool = False) -> torch.Tensor:
    """x through the bf16 GEMM over `packed` (its layout) and `blocks`; or, not `gemm`, through
    `blocks` alone (a few rows beside oneDNN's `packed`; `tiles`: on AMX tiles)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gemm:
        y = gemm_kernel().gemm_bf16(x, packed, bias, n, blocks)
    else:
        y = gemm_kernel().gemm_bf16_blocks(x, blocks, bias, n, tiles)
    return y.reshape(*shape[:-1], n)


def block_copy(parts: list | None, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor | None:
    """The GGUF blocks `parts` (a linear's, in order) in the GEMM's block layout, where they widen to
    the bf16 `weight` value for value (`packed`: the weight as pack_gemm packs it, if at hand); else None."""
    if not parts or sum(p.rows for p in parts) != weight.shape[0] or not kernel_takes(weight):
        return None
    blocks = pack_blocks(parts)
    widens = blocks is not None and gemm_kernel().blocks_widen_to(blocks, pack_gemm(weight) if packed is None else packed)
    return blocks if widens else None


# Whether the running step's rows are all decodes (`decode_step`). Where our kernel sums the blocks
# on AMX tiles it rounds as oneDNN does (csrc/amx_blocks.h), and any step's few rows read them; else
# it rounds as our GEMM does, apart from oneDNN in rare elements, and only a step of decodes' rows
# may: a prompt's positions must round alike whatever the prompt's length (its logprobs, echoed, are
# the same tokens' inside a longer prompt), so every prompt row is then oneDNN's.
_decodes: ContextVar[bool] = ContextVar("pagoda_decode_step", default=False)


@contextmanager
def decode_step(decodes: bool = True) -> Iterator[None]:
    """Within: the model's step is one of decodes only (or not, `decodes` False)."""
    token = _decodes.set(decodes)
    try:
        yield
    finally:
        _decodes.reset(token)


def in_decode_step() -> bool:
    return _decodes.get()


@lru_cache(maxsize=1)
def exact_block_rows() -> int:
    """The most rows for which the blocks beside oneDNN give oneDNN's bits (on AMX tiles, where
    oneDNN's GEMM runs on them too: the loader's own check, whatever stands in for it here), or 0."""
    kernel = gemm_kernel()
    return kernel.amx_block_rows() if kernel is not None and loader.cpu_has_amx() else 0


_tile_checks: dict[tuple[int, int, int], bool] = {}


def tiles_agree(packed: torch.Tensor, blocks: torch.Tensor) -> bool:
    """Whether `blocks` on AMX tiles give oneDNN's bits over `packed` (the same weights, oneDNN's) at
    1 to exact_block_rows() rows. oneDNN picks how it sums by shape and row count (from 33 rows of
    SmolLM2's shapes it splits k), so each shape is checked once, on random rows, at the counts
    where a tile's rows end and begin; a linear of a shape that fails keeps no blocks."""
    n, k = packed.shape[0], blocks.shape[1] * 32
    key = (n, k, blocks.shape[2])
    if key not in _tile_checks:
        most, g = exact_block_rows(), torch.Generator().manual_seed(0)
        agree = True
        for m in sorted({1, min(16, most), min(17, most), most}) * 2:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            ours = gemm_kernel().gemm_bf16_blocks(x, blocks, None, n, True)
            agree = agree and torch.equal(ours.view(torch.int16), _packed_linear(x, packed, None).view(torch.int16))
        _tile_checks[key] = agree
        if not agree:
            logger.info("GGUF blocks of a %d x %d linear dropped: oneDNN sums it otherwise than AMX tiles", n, k)
    return _tile_checks[key]


def _kept(blocks: torch.Tensor | None, packed: torch.Tensor, gemm: bool) -> torch.Tensor | None:
    """`blocks`, unless beside oneDNN on AMX tiles that sum their shape otherwise (tiles_agree)."""
    if blocks is None or gemm or not exact_block_rows():
        return blocks
    return blocks if tiles_agree(packed, blocks) else None


def block_rows() -> tuple[int, int]:
    """(The most rows of the running step that read a linear's GGUF blocks beside oneDNN, the most of
    those that our kernel sums as our GEMM does rather than on AMX tiles.) A step of decodes' rows
    may round apart from oneDNN: one row takes our kernel (one stream decoded 7-10 % slower on the
    tiles, which read the blocks faster alone; 4 streams ran 15-20 % faster on them than on ours),
    and up to DECODE_TILE_ROWS the tiles, summing k in order where oneDNN splits it from 33 rows
    (30 layers' linears at 64 rows from memory: ~0.7x oneDNN's time; docs/perf-notes.md, 2026-12-07
    "AMX tiles" and "64 rows")."""
    exact = exact_block_rows()
    if not _decodes.get():
        return exact, 0
    return decode_block_rows(), DECODE_ROWS_OURS if exact else BLOCK_ROWS


def decode_block_rows() -> int:
    """The most rows a step of decodes reads the blocks for (so the runner asks no further)."""
    return DECODE_TILE_ROWS if exact_block_rows() else BLOCK_ROWS


def _on_blocks(x: torch.Tensor, blocks: torch.Tensor | None) -> bool | None:
    """Whether x's rows go to `blocks` beside oneDNN (a CPU with AMX; gemm_bf16_blocks): None if not,
    else whether on AMX tiles."""
    rows = x.numel() // x.shape[-1]
    most, ours = block_rows()
    return rows > ours if blocks is not None and rows <= most else None


class PackedLMHead:
    """Logits through the bf16 GEMM or oneDNN, from a packed copy of the head weight (which the
    embedding still uses); `blocks`, for a few rows: the GGUF blocks it was dequantized from
    (gguf_block_linears), or None."""

    def __init__(self, weight: torch.Tensor, parts: list | None = None) -> None:
        self.out_features = weight.shape[0]
        self.gemm = gemm_applies(weight)
        self.packed = pack_gemm(weight) if self.gemm else _pack(weight)
        self.blocks = _kept(block_copy(parts, weight, self.packed if self.gemm else None), self.packed, self.gemm)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        tiles = None if self.gemm else _on_blocks(hidden, self.blocks)
        if self.gemm or tiles is not None:
            return _gemm_linear(hidden, self.packed, None, self.out_features, self.blocks, self.gemm, bool(tiles))
        return _packed_linear(hidden, self.packed, None)


class PackedLinear(nn.Module):
    """Stands in for an nn.Linear: the same function, the weight held only packed (for the bf16 GEMM
    where it applies, else in oneDNN's layout).

    `gate_up`: the linear is an MLP's [gate | up] projection. On the bf16 GEMM without a bias it is
    then packed in gate/up pairs (`fuses_silu`, held as `paired`, not `packed`, so that a weight
    update between the two layouts is refused by name, never copied into the wrong columns), and
    `silu_and_mul(x)` gives silu(gate) * up in one kernel, bit for bit what silu_and_mul(self(x))
    gives; GGUF blocks stay in [gate | up] order and serve a few rows, as for any linear."""

    def __init__(self, linear: nn.Linear, parts: list | None = None, gate_up: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gemm = gemm_applies(linear.weight)
        self.fuses_silu = gate_up and self.gemm and linear.bias is None and linear.out_features % 2 == 0
        packed = None  # a paired linear needs the [gate | up] packing only to check its blocks against
        if not (self.fuses_silu and not parts):
            packed = pack_gemm(linear.weight) if self.gemm else _pack(linear.weight)
        self.blocks = _kept(block_copy(parts, linear.weight, packed if self.gemm else None), packed, self.gemm)  # as the head's
        if self.fuses_silu:
            packed = pack_gemm(pair_gate_up(linear.weight.detach()))
        self.packed, self.paired = (None, packed) if self.fuses_silu else (packed, None)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuses_silu:  # the paired columns back in [gate | up] order (the blocks give the same bits)
            pairs = _gemm_linear(x, self.paired, None, self.paired.shape[0] * _TASK_COLS, None)
            pairs = pairs.unflatten(-1, (-1, 2, _PAIR_COLS)).transpose(-3, -2).flatten(-2)
            return pairs[..., : self.out_features // 2].flatten(-2)
        tiles = None if self.gemm else _on_blocks(x, self.blocks)
        if self.gemm or tiles is not None:
            return _gemm_linear(x, self.packed, self.bias, self.out_features, self.blocks, self.gemm, bool(tiles))
        return _packed_linear(x, self.packed, self.bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] projection of x (only where `fuses_silu`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        inter = self.out_features // 2
        return gemm_kernel().gemm_bf16_silu(x, self.paired, inter, self.blocks).reshape(*shape[:-1], inter)


def logits_fn(model: nn.Module, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fastest way to compute `model`'s logits on `device`: the packed head on CPU in fp32 (and
    bf16 on CPUs with native bf16), else the model's own compute_logits."""
    weight = model.lm_head_weight()
    if weight is None or not _onednn_usable(weight, device):  # None: a pipeline stage without the head
        return model.compute_logits
    try:
        head = PackedLMHead(weight, _head_blocks(model, weight))
    except (RuntimeError, AttributeError) as exc:  # a torch build without these oneDNN ops
        logger.warning("packed LM head unavailable (%s); using F.linear", exc)
        return model.compute_logits
    # Under tensor parallelism the head holds this rank's slice of the vocabulary: gather the rest.
    gather = getattr(model, "gather_logits", None)
    return head if gather is None else lambda hidden: gather(head(hidden))


def _blocks_for(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, list]:
    """The GGUF blocks (gguf_block_linears.source_blocks) of those of `weights` (module name ->
    weight) that the bf16 GEMM's kernel can read."""
    wanted = {name for name, w in weights.items() if kernel_takes(w)}
    return source_blocks(model, wanted) if wanted else {}


def _head_blocks(model: nn.Module, weight: torch.Tensor) -> list | None:
    found = _blocks_for(model, {"lm_head": weight, "model.embed_tokens": weight})  # a tied head: the embedding's
    return found.get("lm_head", found.get("model.embed_tokens"))


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Swap every nn.Linear of `model` on the CPU that oneDNN serves well (float32; bf16 with native
    bf16) but the LM head, which `logits_fn` serves, for a PackedLinear; the unpacked weights are dropped. Returns how many were swapped."""
    targets = [
        (f"{prefix}.{name}" if prefix else name, parent, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and name != "lm_head" and _onednn_usable(child.weight, device)
    ]
    blocks = _blocks_for(model, {full: child.weight for full, _, _, child in targets})
    swapped, dropped = 0, []
    for full, parent, name, child in targets:
        try:
            gate_up = name == "gate_up_proj" and isinstance(parent, LlamaMLP)
            packed = PackedLinear(child, blocks.pop(full, None), gate_up=gate_up)
        except (RuntimeError, AttributeError) as exc:  # a torch build without these oneDNN ops
            logger.warning("packed linears unavailable (%s); using F.linear", exc)
            break
        setattr(parent, name, packed)
        swapped += 1
        dropped.append(child.weight)
    # The packed copies replace the weights; weights mapped from the load cache would otherwise stay
    # resident (the mapping lives on for the other parameters): ~430 MB for SmolLM2 in fp32.
    release_pages(dropped)
    return swapped
