// CPU kernels for the paged KV cache: decode attention over the blocks in place, and the KV write.
//
// Decode: a batch step is bound by reading the context's K/V from memory, so the kernel reads each
// cached row once. A cache row holds all KV heads of one token ([Hkv, D], contiguous); when there
// are enough sequences to keep every thread busy, one work item takes all KV heads of a sequence and
// reads whole rows. With few sequences (a lone long decode) items are (sequence, KV head) instead,
// trading strided reads for parallelism. The cache may hold a float32 model's K/V as bf16 or fp16
// (kv_cache_dtype): half the bytes to read, converted to float32 on the way in; or any model's as
// int8 rows with fp16 scales per 32 values (kv_int8.h), about a quarter of float32's bytes.
//
// inf and NaN go through as in exact arithmetic over the context (built without -ffast-math; see
// vec_math.h): a NaN or +inf score makes its head's output NaN, as torch's softmax does; a -inf
// score weighs 0; cache rows past a sequence's length (the rest of its last block) are never read.
#include <torch/extension.h>

#include <map>
#include <string>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "balanced_for.h"
#include "block_prefetch.h"
#include "decode_bf16.h"
#include "kv_int8.h"
#include "vec_math.h"

// `n` values of `src` as floats in `dst`. The 16-bit conversions use AVX2/F16C where the compiler
// targets them: c10's scalar conversions made a 16-bit cache slower to decode than a float one.
template <typename C>
static inline void to_floats(const C* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    for (; i + 8 <= n; i += 8) {  // bf16 is the top half of an fp32: widen to 32 bits and shift
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<C, c10::Half>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The K or V rows of one work item in one cache block, as floats: `n` rows of the item's KV heads,
// `stride` floats apart. A float cache is read in place; a 16-bit or int8 one is converted into `buf`.
template <typename C>
static inline const float* block_rows(const C* cache, int64_t block, int64_t BS, int64_t Hkv, int64_t D, int64_t hk0,
                                      int64_t row, int64_t n, float* buf, int64_t& stride) {
  if constexpr (std::is_same_v<C, int8_t>) {  // [blocks, Hkv, BS, W]: each head's rows together
    const int64_t W = pagoda_kv8::row_bytes(D), heads = row / D;
    const int8_t* base = cache + (block * Hkv + hk0) * BS * W;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < n; ++j) pagoda_kv8::dequantize_row(base + (h * BS + j) * W, D, buf + j * row + h * D);
    stride = row;
    return buf;
  }
  const C* base = cache + (block * BS * Hkv + hk0) * D;
  if constexpr (std::is_same_v<C, float>) {
    stride = Hkv * D;
    return base;
  } else {
    for (int64_t j = 0; j < n; ++j) to_floats(base + j * Hkv * D, row, buf + j * row);
    stride = row;
    return buf;
  }
}

// Asks for a work item's rows in one cache block (n rows of `heads` KV heads from hk0) over `steps`
// calls of ahead.step() (block_prefetch.h).
template <typename C>
static inline void ask_block(pagoda_prefetch::Ahead& ahead, const C* cache, int64_t block, int64_t BS, int64_t Hkv,
                             int64_t D, int64_t hk0, int64_t heads, int64_t n, int64_t steps) {
  if constexpr (std::is_same_v<C, int8_t>) {  // [blocks, Hkv, BS, W]
    const int64_t W = pagoda_kv8::row_bytes(D);
    ahead.start(cache + (block * Hkv + hk0) * BS * W, heads, n * W, BS * W, steps);
  } else {
    ahead.start(cache + (block * BS * Hkv + hk0) * D, n, heads * D * sizeof(C), Hkv * D * sizeof(C), steps);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The eight lane sums of a0..a7, as one vector.
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half
  __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// acc[0, 8R) += sum_j p[j] * v_j[0, 8R): R independent FMA chains, kept in registers.
template <int R>
static inline void pv_chunk(const float* p, const float* v, int64_t stride, int64_t n, float* acc) {
  __m256 r[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) r[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * stride;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) r[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), r[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + 8 * i, r[i]);
}
#endif

// scores[h * S + j] = q_h . k_j for the n tokens of one block (`scores` points at the block's first
// token). A dot product is one chain of dependent FMAs, so eight tokens go at once.
static inline void qk_block(const float* qf, const float* kb, int64_t stride, int64_t n, int64_t nh, int64_t G,
                            int64_t D, float* scores, int64_t S, pagoda_prefetch::Ahead& ahead) {
  for (int64_t h = 0; h < nh; ++h) {
    ahead.step();
    const float* qh = qf + h * D;
    const float* kh = kb + (h / G) * D;
    float* sh = scores + h * S;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
      for (; j + 8 <= n; j += 8) {
        __m256 a[8];
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + (j + u) * stride + d), a[u]);
        }
        _mm256_storeu_ps(sh + j, hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
      }
    }
#endif
    for (; j < n; ++j) {
      const float* kj = kh + j * stride;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qh[d] * kj[d];
      sh[j] = s;
    }
  }
}

// acc[h] += sum_j p[h * S + j] * v_j for the n tokens of one block (`p` points at its first token).
static inline void pv_block(const float* p, int64_t S, const float* vb, int64_t stride, int64_t n, int64_t nh,
                            int64_t G, int64_t D, float* acc, pagoda_prefetch::Ahead& ahead) {
  for (int64_t h = 0; h < nh; ++h) {
    ahead.step();
    const float* ph = p + h * S;
    const float* vh = vb + (h / G) * D;
    float* ah = acc + h * D;
    int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d0 + 64 <= D; d0 += 64) pv_chunk<8>(ph, vh + d0, stride, n, ah + d0);
    for (; d0 + 32 <= D; d0 += 32) pv_chunk<4>(ph, vh + d0, stride, n, ah + d0);
    for (; d0 + 8 <= D; d0 += 8) pv_chunk<1>(ph, vh + d0, stride, n, ah + d0);
#endif
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = d0; d < D; ++d) ah[d] += ph[j] * vh[j * stride + d];
  }
}

// T: the type of q and out (the model's); C: the cache's (the same, or a 16-bit type that holds an
// fp32 model's K/V in half the bytes). The context is walked block by block: a block's rows for the
// item's KV heads, then every query head of the item against them.
template <typename T, typename C>
static void decode_kernel(const T* q, int64_t qs0, int64_t qs1, const C* kc, const C* vc, const int64_t* bt,
                          const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                          int64_t max_blocks, float scale) {
  const int64_t G = Hq / Hkv;
  const int64_t heads_kv = B >= 4 * at::get_num_threads() ? Hkv : 1;  // KV heads per work item
  const int64_t items_per_seq = Hkv / heads_kv;
  const int64_t nh = heads_kv * G;  // query heads per work item
  const int64_t row = heads_kv * D;  // floats read per token and per K or V
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
    if (pagoda_decode16::takes(D)) {
      auto bits = [](const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
      pagoda_decode16::decode(bits(q), qs0, qs1, bits(kc), bits(vc), bt, lens, out, B, Hq, Hkv, D, BS, max_blocks, scale, heads_kv);
      return;
    }
  }
#endif
  const auto tokens = [&](int64_t idx) { return pagoda_split::decode_item_cost(lens, idx, items_per_seq); };
  pagoda_split::balanced_for(B * items_per_seq, tokens, [&](const pagoda_split::Queue& queue) {
    std::vector<float> qf(nh * D), acc(nh * D), inv(nh), scores, buf(BS * row);
    for (int64_t idx; (idx = queue.take()) >= 0;) {
      const int64_t next = queue.peek();  // a hint: the item this thread takes next, unless another takes it
      const int64_t b = idx / items_per_seq, hk0 = (idx % items_per_seq) * heads_kv, h0 = hk0 * G;
      const int64_t S = lens[b];
      const int64_t* table = bt + b * max_blocks;
      scores.resize(nh * S);
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(q[b * qs0 + (h0 + h) * qs1 + d]) * scale;
      int64_t stride;
      pagoda_prefetch::Ahead ahead;  // the next block's rows, asked for while this one is worked on
      for (int64_t t0 = 0; t0 < S; t0 += BS) {
        const int64_t n = std::min(BS, S - t0);
        if (t0 + BS < S) ask_block(ahead, kc, table[t0 / BS + 1], BS, Hkv, D, hk0, heads_kv, std::min(BS, S - t0 - BS), nh);
        else ask_block(ahead, vc, table[0], BS, Hkv, D, hk0, heads_kv, std::min(BS, S), nh);
        const float* kb = block_rows(kc, table[t0 / BS], BS, Hkv, D, hk0, row, n, buf.data(), stride);
        qk_block(qf.data(), kb, stride, n, nh, G, D, &scores[t0], S, ahead);
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = &scores[h * S];
        const float m = pagoda::max_f32(sh, S, -std::numeric_limits<float>::infinity());
        inv[h] = 1.f / pagoda::exp_minus_max_(sh, S, m);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < S; t0 += BS) {
        const int64_t n = std::min(BS, S - t0);
        if (t0 + BS < S) {
          ask_block(ahead, vc, table[t0 / BS + 1], BS, Hkv, D, hk0, heads_kv, std::min(BS, S - t0 - BS), nh);
        } else if (next >= 0) {  // the first K block of the thread's next item, which would wait on memory
          const int64_t b_next = next / items_per_seq, hk0_next = (next % items_per_seq) * heads_kv;
          ask_block(ahead, kc, bt[b_next * max_blocks], BS, Hkv, D, hk0_next, heads_kv, std::min(BS, lens[b_next]), nh);
        } else {
          ahead.none();
        }
        const float* vb = block_rows(vc, table[t0 / BS], BS, Hkv, D, hk0, row, n, buf.data(), stride);
        pv_block(&scores[t0], S, vb, stride, n, nh, G, D, acc.data(), ahead);
      }
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + h0 + h) * D + d] = static_cast<T>(acc[h * D + d] * inv[h]);
    }
  });
}

// Calls f with a value of the C++ type of a cache dtype: float, BFloat16 or Half.
template <typename F>
static void with_cache_type(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kChar: f(int8_t{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", t);
  }
}

// q [B, Hq, D] (each head's D values contiguous; q may be a view into the fused QKV projection);
// k_cache/v_cache [num_blocks, block_size, Hkv, D], or int8 [num_blocks, Hkv, block_size, W] (kv_int8.h);
// block_tables [B, max_blocks]; seq_lens [B].
// Returns a new contiguous [B, Hq, D] in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  auto bt = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  auto out = torch::empty({B, Hq, D}, q.options());
  const bool q8 = k_cache.scalar_type() == at::kChar;  // [blocks, Hkv, BS, W] (kv_int8.h)
  TORCH_CHECK(k_cache.dim() == 4, "unexpected KV cache shape");
  const int64_t Hkv = k_cache.size(q8 ? 1 : 2), BS = k_cache.size(q8 ? 2 : 1);
  TORCH_CHECK(!q8 || pagoda_kv8::row_bytes(D) == k_cache.size(3), "int8 KV rows do not match head_dim");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    with_cache_type(k_cache.scalar_type(), [&](auto tag) {
      using C = decltype(tag);
      decode_kernel<scalar_t, C>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<C>(),
                                 v_cache.data_ptr<C>(), bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                 out.data_ptr<scalar_t>(), B, Hq, Hkv, D, BS, bt.size(1), static_cast<float>(scale));
    });
  });
  return out;
}

// Rows a thread of write_kv takes at least. A decode step's few rows are little to copy, but a row
// that opens a fresh block faults its pages in (~5-13 us a 4 KiB page on the VMs measured, where the
// host backs a page only once the guest first touches it): serial, those faults held both threads
// for ~4.7 ms of a 64-row step (docs/perf-notes.md, "2026-12-07 (night)"). Split, each thread takes
// its own rows' faults.
constexpr int64_t kWriteGrain = 8;

// Rows i in [begin, end) of src (row stride `stride` elements) into rows slots[i] of dst, converted.
template <typename S, typename C>
static void convert_rows(C* dst, const S* src, const int64_t* slots, int64_t stride, int64_t row, int64_t begin,
                         int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    C* d = dst + slots[i] * row;
    const S* r = src + i * stride;
    for (int64_t j = 0; j < row; ++j) d[j] = static_cast<C>(static_cast<float>(r[j]));
  }
}

// The int8 cache's write: each token's row of each KV head quantized on its own (kv_int8.h); the
// caller has checked the shapes and slots.
static void write_kv_int8(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kk, torch::Tensor vv,
                          torch::Tensor sl) {
  const int64_t n = kk.size(0), row = kk.size(1), Hkv = k_cache.size(1), BS = k_cache.size(2), D = row / Hkv;
  const int64_t W = k_cache.size(3);
  const int64_t* s = sl.data_ptr<int64_t>();
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kk.scalar_type(), "write_kv_int8", [&] {
    const scalar_t* kp = kk.data_ptr<scalar_t>();
    const scalar_t* vp = vv.data_ptr<scalar_t>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t at_row = ((s[i] / BS) * Hkv + h) * BS + s[i] % BS;
          pagoda_kv8::put_row(kc + at_row * W, D, kp + i * kk.stride(0) + h * D);
          pagoda_kv8::put_row(vc + at_row * W, D, vp + i * vv.stride(0) + h * D);
        }
    });
  });
}

// Copy token i's K and V rows ([Hkv, D] each) to cache row slots[i], converted to the cache's dtype
// when it differs (a 16-bit cache under an fp32 model). k and v may be row-strided views (slices of
// the fused QKV projection) as long as each row is contiguous; index_copy_ on such views goes
// element by element and costs ~100x a row copy.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "K and V differ in dtype");
  auto kk = k.reshape({k.size(0), -1});
  auto vv = v.reshape({v.size(0), -1});
  TORCH_CHECK(kk.stride(1) == 1 && vv.stride(1) == 1, "K/V rows must be contiguous");
  auto sl = slots.to(torch::kLong).contiguous();
  const int64_t n = kk.size(0), row = kk.size(1);
  const bool q8 = k_cache.scalar_type() == at::kChar;  // [blocks, Hkv, BS, W] (kv_int8.h)
  const bool rows_fit = k_cache.dim() == 4 &&
                        (q8 ? row % k_cache.size(1) == 0 && pagoda_kv8::row_bytes(row / k_cache.size(1)) == k_cache.size(3)
                            : k_cache.size(2) * k_cache.size(3) == row);
  TORCH_CHECK(rows_fit && k_cache.sizes() == v_cache.sizes() && vv.size(0) == n &&
                  vv.size(1) == row && slots.numel() == n,
              "K/V rows do not match the cache's [blocks, block_size, kv_heads, head_dim] (int8: [blocks, kv_heads, "
              "block_size, row bytes]) or the slot count");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(q8 ? 2 : 1);
  const int64_t* s = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < num_slots, "slot out of range");
  if (q8) {
    write_kv_int8(k_cache, v_cache, kk, vv, sl);
    return;
  }
  if (k.scalar_type() != k_cache.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
      with_cache_type(k_cache.scalar_type(), [&](auto tag) {
        using C = decltype(tag);
        at::parallel_for(0, n, kWriteGrain, [&](int64_t begin, int64_t end) {
          convert_rows(k_cache.data_ptr<C>(), kk.data_ptr<scalar_t>(), s, kk.stride(0), row, begin, end);
          convert_rows(v_cache.data_ptr<C>(), vv.data_ptr<scalar_t>(), s, vv.stride(0), row, begin, end);
        });
      });
    });
    return;
  }
  const int64_t esize = k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(kk.data_ptr());
  const char* vp = static_cast<const char*>(vv.data_ptr());
  const int64_t ks = kk.stride(0) * esize, vs = vv.stride(0) * esize, bytes = row * esize;
  at::parallel_for(0, n, kWriteGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kc + s[i] * bytes, kp + i * ks, bytes);
      std::memcpy(vc + s[i] * bytes, vp + i * vs, bytes);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("write_kv", &write_kv);
  // Entry points for the fused decode step (exec/csrc/fused_decode.cpp), which calls them from C++.
  m.def("_addresses", [] { return std::map<std::string, int64_t>{{"paged_decode", reinterpret_cast<int64_t>(&paged_decode)}, {"write_kv", reinterpret_cast<int64_t>(&write_kv)}}; });
}
