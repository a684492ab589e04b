"""GPU kernels for weights kept quantized (model/quantized.py's `QuantizedTensor`), given to the
model's quantized layers the way exec/quant_linear.py gives them the CPU kernels.

- `_quant_matmul_kernel` (Triton): x @ dequantize(W).T for int8 rows (a float32 scale per output
  channel) and GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K blocks as they lie in the file. Each
  program dequantizes its [BLOCK_K, BLOCK_N] weight tile in registers (`_dequant`: every value's
  bytes found from its row and column, so one tile may span several format blocks) and multiplies
  it into BLOCK_M activation rows: the weights are read once, in their packed size, per BLOCK_M
  rows. That is the decode case (few rows, bound by the weight bytes); above `FUSED_ROWS` rows
  the weight is dequantized in tiles to the activations' dtype for cuBLAS, whose GEMM the
  dequantization barely adds to.
- `_dequant_rows_kernel` (Triton): chosen rows of a quantized matrix, in float32: the embedding's
  lookup, and the tiles above.
- fp8 (e4m3) weights with a float32 scale per output channel go through `torch._scaled_mm`, the
  activations rounded to e4m3 with one scale per row (computed on the device, so a CUDA graph can
  hold it); float32 activations, or shapes `_scaled_mm` refuses, multiply the widened weight.

The same kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/exec/test_triton_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from pagoda.model.quantized import (
    GGUF_KERNEL_TYPES, INT8_TYPE_ID, QuantEmbedding, QuantExperts, QuantizedTensor, QuantLinear, e4m3_rows,
    quantized_modules,
)

# Up to this many rows the fused kernel serves (a decode step's batch); above, dequantize + cuBLAS.
FUSED_ROWS = 64
# The dequantized tiles above FUSED_ROWS hold at most this many bytes (a 7B model's 32k x 4096 head
# in bf16 is 256 MiB: four tiles).
_TILE_BYTES = 64 << 20
_BLOCK_N = 64
_BLOCK_K = 32
_DEQUANT_BLOCK = 256
# The formats' type ids (model/quantized.py's), as compile-time constants of the kernels.
_INT8 = tl.constexpr(INT8_TYPE_ID)
_Q8_0 = tl.constexpr(GGUF_KERNEL_TYPES["Q8_0"])
_Q4_0 = tl.constexpr(GGUF_KERNEL_TYPES["Q4_0"])
_Q4_1 = tl.constexpr(GGUF_KERNEL_TYPES["Q4_1"])
_Q4_K = tl.constexpr(GGUF_KERNEL_TYPES["Q4_K"])
_Q5_K = tl.constexpr(GGUF_KERNEL_TYPES["Q5_K"])  # Q6_K: the last branch


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at each byte address, as float32 (GGUF block scales are unaligned)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _scale_min_k4(scales, sub, mask):
    """K-quant sub-block `sub` (0-7): its 6-bit scale and min from the 12 packed bytes at `scales`."""
    low = sub < 4
    a = _byte(scales + sub, mask)
    b = _byte(scales + sub + 4, mask)
    c = _byte(scales + tl.maximum(sub - 4, 0), mask)
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant(w_ptr, row_stride, n, k, mask, QTYPE: tl.constexpr):
    """Values W[n, k] (n and k broadcast to one shape) in float32; int8 without its row scale."""
    row = w_ptr + n.to(tl.int64) * row_stride
    if QTYPE == _INT8:  # int8 rows
        return tl.load(row + k, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    elif QTYPE == _Q8_0:  # Q8_0: fp16 d, 32 int8
        base = row + (k // 32) * 34
        q = tl.load(base + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _f16(base, mask) * q
    elif QTYPE == _Q4_0:  # Q4_0: fp16 d, 16 bytes of nibbles (low: values 0-15, high: 16-31), offset 8
        j = k % 32
        base = row + (k // 32) * 18
        b = _byte(base + 2 + j % 16, mask)
        nib = tl.where(j < 16, b & 0xF, b >> 4)
        return _f16(base, mask) * (nib - 8).to(tl.float32)
    elif QTYPE == _Q4_1:  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
        j = k % 32
        base = row + (k // 32) * 20
        b = _byte(base + 4 + j % 16, mask)
        nib = tl.where(j < 16, b & 0xF, b >> 4)
        return _f16(base, mask) * nib.to(tl.float32) + _f16(base + 2, mask)
    elif QTYPE == _Q4_K:  # Q4_K: fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes of nibbles
        j = k % 256
        base = row + (k // 256) * 144
        chunk = j // 64
        within = j % 64
        sc, mn = _scale_min_k4(base + 4, 2 * chunk + within // 32, mask)
        b = _byte(base + 16 + chunk * 32 + within % 32, mask)
        nib = tl.where(within < 32, b & 0xF, b >> 4)
        return _f16(base, mask) * sc * nib.to(tl.float32) - _f16(base + 2, mask) * mn
    elif QTYPE == _Q5_K:  # Q5_K: as Q4_K, and 32 bytes of fifth bits before the nibbles
        j = k % 256
        base = row + (k // 256) * 176
        chunk = j // 64
        within = j % 64
        sub = 2 * chunk + within // 32
        sc, mn = _scale_min_k4(base + 4, sub, mask)
        b = _byte(base + 48 + chunk * 32 + within % 32, mask)
        high = (_byte(base + 16 + within % 32, mask) >> sub) & 1
        q = tl.where(within < 32, b & 0xF, b >> 4) + 16 * high
        return _f16(base, mask) * sc * q.to(tl.float32) - _f16(base + 2, mask) * mn
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, fp16 d at the end
        j = k % 256
        base = row + (k // 256) * 210
        half = j // 128
        r = j % 128
        quarter = r // 32
        lane = r % 32
        b = _byte(base + half * 64 + lane + 32 * (quarter % 2), mask)
        nib = tl.where(quarter < 2, b & 0xF, b >> 4)
        high = (_byte(base + 128 + half * 32 + lane, mask) >> (2 * quarter)) & 3
        q = (nib | (high << 4)) - 32
        sc = tl.load(base + 192 + half * 8 + lane // 16 + 2 * quarter, mask=mask, other=0).to(tl.int8, bitcast=True)
        return _f16(base + 208, mask) * sc.to(tl.float32) * q.to(tl.float32)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, m_rows, n_out, k_dim,
                         stride_xm, stride_wn, stride_om,
                         QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """out[m, n] = sum_k x[m, k] W[n, k] for one [BLOCK_M, BLOCK_N] tile, float32 accumulation."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m_rows
    col_ok = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_dim
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.where(w_mask, _dequant(w_ptr, stride_wn, cols[None, :], ks[:, None], w_mask, QTYPE), 0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if QTYPE == _INT8:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequant_rows_kernel(w_ptr, ids_ptr, scale_ptr, out_ptr, k_dim, stride_wn, stride_on,
                         QTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = W[ids[i]] in out's dtype, one BLOCK of the row per program."""
    i = tl.program_id(0)
    n = tl.load(ids_ptr + i)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = ks < k_dim
    w = _dequant(w_ptr, stride_wn, n, ks, mask, QTYPE)
    if QTYPE == _INT8:
        w = w * tl.load(scale_ptr + n)
    tl.store(out_ptr + i.to(tl.int64) * stride_on + ks, w.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_arg(weight: QuantizedTensor) -> torch.Tensor:
    # A pointer the kernels never read for the GGUF formats (their scales are inside the blocks).
    return weight.scale if weight.scale is not None else weight.data


def fused_matmul(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T -> [M, N] in x's dtype, by the fused kernel whatever M."""
    x = x.contiguous()
    m = x.shape[0]
    out = x.new_empty((m, weight.rows))
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(weight.rows, _BLOCK_N))
    _quant_matmul_kernel[grid](
        x, weight.data, _scale_arg(weight), out, m, weight.rows, weight.cols,
        x.stride(0), weight.data.stride(0), out.stride(0),
        QTYPE=weight.type_id, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, IEEE=x.dtype == torch.float32,
    )
    return out


def dequantize_rows(weight: QuantizedTensor, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of the dequantized weight, [len(ids), cols] in `dtype`."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.shape[0], weight.cols), dtype=dtype, device=weight.data.device)
    if ids.shape[0]:
        grid = (ids.shape[0], triton.cdiv(weight.cols, _DEQUANT_BLOCK))
        _dequant_rows_kernel[grid](weight.data, ids, _scale_arg(weight), out, weight.cols,
                                   weight.data.stride(0), out.stride(0), QTYPE=weight.type_id, BLOCK=_DEQUANT_BLOCK)
    return out


def gather_rows(weight: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """QuantEmbedding's row kernel: float32 rows."""
    return dequantize_rows(weight, ids)


def quant_matmul(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """QuantLinear's kernel for int8 and GGUF weights: fused for a few rows, else tiles for cuBLAS."""
    if x.shape[0] <= FUSED_ROWS:
        return fused_matmul(x, weight)
    rows = max(1, _TILE_BYTES // (x.element_size() * weight.cols))
    out = x.new_empty((x.shape[0], weight.rows))
    for start in range(0, weight.rows, rows):
        ids = torch.arange(start, min(start + rows, weight.rows), device=x.device)
        out[:, start:start + ids.shape[0]] = torch.nn.functional.linear(x, dequantize_rows(weight, ids, x.dtype))
    return out


def _scaled_mm_fits(x: torch.Tensor, weight: QuantizedTensor) -> bool:
    # _scaled_mm wants both inner and outer dimensions in multiples of 16 and 16-bit outputs here.
    return x.dtype in (torch.bfloat16, torch.float16) and weight.cols % 16 == 0 and weight.rows % 16 == 0


def fp8_matmul(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T for an fp8 weight: W8A8 through torch._scaled_mm (rowwise
    scales: the activations' per row, the weight's per output channel), else weight-only."""
    w8 = weight.data.view(torch.float8_e4m3fn)
    if not _scaled_mm_fits(x, weight):
        return torch.nn.functional.linear(x, (w8.to(torch.float32) * weight.scale[:, None]).to(x.dtype))
    x8, x_scale = e4m3_rows(x)  # per row, as the weight's per output channel
    out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale.unsqueeze(1), scale_b=weight.scale.unsqueeze(0),
                           out_dtype=torch.bfloat16)
    return out.to(x.dtype)


def install_gpu_quant_kernels(model: nn.Module) -> int:
    """Give every quantized layer of `model` (its packed weights already on the GPU) the GPU
    kernels; returns how many layers."""
    modules = quantized_modules(model)
    for module in modules:
        if isinstance(module, (QuantLinear, QuantExperts)):
            module.kernel = _by_format
        else:
            assert isinstance(module, QuantEmbedding)
            module.gather = gather_rows
    return len(modules)


def _by_format(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    return fp8_matmul(x, weight) if weight.qtype == "fp8" else quant_matmul(x, weight)
