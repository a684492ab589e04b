// CPU kernels for the paged KV cache: decode attention over the blocks in place, and the KV write.
//
// Decode: a batch step is bound by reading the context's K/V from memory, so the kernel reads each
// cached row once. A cache row holds all KV heads of one token ([Hkv, D], contiguous); when there
// are enough sequences to keep every thread busy, one work item takes all KV heads of a sequence and
// reads whole rows. With few sequences (a lone long decode) items are (sequence, KV head) instead,
// trading strided reads for parallelism.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// A pointer to `n` floats of `src`: `src` itself when T is float, else a converted copy in `buf`.
template <typename T>
static inline const float* as_floats(const T* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf.data();
  }
}

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                          T* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                          int64_t max_blocks, float scale) {
  const int64_t G = Hq / Hkv;
  const int64_t heads_kv = B >= 4 * at::get_num_threads() ? Hkv : 1;  // KV heads per work item
  const int64_t items_per_seq = Hkv / heads_kv;
  const int64_t nh = heads_kv * G;  // query heads per work item
  const int64_t row = heads_kv * D;  // floats read per token and per K or V
  at::parallel_for(0, B * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nh * D), acc(nh * D), scores, buf(row);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / items_per_seq, hk0 = (idx % items_per_seq) * heads_kv, h0 = hk0 * G;
      const int64_t S = lens[b];
      const int64_t* table = bt + b * max_blocks;
      scores.resize(nh * S);
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(q[(b * Hq + h0 + h) * D + d]) * scale;
      for (int64_t t = 0; t < S; ++t) {
        const float* kr = as_floats(kc + ((table[t / BS] * BS + t % BS) * Hkv + hk0) * D, row, buf);
        for (int64_t h = 0; h < nh; ++h) {
          const float* qh = &qf[h * D];
          const float* kh = kr + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * S + t] = s;
        }
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = &scores[h * S];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < S; ++t) m = sh[t] > m ? sh[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < S; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < S; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const float* vr = as_floats(vc + ((table[t / BS] * BS + t % BS) * Hkv + hk0) * D, row, buf);
        for (int64_t h = 0; h < nh; ++h) {
          const float p = scores[h * S + t];
          const float* vh = vr + (h / G) * D;
          float* ah = &acc[h * D];
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d) out[(b * Hq + h0 + h) * D + d] = static_cast<T>(acc[h * D + d]);
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

// Copy token i's K and V rows ([Hkv, D] each) to cache row slots[i]. k and v may be row-strided views
// (slices of the fused QKV projection) as long as each row is contiguous; index_copy_ on such views
// goes element by element and costs ~100x a row copy.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type());
  auto kk = k.reshape({k.size(0), -1});
  auto vv = v.reshape({v.size(0), -1});
  TORCH_CHECK(kk.stride(1) == 1 && vv.stride(1) == 1, "K/V rows must be contiguous");
  auto sl = slots.to(torch::kLong).contiguous();
  const int64_t n = kk.size(0), row = kk.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) * k_cache.size(3) == row &&
                  vv.size(0) == n && vv.size(1) == row && slots.numel() == n,
              "K/V rows do not match the cache's [blocks, block_size, kv_heads, head_dim] or the slot count");
  const int64_t num_slots = k_cache.numel() / row;
  const int64_t esize = k_cache.element_size();
  const int64_t* s = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < num_slots, "slot out of range");
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(kk.data_ptr());
  const char* vp = static_cast<const char*>(vv.data_ptr());
  const int64_t ks = kk.stride(0) * esize, vs = vv.stride(0) * esize, bytes = row * esize;
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kc + s[i] * bytes, kp + i * ks, bytes);
      std::memcpy(vc + s[i] * bytes, vp + i * vs, bytes);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("write_kv", &write_kv);
}
