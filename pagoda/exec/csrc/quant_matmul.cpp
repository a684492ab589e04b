// Matmuls over weights kept quantized: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and int8
// rows with a per-output-channel scale, read straight from their packed bytes.
//
// Few rows (decode, small batches): the weights are read from memory once per step in their quantized
// size, each output row's blocks multiplied into every activation row at once. For Q8_0, Q4_0, Q4_1
// and int8 rows the activations are rounded to int8 and each block's dot product is taken in integers
// (quant_dot.h, as ggml does; its header states the precision); the other types, or the float paths
// when forced, dequantize each block into a buffer that never leaves L1 (fp32 FMAs). Many rows
// (prefill): a tile of weight rows is dequantized to the activations' dtype and handed to torch's
// GEMM, so the dequantization is paid once per tile for all rows.
//
// The block formats and their arithmetic are ggml's (and gguf-py's `gguf.quants.dequantize`): the
// scalar code (quant_blocks.h) is that arithmetic written out; the AVX-512 and AVX2 float versions
// of the hot types compute the same values (one FMA where gguf-py rounds a multiply and an add:
// within fp32 rounding). Which one runs is chosen at run time from the CPU (`__builtin_cpu_supports`:
// the integer paths where they run; in a build for PAGODA_CPU_ISA=avx2, cpp_build.py, which defines
// PAGODA_CPU_LEVEL_AVX2, as on an AVX2-only CPU),
// or forced with `set_isa` (tests run every path on one machine).
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>

#include "quant_blocks.h"
#include "quant_dot.h"

namespace {

// The float paths, and the integer ones (quant_dot.h: int8 dot products for Q8_0, Q4_0, Q4_1 and I8)
// on top of AVX2 or AVX-512, whose float code serves the other types and every dequantization.
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX2_INT8 = 3, AVX512_VNNI = 4 };
const char* const kIsaNames[] = {"scalar", "avx2", "avx512", "avx2_int8", "avx512_vnni"};

int float_isa(int isa) { return isa == AVX512_VNNI ? AVX512 : isa == AVX2_INT8 ? AVX2 : isa; }

bool cpu_runs(int isa) {
  __builtin_cpu_init();
#if defined(PAGODA_CPU_LEVEL_AVX2)
  constexpr bool held_to_avx2 = true;
#else
  constexpr bool held_to_avx2 = false;
#endif
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && !held_to_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case AVX2: case AVX2_INT8: return avx2;
    case AVX512: return avx512;
    case AVX512_VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
  }
  return true;
}

int detect_isa() {
  for (int isa : {AVX512_VNNI, AVX2_INT8})
    if (cpu_runs(isa)) return isa;
  return SCALAR;
}

int g_isa = detect_isa();

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// ---- AVX-512: the 32-weight blocks as two vectors of 16 -------------------------------------------

TARGET_AVX512 inline void dequant_avx512(int t, const uint8_t* b, float* y) {
  switch (t) {
    case Q8_0: {
      const __m512 d = _mm512_set1_ps(half_at(b));
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
      _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))));
      _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))));
      return;
    }
    case Q4_0:
    case Q4_1: {
      const bool has_min = t == Q4_1;
      const __m512 d = _mm512_set1_ps(half_at(b));
      const uint8_t* qs = b + (has_min ? 4 : 2);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i mask = _mm_set1_epi8(0xF);
      const __m128i lo = _mm_and_si128(q, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
      __m512 vlo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
      __m512 vhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
      if (has_min) {
        const __m512 m = _mm512_set1_ps(half_at(b + 2));
        _mm512_store_ps(y, _mm512_fmadd_ps(d, vlo, m));
        _mm512_store_ps(y + 16, _mm512_fmadd_ps(d, vhi, m));
      } else {
        const __m512 eight = _mm512_set1_ps(8.0f);
        _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_sub_ps(vlo, eight)));
        _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_sub_ps(vhi, eight)));
      }
      return;
    }
    case I8: {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16));
      _mm512_store_ps(y, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
      _mm512_store_ps(y + 16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
      return;
    }
    default:
      dequant_scalar(t, b, y);
  }
}

// out[m * ldo + n] = sum_k x[m * K + k] * w[n, k] (times scale[n]) for rows n in [n0, n1).
template <int MM>
TARGET_AVX512 void rows_avx512(int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                               int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  const Layout L = layout(t);
  alignas(64) float buf[256];
  for (int64_t n = n0; n < n1; n++) {
    __m512 acc0[MM], acc1[MM];
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
      dequant_avx512(t, blk, buf);
      for (int j = 0; j < L.elems; j += 32) {
        const __m512 w0 = _mm512_load_ps(buf + j), w1 = _mm512_load_ps(buf + j + 16);
        for (int m = 0; m < MM; m++) {
          const float* xr = x + m * K + k + j;
          acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc0[m]);
          acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc1[m]);
        }
      }
    }
    const float s = scale ? scale[n] : 1.0f;
    for (int m = 0; m < MM; m++) out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) * s;
  }
}

// ---- AVX2: the 32-weight blocks as four vectors of 8 ----------------------------------------------

TARGET_AVX2 inline void dequant_avx2(int t, const uint8_t* b, float* y) {
  switch (t) {
    case Q8_0:
    case I8: {
      const float dv = t == Q8_0 ? half_at(b) : 1.0f;
      const __m256 d = _mm256_set1_ps(dv);
      const uint8_t* q = b + (t == Q8_0 ? 2 : 0);
      for (int i = 0; i < 32; i += 8) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
        _mm256_store_ps(y + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
      }
      return;
    }
    case Q4_0:
    case Q4_1: {
      const bool has_min = t == Q4_1;
      const __m256 d = _mm256_set1_ps(half_at(b));
      const __m256 m = has_min ? _mm256_set1_ps(half_at(b + 2)) : _mm256_set1_ps(8.0f);
      const uint8_t* qs = b + (has_min ? 4 : 2);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i mask = _mm_set1_epi8(0xF);
      const __m128i lo = _mm_and_si128(q, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int i = 0; i < 4; i++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_store_ps(y + 8 * i, has_min ? _mm256_fmadd_ps(d, v, m) : _mm256_mul_ps(d, _mm256_sub_ps(v, m)));
      }
      return;
    }
    default:
      dequant_scalar(t, b, y);
  }
}

template <int MM>
TARGET_AVX2 void rows_avx2(int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                           int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  const Layout L = layout(t);
  alignas(64) float buf[256];
  for (int64_t n = n0; n < n1; n++) {
    __m256 acc0[MM], acc1[MM];
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
      dequant_avx2(t, blk, buf);
      for (int j = 0; j < L.elems; j += 16) {
        const __m256 w0 = _mm256_load_ps(buf + j), w1 = _mm256_load_ps(buf + j + 8);
        for (int m = 0; m < MM; m++) {
          const float* xr = x + m * K + k + j;
          acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[m]);
          acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[m]);
        }
      }
    }
    const float s = scale ? scale[n] : 1.0f;
    for (int m = 0; m < MM; m++) out[m * ldo + n] = hsum_avx2(_mm256_add_ps(acc0[m], acc1[m])) * s;
  }
}

// ---- scalar: any CPU ------------------------------------------------------------------------------

void rows_scalar(int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t n0,
                 int64_t n1, float* out, int64_t ldo, const float* scale) {
  const Layout L = layout(t);
  float buf[256];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < M; m++) {
      float acc = 0.0f;
      const uint8_t* blk = row;
      for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
        dequant_scalar(t, blk, buf);
        for (int j = 0; j < L.elems; j++) acc += buf[j] * x[m * K + k + j];
      }
      out[m * ldo + n] = acc * (scale ? scale[n] : 1.0f);
    }
  }
}

template <int MM>
void rows_for(int isa, int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n0,
              int64_t n1, float* out, int64_t ldo, const float* scale) {
  if (isa == AVX512)
    rows_avx512<MM>(t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
  else if (isa == AVX2)
    rows_avx2<MM>(t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
  else
    rows_scalar(t, w, row_bytes, x, MM, K, n0, n1, out, ldo, scale);
}

constexpr int kMaxFusedRows = 8;

void rows_any(int isa, int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
              int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  switch (M) {
    case 1: return rows_for<1>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 2: return rows_for<2>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 3: return rows_for<3>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 4: return rows_for<4>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 5: return rows_for<5>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 6: return rows_for<6>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 7: return rows_for<7>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 8: return rows_for<8>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
  }
  TORCH_CHECK(false, "quant_matmul: at most ", kMaxFusedRows, " rows per fused call");
}

void dequant_block(int isa, int t, const uint8_t* b, float* y) {
  if (isa == AVX512)
    dequant_avx512(t, b, y);
  else if (isa == AVX2)
    dequant_avx2(t, b, y);
  else
    dequant_scalar(t, b, y);
}

void check_weight(const torch::Tensor& w, int64_t t, int64_t K, const c10::optional<torch::Tensor>& scale) {
  const Layout L = layout(t);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "quant_matmul: weight must be a contiguous uint8 [rows, bytes per row] tensor");
  TORCH_CHECK(K % L.elems == 0 && w.size(1) == K / L.elems * L.bytes, "quant_matmul: a row of ", K,
              " weights takes ", K / L.elems * L.bytes, " bytes of this type, the weight has ", w.size(1));
  if (scale) {
    TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() && scale->numel() == w.size(0),
                "quant_matmul: scale must be a contiguous float32 tensor with one value per row");
  }
}

void dequant_row(int isa, int t, const uint8_t* blk, int64_t K, float f, float* y) {
  const Layout L = layout(t);
  alignas(64) float buf[256];
  for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
    dequant_block(isa, t, blk, buf);
    for (int j = 0; j < L.elems; j++) y[k + j] = buf[j] * f;
  }
}

// Rows [start, start + count) of the weight, dequantized to float32: [count, K].
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t t, int64_t K, const c10::optional<torch::Tensor>& scale,
                              int64_t start, int64_t count) {
  check_weight(w, t, K, scale);
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= w.size(0), "dequantize_rows: rows out of range");
  auto out = torch::empty({count, K}, torch::kFloat32);
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int isa = float_isa(g_isa);
#pragma omp parallel for schedule(static) if (count * K > 16384)
  for (int64_t r = 0; r < count; r++)
    dequant_row(isa, t, base + (start + r) * row_bytes, K, s ? s[start + r] : 1.0f, o + r * K);
  return out;
}

// Embedding rows picked by id, dequantized to float32: [ids.numel(), K].
torch::Tensor gather_rows(const torch::Tensor& w, int64_t t, int64_t K, const c10::optional<torch::Tensor>& scale,
                          const torch::Tensor& ids) {
  check_weight(w, t, K, scale);
  auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(id[i] >= 0 && id[i] < w.size(0), "gather_rows: id ", id[i], " out of range");
  auto out = torch::empty({n, K}, torch::kFloat32);
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int isa = float_isa(g_isa);
#pragma omp parallel for schedule(static) if (n * K > 16384)
  for (int64_t i = 0; i < n; i++) dequant_row(isa, t, base + id[i] * row_bytes, K, s ? s[id[i]] : 1.0f, o + i * K);
  return out;
}

// x [M, K] float32 -> [M, N] float32 through the fused path (M <= kMaxFusedRows).
torch::Tensor fused_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t,
                           const c10::optional<torch::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quant_matmul: x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, t, K, scale);
  TORCH_CHECK(M <= kMaxFusedRows, "quant_matmul: at most ", kMaxFusedRows, " rows per fused call");
  auto xc = x.contiguous();
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0 || N == 0) return out;
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const float* xs = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  const int isa = g_isa;
  const bool int_dot = (isa == AVX512_VNNI || isa == AVX2_INT8) && has_int_dot(t);
  // Kept per calling thread so that a step's calls allocate nothing; bound by reference before the
  // parallel loop, whose threads would otherwise each see their own (empty) copy.
  static thread_local ActInt8 calling_thread_act;
  ActInt8& xq = calling_thread_act;
  if (int_dot) quantize_activations(xs, M, K, xq);  // once per call, for every weight row
  // Chunks of 16 rows: few enough per thread to balance, many enough to amortise the loop.
  const int64_t chunks = (N + 15) / 16;
#pragma omp parallel for schedule(static) if (N * K > 32768)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t n0 = c * 16, n1 = std::min<int64_t>(N, n0 + 16);
    if (int_dot)
      int_rows_any(isa == AVX512_VNNI, t, M, base, row_bytes, xq, n0, n1, o, N, s);
    else
      rows_any(float_isa(isa), t, base, row_bytes, xs, M, K, n0, n1, o, N, s);
  }
  return out;
}

// x [M, K] (float32 or bfloat16) -> [M, N] in x's dtype: fused for few rows, else tiles of weight
// rows dequantized to x's dtype and multiplied by torch's GEMM.
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t,
                           const c10::optional<torch::Tensor>& scale, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2, "quant_matmul: x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, t, K, scale);
  if (M <= kMaxFusedRows) {
    auto out = fused_matmul(x.to(torch::kFloat32), w, t, scale);
    return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
  }
  auto out_t = torch::empty({N, M}, x.options());
  auto xt = x.t();
  for (int64_t n0 = 0; n0 < N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, N - n0);
    auto tile = dequantize_rows(w, t, K, scale, n0, rows);
    if (x.scalar_type() != torch::kFloat32) tile = tile.to(x.scalar_type());
    auto dst = out_t.narrow(0, n0, rows);
    at::mm_out(dst, tile, xt);
  }
  return out_t.t().contiguous();
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_isa = detect_isa();
    return;
  }
  for (int isa = SCALAR; isa <= AVX512_VNNI; isa++) {
    if (name == kIsaNames[isa]) {
      TORCH_CHECK(cpu_runs(isa), "set_isa: this CPU cannot run ", name);
      g_isa = isa;
      return;
    }
  }
  TORCH_CHECK(false, "set_isa: auto, avx512_vnni, avx2_int8, avx512, avx2 or scalar; got ", name);
}

std::string isa() { return kIsaNames[g_isa]; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "x @ dequantize(w).T over quantized rows");
  m.def("fused_matmul", &fused_matmul, "the few-rows path of quant_matmul (float32)");
  m.def("dequantize_rows", &dequantize_rows, "rows [start, start + count) of w as float32");
  m.def("gather_rows", &gather_rows, "the rows `ids` of w as float32 (embedding lookup)");
  m.def("set_isa", &set_isa, "force the path: auto, avx512_vnni, avx2_int8 (int8 dots), avx512, avx2, scalar");
  m.def("isa", &isa, "the instruction set in use");
  // Entry points for the fused decode step (exec/csrc/fused_decode.cpp), which calls them from C++.
  m.def("_addresses", [] { return std::map<std::string, int64_t>{{"quant_matmul", reinterpret_cast<int64_t>(&quant_matmul)}}; });
}
