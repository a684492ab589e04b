// Fused CPU kernels for the decoder layer's element-wise work: RMSNorm (optionally with the residual
// add), rotary embedding in place, and SiLU-and-multiply, for float32 and bfloat16.
//
// In PyTorch each of these is several passes over memory with a temporary per op (rotary alone is
// neg, cat, two muls and an add, for q and for k); together they were ~10 % of a float32 step on 2
// cores, and in bf16, where every op also converts, ~25 % of a prefill step's non-GEMM time. Here
// each is one pass, parallel over rows, computing in float32.
//
// bf16 rounds to bf16 exactly where the PyTorch path in layers.py rounds (each op's result: every
// product and sum of rotary, silu before the multiply, the normalised row before the weight). So:
// - rotary and SiLU-and-multiply equal that path bit for bit (tests/model/test_cpu_layer_ops.py).
//   SiLU reads silu(gate) from a table of all 65,536 bf16 gates, each bf16(g / (1 + e)) with
//   e = exp(-g) rounded once to float, and the division in float; torch's F.silu gives the same
//   table on every ISA it dispatches to (AVX-512, AVX2, scalar: checked for all inputs), its float
//   exp being accurate enough that no entry rounds differently. The product with `up` is exact in
//   float and rounds once, as torch's bf16 multiply does.
// - RMSNorm adds its float32 sum of squares in another order than torch's reduction, which can move
//   a rare normalised value by a bf16 step. Its order is fixed in the source (sum_squares), so the
//   kernel gives the same bits whether the compiler targets AVX2 or AVX-512.
// float32 agrees with the PyTorch path within float rounding (FMA contraction, exp_f32 within 1 ulp).
// NaN and inf go through as IEEE arithmetic takes them (no -ffast-math; see vec_math.h).
#include <torch/extension.h>

#include <map>
#include <string>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "silu_bf16.h"
#include "vec_math.h"

using bf16 = c10::BFloat16;
using pagoda::kLanes;

// Load as float; round a float result as the element type stores it (identity for float32); store.
static inline float load(float x) { return x; }
static inline float load(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
using pagoda::bf16_bits;  // silu_bf16.h: c10's rounding, in a form that vectorises
template <typename T> static inline float rnd(float f);
template <> inline float rnd<float>(float f) { return f; }
template <> inline float rnd<bf16>(float f) {
  const uint32_t u = static_cast<uint32_t>(bf16_bits(f)) << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
static inline void store(float* p, float f) { *p = f; }
static inline void store(bf16* p, float f) { p->x = bf16_bits(f); }

// Rows per parallel task: about 16k elements, so a decode step's few rows stay on one thread.
static int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

static void check_dtype(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
}

static void check_rows(const torch::Tensor& x, const char* name) {
  check_dtype(x, name);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
}

static void check_weight(const torch::Tensor& w, const torch::Tensor& x) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1),
              "weight must be contiguous, of x's dtype and hidden size");
}

// The float32 sum of squares of x[0, H), in 2 * kLanes partial sums (two vector chains, so the FMA
// latency is hidden), added up in a fixed order: the same bits on every ISA.
template <typename T>
static inline float sum_squares(const T* x, int64_t H) {
  float lane[2 * kLanes] = {};
  int64_t j = 0;
  for (; j + 2 * kLanes <= H; j += 2 * kLanes)
    for (int64_t l = 0; l < 2 * kLanes; ++l) {
      const float v = load(x[j + l]);
      lane[l] += v * v;
    }
  // The tail into the lanes too: as a running sum the compiler may multiply apart from the add in
  // one build and fuse them in another.
  for (int64_t l = 0; j + l < H; ++l) {
    const float v = load(x[j + l]);
    lane[l] += v * v;
  }
  for (int64_t l = 0; l < kLanes; ++l) lane[l] += lane[l + kLanes];
  return pagoda::combine_lanes(lane);
}

// out = weight * round(x / rms(x)), the sum of squares in float32.
template <typename T>
static inline void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) store(out + j, rnd<T>(load(x[j]) * inv) * load(w[j]));
}

template <typename T>
static void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, float eps) {
  const int64_t T_ = x.size(0), H = x.size(1), xs = x.stride(0);
  const T *xp = x.data_ptr<T>(), *w = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(xp + i * xs, w, op + i * H, H, eps);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(x, weight, out, static_cast<float>(eps));
  else rms_norm_impl<bf16>(x, weight, out, static_cast<float>(eps));
  return out;
}

template <typename T>
static void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, float eps) {
  const int64_t T_ = x.size(0), H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, T_, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T *xr = xp + i * xs, *rr = rp + i * rs;
      for (int64_t j = 0; j < H; ++j) store(rr + j, load(rr[j]) + load(xr[j]));
      norm_row(rr, w, xr, H, eps);
    }
  });
}

// In place: residual += x, then x = weight * round(residual / rms(residual)).
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have the same shape and dtype");
  check_weight(weight, x);
  if (x.scalar_type() == torch::kFloat32) add_rms_norm_impl<float>(x, residual, weight, static_cast<float>(eps));
  else add_rms_norm_impl<bf16>(x, residual, weight, static_cast<float>(eps));
}

template <typename T>
static void rotary_impl(torch::Tensor& x, const int64_t* pp, const float* cs) {
  const int64_t T_ = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  T* xp = x.data_ptr<T>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T_, grain_rows(NH * D), [&](int64_t begin, int64_t end) {
    std::vector<float> rounded(std::is_same_v<T, float> ? 0 : D);
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cs + pp[i] * D;
      if constexpr (!std::is_same_v<T, float>) {
        // The reference multiplies by cos and sin rounded to x's dtype (then rounds each product):
        // round the row's table entries once, not once per head.
        for (int64_t j = 0; j < D; ++j) rounded[j] = rnd<T>(c[j]);
        c = rounded.data();
      }
      const float* s = c + half;
      for (int64_t h = 0; h < NH; ++h) {
        T* r = xp + i * s0 + h * s1;
        for (int64_t j = 0; j < half; ++j) {
          const float cj = c[j], sj = s[j];
          const float x1 = load(r[j]), x2 = load(r[j + half]);
          store(r + j, rnd<T>(x1 * cj) + rnd<T>(-x2 * sj));
          store(r + j + half, rnd<T>(x2 * cj) + rnd<T>(x1 * sj));
        }
      }
    }
  });
}

// In place, rotate-half (NeoX) rotary on x [T, heads, D] (inner dim contiguous, other strides free):
// for i < D/2, (x1, x2) = (x[i], x[i + D/2]) -> (x1 cos - x2 sin, x2 cos + x1 sin), with cos and sin
// read from the float32 table cos_sin[position] = [cos(p f_0..f_{D/2-1}), sin(p f_0..f_{D/2-1})].
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with contiguous rows");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.dim() == 2);
  const int64_t T = x.size(0), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && cos_sin.size(1) == D, "cos_sin rows must hold D/2 cosines and D/2 sines");
  auto pos = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T, "one position per row");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < max_pos, "position out of the cos/sin table");
  if (x.scalar_type() == torch::kFloat32) rotary_impl<float>(x, pp, cos_sin.data_ptr<float>());
  else rotary_impl<bf16>(x, pp, cos_sin.data_ptr<float>());
}

template <typename T>
static void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t T_ = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* table = std::is_same_v<T, bf16> ? pagoda::silu_bf16_table() : nullptr;
  at::parallel_for(0, T_, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T *g = xp + i * xs, *u = g + I;
      T* o = op + i * I;
      if constexpr (std::is_same_v<T, bf16>) {
        static_assert(sizeof(bf16) == sizeof(uint16_t), "bf16 is its bits");
        pagoda::silu_mul_row(reinterpret_cast<const uint16_t*>(g), reinterpret_cast<const uint16_t*>(u), I, table,
                             reinterpret_cast<uint16_t*>(o));
      } else {
        for (int64_t j = 0; j < I; ++j) {
          const float gj = load(g[j]);
          store(o + j, gj / (1.f + pagoda::exp_f32(-gj)) * load(u[j]));
        }
      }
    }
  });
}

// x = [gate | up] [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == torch::kFloat32) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<bf16>(x, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
  // Entry points for the fused decode step (exec/csrc/fused_decode.cpp), which calls them from C++.
  m.def("_addresses", [] { return std::map<std::string, int64_t>{{"rms_norm", reinterpret_cast<int64_t>(&rms_norm)}, {"add_rms_norm_", reinterpret_cast<int64_t>(&add_rms_norm_)}, {"rotary_", reinterpret_cast<int64_t>(&rotary_)}, {"silu_and_mul", reinterpret_cast<int64_t>(&silu_and_mul)}}; });
}
