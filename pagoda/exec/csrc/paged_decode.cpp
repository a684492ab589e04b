// Paged decode attention on CPU: one query token per sequence attends over its blocks in place.
// Reads each cached K/V row once for all query heads of its KV group, so the step costs about one
// pass over the context's KV, with no gathered copy and no padding to the longest sequence.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                          T* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                          int64_t max_blocks, float scale) {
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kf(D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, hk = idx % Hkv;
      const int64_t S = lens[b];
      scores.assign(G * S, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(q[(b * Hq + hk * G + g) * D + d]) * scale;
      const int64_t* table = bt + b * max_blocks;
      for (int64_t t = 0; t < S; ++t) {
        const T* kp = kc + ((table[t / BS] * BS + t % BS) * Hkv + hk) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = to_f(kp[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = &qf[g * D];
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * S + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * S];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < S; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < S; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < S; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const T* vp = vc + ((table[t / BS] * BS + t % BS) * Hkv + hk) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = to_f(vp[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * S + t];
          float* ag = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + hk * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

// q [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
// seq_lens [B]. Returns [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  auto bt = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            B, Hq, Hkv, D, BS, bt.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
