// int8 weights times int8 activations (W8A8) with AVX512-VNNI, for `--quantization int8` at more rows
// than the few-rows path (quant_dot.h) takes: y[m, n] = scale[n] * sum_g d[m, g] * sum_{k in g} q[m, k] * w[n, k]
// (+ bias[n]), in the activations' dtype (float32 or bf16).
//
// The activations are rounded to int8 exactly as quant_dot.h rounds them for the few-rows path (blocks
// of 32 values, d = absmax / 127, q = rint(x / d) in [-127, 127]), so a prompt's rows and a decode
// step's rows see the same q; each block's dot product is exact in int32, and only the float32 sum
// over blocks differs in order from the few-rows path. quant_dot.h states the precision against the
// float matmul (about 0.5 % of |y| rms on Gaussian activations; SmolLM2's perplexity +0.4 %).
//
// Why: at a batch's row counts a linear is bound by arithmetic, and vpdpbusd does 64 multiply-adds
// an instruction where vdpbf16ps does 32 and a float32 FMA 16. The bf16 GEMM over int8 weights
// (gemm_bf16.cpp) must also widen each weight to bf16 first, which costs up to a quarter of a 64-row
// gate-up projection (docs/perf-notes.md).
//
// Layout: weights packed per task of 64 output columns as [K/4][4][16][4] bytes, w + 128 (vpdpbusd's
// unsigned operand; `to_w8a8` in exec/quant_linear.py). So sum (w + 128) * q = sum w * q +
// 128 * sum q, and each block's accumulator starts at -128 * sum q of the activation block, which
// leaves exactly sum w * q. Tasks, row chunks and passes as gemm_bf16.cpp (bf16_tile.h's plan).
#include <torch/extension.h>

#include <omp.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "bf16_tile.h"

namespace {

using namespace pagoda_bf16;
using Opt = std::optional<torch::Tensor>;
constexpr int kCols = kNB * kBlock;  // output columns per task
constexpr int kGroup = 32;           // activation values per scale
constexpr int kQuads = kGroup / 4;   // vpdpbusd steps per block
// Activation rows per pass and column vectors per tile: 16 int32 accumulators. 8 x 2 measured 1.2-1.5x
// faster than 4 x 4 (a weight vector feeds 8 rows; the activations' broadcasts are cheap loads) and
// than 12 x 2 or 6 x 4, where GCC spills accumulators.
constexpr int kRows = 8;
constexpr int kHalf = 2;

bool built_with_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// Activation rows rounded to int8 per block of 32: q [M, K], d [M, K/32], start [M, K/32] = -128 * sum(q).
struct Act {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> start;
};

// One block of 32 floats, as quant_dot.h's quantize_activations rounds it (same operations, in order:
// |x| max, d = max / 127, q = rint(x * (1 / d)) clamped; a non-finite block gets d = NaN and q = 0).
void round_block(const float* x, int8_t* q, float& d, int32_t& start) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < kGroup; ++i) {
    const float mag = std::fabs(x[i]);
    finite = finite && mag < INFINITY;  // false for inf and NaN
    amax = std::max(amax, mag);
  }
  d = finite ? amax / 127.0f : NAN;
  int32_t sum = 0;
  if (!finite || d == 0.f) {
    std::fill(q, q + kGroup, 0);
  } else {
    const float id = 1.0f / d;
    for (int i = 0; i < kGroup; ++i) {
      const float t = std::nearbyint(x[i] * id);  // round half to even (default rounding mode)
      q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, t)));
      sum += q[i];
    }
  }
  start = -128 * sum;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// round_block for 32 values in two vectors: the same operations lane by lane (abs max, one division,
// one reciprocal, a product rounded to nearest even, clamped), so the same bits.
inline void round_block(__m512 lo, __m512 hi, int8_t* q, float& d, int32_t& start) {
  const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi), inf = _mm512_set1_ps(INFINITY);
  const bool finite = (_mm512_cmp_ps_mask(alo, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(ahi, inf, _CMP_LT_OQ)) == 0xFFFF;
  d = finite ? _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi)) / 127.0f : NAN;
  if (!finite || d == 0.f) {
    std::memset(q, 0, kGroup);
    start = 0;
    return;
  }
  const __m512 id = _mm512_set1_ps(1.0f / d), top = _mm512_set1_ps(127.f), bottom = _mm512_set1_ps(-127.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_min_ps(top, _mm512_max_ps(bottom, _mm512_roundscale_ps(_mm512_mul_ps(lo, id), kNearest))));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_min_ps(top, _mm512_max_ps(bottom, _mm512_roundscale_ps(_mm512_mul_ps(hi, id), kNearest))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  start = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
}

inline __m512 load_floats(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_floats(const at::BFloat16* x) { return from_bf16(load16(reinterpret_cast<const uint16_t*>(x))); }
#endif

// The activations rounded into `a`, whose buffers are kept between calls (a step's sizes repeat).
template <typename T>
void quantize(const T* x, int64_t ldx, int64_t m, int64_t k, Act& a, int threads) {
  const int64_t nb = k / kGroup;
  if (static_cast<int64_t>(a.q.size()) < m * k) a.q.resize(m * k);
  if (static_cast<int64_t>(a.d.size()) < m * nb) {
    a.d.resize(m * nb);
    a.start.resize(m * nb);
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* src = x + r * ldx + b * kGroup;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      round_block(load_floats(src), load_floats(src + 16), &a.q[r * k + b * kGroup], a.d[r * nb + b], a.start[r * nb + b]);
#else
      float row[kGroup];
      for (int i = 0; i < kGroup; ++i) row[i] = static_cast<float>(src[i]);
      round_block(row, &a.q[r * k + b * kGroup], a.d[r * nb + b], a.start[r * nb + b]);
#endif
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 4 activation bytes in every lane.
inline __m512i quad_of(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof(v));
  return _mm512_set1_epi32(v);
}
#endif

// c[m][j * 16 ...] for the J column blocks from j0 = sum over blocks of d * (q . w), M rows (from row0),
// against one task's packed weights (k wide). c lives in memory (an int32 accumulator per block).
template <int M, int J, bool Stream>
void tile(const Act& a, int64_t row0, const uint8_t* w, int64_t k, int j0, float (*c)[kCols]) {
  const int64_t nb = k / kGroup;
  const int8_t* q[M];
  const float* d[M];
  const int32_t* st[M];
  for (int m = 0; m < M; ++m) {
    q[m] = a.q.data() + (row0 + m) * k;
    d[m] = a.d.data() + (row0 + m) * nb;
    st[m] = a.start.data() + (row0 + m) * nb;
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(c[m] + (j0 + j) * kBlock, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[M][J];
    const uint8_t* src = w + b * kQuads * kCols * 4 + j0 * 64;
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < J; ++j) acc[m][j] = _mm512_set1_epi32(st[m][b]);
    // Unrolled: around a loop GCC copied every accumulator twice a step (docs/perf-notes.md).
#pragma GCC unroll 8
    for (int p = 0; p < kQuads; ++p) {
      __m512i wv[J];
      for (int j = 0; j < J; ++j) {
        const char* ahead = reinterpret_cast<const char*>(src + p * kCols * 4 + j * 64) + kPrefetch;
        if constexpr (Stream) _mm_prefetch(ahead, _MM_HINT_NTA);
        else _mm_prefetch(ahead, _MM_HINT_T0);
        wv[j] = _mm512_loadu_si512(src + p * kCols * 4 + j * 64);
      }
      for (int m = 0; m < M; ++m) {
        const __m512i xv = quad_of(q[m] + b * kGroup + p * 4);
        for (int j = 0; j < J; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], wv[j], xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 dv = _mm512_set1_ps(d[m][b]);
      for (int j = 0; j < J; ++j) {
        float* dst = c[m] + (j0 + j) * kBlock;
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][j]), dv, _mm512_loadu_ps(dst)));
      }
    }
  }
#else
  for (int m = 0; m < M; ++m)
    for (int col = j0 * kBlock; col < (j0 + J) * kBlock; ++col) {
      const int j = col / kBlock, i = col % kBlock;
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = st[m][b];
        for (int t = 0; t < kGroup; ++t) {
          const int64_t kk = b * kGroup + t;
          dot += static_cast<int32_t>(w[((kk / 4) * kNB + j) * 64 + i * 4 + kk % 4]) * q[m][kk];
        }
        s += static_cast<float>(dot) * d[m][b];
      }
      c[m][col] = s;
    }
#endif
}

// A pass: the task's columns in halves, so that 8 rows x 2 vectors of accumulators stay in registers.
template <int M, bool Stream>
void tile_all(const Act& a, int64_t row0, const uint8_t* w, int64_t k, float (*c)[kCols]) {
  for (int j0 = 0; j0 < kNB; j0 += kHalf) tile<M, kHalf, Stream>(a, row0, w, k, j0, c);
}

template <bool Stream>
void tile_rows(int rows, const Act& a, int64_t row0, const uint8_t* w, int64_t k, float (*c)[kCols]) {
  switch (rows) {
    case 1: tile_all<1, Stream>(a, row0, w, k, c); break;
    case 2: tile_all<2, Stream>(a, row0, w, k, c); break;
    case 3: tile_all<3, Stream>(a, row0, w, k, c); break;
    case 4: tile_all<4, Stream>(a, row0, w, k, c); break;
    case 5: tile_all<5, Stream>(a, row0, w, k, c); break;
    case 6: tile_all<6, Stream>(a, row0, w, k, c); break;
    case 7: tile_all<7, Stream>(a, row0, w, k, c); break;
    default: tile_all<kRows, Stream>(a, row0, w, k, c); break;
  }
}

// Rows for the next pass over `left` rows, at most kRows, the passes as even as they can be.
inline int64_t rows_of_pass(int64_t left) {
  const int64_t passes = (left + kRows - 1) / kRows;
  return (left + passes - 1) / passes;
}

void store(const float* c, int64_t cols, const float* scale, const float* bias, float* dst) {
  for (int64_t j = 0; j < cols; ++j) dst[j] = c[j] * scale[j] + (bias != nullptr ? bias[j] : 0.f);
}

void store(const float* c, int64_t cols, const float* scale, const float* bias, at::BFloat16* dst) {
  store_row(c, cols, scale, bias, reinterpret_cast<uint16_t*>(dst));
}

// Rows [r0, r1) against one task's weights, written to y's columns [col0, col0 + 64) below n.
template <typename T>
void run_task(const Act& a, const uint8_t* w, int64_t k, int64_t r0, int64_t r1, int64_t col0, int64_t n,
              const float* scale, const float* bias, T* y) {
  float c[kRows][kCols];
  const bool stream = r1 - r0 <= kRows;  // one pass: the weights are read once
  const int64_t cols = std::min<int64_t>(kCols, n - col0);
  for (int64_t r = r0, rows; r < r1; r += rows) {
    rows = rows_of_pass(r1 - r);
    if (stream) tile_rows<true>(static_cast<int>(rows), a, r, w, k, c);
    else tile_rows<false>(static_cast<int>(rows), a, r, w, k, c);
    for (int i = 0; i < rows; ++i) store(c[i], cols, scale + col0, bias ? bias + col0 : nullptr, y + (r + i) * n + col0);
  }
}

template <typename T>
void run(const torch::Tensor& x, const uint8_t* wp, int64_t blocks, const std::vector<float>& s,
         const std::vector<float>& b, int64_t n, torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1);
  const int threads = at::get_num_threads();
  thread_local Act kept;  // per calling thread; the parallel region below must see this one
  Act& a = kept;
  quantize(x.data_ptr<T>(), x.stride(0), m, k, a, threads);
  T* yp = y.data_ptr<T>();
  const Plan p = plan(m, blocks, threads, kRows);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < p.tasks; ++t) {
    const int64_t j = t / p.chunks, r0 = (t % p.chunks) * p.chunk;
    run_task(a, wp + j * k * kCols, k, r0, std::min(m, r0 + p.chunk), j * kCols, n, s.data(),
             b.empty() ? nullptr : b.data(), yp);
  }
}

}  // namespace

// x [M, K] float32 or bf16 (rows contiguous, K a multiple of 32), w packed uint8 [ceil(N/64), K/4, 4, 16, 4]
// (w + 128; exec/quant_linear.to_w8a8), scale [N] per output column, bias [N] or None -> [M, N] in x's dtype.
torch::Tensor gemm_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale, const Opt& bias,
                        int64_t n) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.stride(1) == 1,
              "gemm_int8: x [M, K] float32 or bf16, rows contiguous");
  TORCH_CHECK(x.size(1) % kGroup == 0, "gemm_int8: K (", x.size(1), ") must be a multiple of 32");
  TORCH_CHECK(w.dim() == 5 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == kNB &&
              w.size(3) == kBlock && w.size(4) == 4, "gemm_int8: w packed uint8 [N/64, K/4, 4, 16, 4]");
  TORCH_CHECK(w.size(1) * 4 == x.size(1), "gemm_int8: x has ", x.size(1), " columns, w ", w.size(1) * 4);
  TORCH_CHECK(n > 0 && n <= w.size(0) * kCols && n > (w.size(0) - 1) * kCols, "gemm_int8: n does not match w");
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const std::vector<float> s = column_floats(scale, n, "gemm_int8", "scale");
  const std::vector<float> b = column_floats(bias, n, "gemm_int8", "bias");
  TORCH_CHECK(!s.empty(), "gemm_int8: a scale is required");
  if (x.scalar_type() == at::kFloat) run<float>(x, w.data_ptr<uint8_t>(), w.size(0), s, b, n, y);
  else run<at::BFloat16>(x, w.data_ptr<uint8_t>(), w.size(0), s, b, n, y);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_int8", &gemm_int8, py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("n"));
  m.def("has_vnni", &built_with_vnni);
  // For the fused decode step (exec/csrc/fused_decode.cpp), which calls it from C++.
  m.def("_addresses", [] { return std::map<std::string, int64_t>{{"gemm_int8", reinterpret_cast<int64_t>(&gemm_int8)}}; });
}
