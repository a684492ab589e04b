// Fused float32 CPU kernels for the decoder layer's element-wise work: RMSNorm (optionally with the
// residual add), rotary embedding in place, and SiLU-and-multiply.
//
// In PyTorch each of these is several passes over memory with a temporary per op (rotary alone is
// neg, cat, two muls and an add, for q and for k); together they were ~10 % of a step on 2 cores.
// Here each is one pass, parallel over rows. Only float32: bf16 must round where the reference
// rounds, and the PyTorch path does that.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

// Rows per parallel task: about 16k floats, so a decode step's few rows stay on one thread.
static int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

static void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
}

static inline void norm_row(const float* x, const float* w, float* out, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < H; ++j) ss += x[j] * x[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) out[j] = x[j] * inv * w[j];
}

// out = x / rms(x) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1));
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T, H}, x.options());
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(xp + i * xs, w, op + i * H, H, static_cast<float>(eps));
  });
  return out;
}

// In place: residual += x, then x = residual / rms(residual) * weight.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1));
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float *xr = xp + i * xs, *rr = rp + i * rs;
      for (int64_t j = 0; j < H; ++j) rr[j] += xr[j];
      norm_row(rr, w, xr, H, static_cast<float>(eps));
    }
  });
}

// In place, rotate-half (NeoX) rotary on x [T, heads, D] (inner dim contiguous, other strides free):
// for i < D/2, (x1, x2) = (x[i], x[i + D/2]) -> (x1 cos - x2 sin, x2 cos + x1 sin), with cos and sin
// read from cos_sin[position] = [cos(p f_0..f_{D/2-1}), sin(p f_0..f_{D/2-1})].
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1, "x must be float32 [T, heads, D]");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.dim() == 2);
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos_sin.size(1) == D, "cos_sin rows must hold D/2 cosines and D/2 sines");
  auto pos = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T, "one position per row");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < max_pos, "position out of the cos/sin table");
  float* xp = x.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, grain_rows(NH * D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *c = cs + pp[i] * D, *s = c + half;
      for (int64_t h = 0; h < NH; ++h) {
        float* r = xp + i * s0 + h * s1;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = r[j], x2 = r[j + half];
          r[j] = x1 * c[j] - x2 * s[j];
          r[j + half] = x2 * c[j] + x1 * s[j];
        }
      }
    }
  });
}

// x = [gate | up] [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *g = xp + i * xs, *u = g + I;
      float* o = op + i * I;
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
}
