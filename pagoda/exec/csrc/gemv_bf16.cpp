// A bf16 linear for a few rows: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in float32
// and rounded to bf16 once, as oneDNN's bf16 GEMM does.
//
// A decode step of one sequence is a chain of matrix-vector products: each weight byte is used once
// per row, so the step is bound by reading the weights. oneDNN's packed GEMM, blocked for many rows,
// read them at about 40 % of the machine's memory bandwidth at one row. Here each thread streams its
// own contiguous range of weight rows (the plain [N, K] layout, as the checkpoint stores it, so the
// tied embedding doubles as the LM head's weight), four at a time, against the few activation rows
// that stay in L1. With AVX512-BF16 one vdpbf16ps multiplies 32 bf16 pairs into 16 float lanes.
//
// Float32 sums in another order than oneDNN's: results may differ from it in the last bf16 bit.
#include <torch/extension.h>

#include <map>
#include <string>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxRows = 4;
// Prefetch this far ahead of each weight row's loads: 4 KiB measured best among 1-16 KiB at one row.
constexpr int kPrefetchBytes = 4096;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Dot products of M activation rows with 4 weight rows, all of length k.
template <int M>
inline void dot4(const uint16_t* const* xs, const uint16_t* w, int64_t ldw, int64_t k, float out[M][4]) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + i) + kPrefetchBytes, _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ldw + i);
    }
    for (int m = 0; m < M; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + i);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  if (i < k) {  // the tail: masked loads read zeros past the row's end
    const __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * ldw + i);
    for (int m = 0; m < M; ++m) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs[m] + i);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) out[m][j] = _mm512_reduce_add_ps(acc[m][j]);
}
#endif

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One weight row against M activation rows, in plain float32 arithmetic (the tail rows of a range,
// and CPUs without AVX512-BF16).
template <int M>
inline void dot1(const uint16_t* const* xs, const uint16_t* w, int64_t k, float out[M]) {
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
    for (int64_t i = 0; i < k; ++i) s += bf16_to_float(xs[m][i]) * bf16_to_float(w[i]);
    out[m] = s;
  }
}

template <int M>
void gemv_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, const float* bias,
               c10::BFloat16* y, int64_t ldy, int64_t k, int64_t n0, int64_t n1) {
  const uint16_t* xs[M];
  for (int m = 0; m < M; ++m) xs[m] = x + m * ldx;
  auto store = [&](int m, int64_t n, float v) { y[m * ldy + n] = c10::BFloat16(bias ? v + bias[n] : v); };
  int64_t n = n0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (; n + 4 <= n1; n += 4) {
    float out[M][4];
    dot4<M>(xs, w + n * ldw, ldw, k, out);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) store(m, n + j, out[m][j]);
  }
#endif
  for (; n < n1; ++n) {
    float out[M];
    dot1<M>(xs, w + n * ldw, k, out);
    for (int m = 0; m < M; ++m) store(m, n, out[m]);
  }
}

}  // namespace

// x: [M, K] bf16 (M <= 4, rows contiguous), w: [N, K] bf16 (rows contiguous), bias: [N] or none.
torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: shapes");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv_bf16: 1 to 4 rows");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "gemv_bf16: rows must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto y = torch::empty({m, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0), ldw = w.stride(0);
  // Ranges of whole groups of four rows; 64 rows (72 KB of weights at K=576) amortise a task's start.
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 4, n1 = std::min(n, g1 * 4);
    switch (m) {
      case 1: gemv_rows<1>(xp, ldx, wp, ldw, bp, yp, n, k, n0, n1); break;
      case 2: gemv_rows<2>(xp, ldx, wp, ldw, bp, yp, n, k, n0, n1); break;
      case 3: gemv_rows<3>(xp, ldx, wp, ldw, bp, yp, n, k, n0, n1); break;
      default: gemv_rows<4>(xp, ldx, wp, ldw, bp, yp, n, k, n0, n1); break;
    }
  });
  return y;
}

bool has_avx512_bf16() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", &gemv_bf16);
  m.def("has_avx512_bf16", &has_avx512_bf16);
  // Entry points for the fused decode step (exec/csrc/fused_decode.cpp), which calls them from C++.
  m.def("_addresses", [] { return std::map<std::string, int64_t>{{"gemv_bf16", reinterpret_cast<int64_t>(&gemv_bf16)}}; });
}
