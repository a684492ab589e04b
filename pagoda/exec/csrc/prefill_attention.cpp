// Causal prefill attention on the CPU, float32, for grouped-query heads: one chunk of n queries (the
// last n positions of a sequence of S tokens) against that sequence's S keys and values.
//
// torch's flash SDPA ran this at ~36-49 GFLOP/s for 272-token prompts on 2 AVX2 cores, against ~140
// for the model's GEMMs, so a mixed step spent ~14 % of its time here. This kernel is flash attention
// (a query block against key blocks, with a running max and sum) arranged so that nearly all of its
// work is two small GEMMs done by one register-tiled AVX2 micro-kernel:
// - a work item is one KV head and a block of BQ positions, and the G query heads that share that KV
//   head are stacked into one [G * BQ, D] block, so each K/V block read serves all of them;
// - each K block is packed transposed ([D, BK], zero-padded), so QK^T and PV are both A x B with B
//   row-major and 16 columns per register tile; K and V are packed once a call, before the work
//   items, which all read the same packed blocks;
// - key blocks wholly above the diagonal are skipped; the diagonal block is masked.
// bf16 inputs (with AVX512-BF16) take the bf16 micro-kernel of bf16_tile.h for both GEMMs: the
// scores' products are exact in float32; p.v takes the probabilities rounded to bf16 (as torch's
// flash attention and transformers' eager attention do for a bf16 model) against V packed in that
// kernel's task layout, at twice the rate of float32 FMAs. The running max, the sums and the
// output stay float32 until the one rounding of the output. Those bf16 operands live in
// prefill_bf16.h; where the CPU has AMX, the same two GEMMs run on its tiles (prefill_amx.h).
//
// inf and NaN go through as in exact arithmetic over each query's visible keys (built without
// -ffast-math; see vec_math.h): a NaN or +inf score makes its row NaN and a -inf score weighs 0, as
// in torch's softmax, and a key past a query's position contributes nothing to it, even a NaN or inf
// one (torch's SDPA lets such a value leak into every row: 0 * NaN).
#include <torch/extension.h>

#include <map>
#include <string>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "f32_tile.h"
#include "prefill_amx.h"
#include "prefill_bf16.h"
#include "vec_math.h"

namespace {

using pagoda_f32::gemm;
using pagoda_prefill::BK;
using pagoda_prefill::correct;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
using pagoda_prefill::Bf16Scores;
using pagoda_prefill::Bf16Values;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
using pagoda_prefill::AmxScores;
using pagoda_prefill::AmxValues;
#endif

constexpr int64_t BQ = 32;  // query positions per work item (times G query heads)
constexpr int64_t kPackBytes = 16 << 20;  // the most a call's packed K and V take at once
// The running max before any key: the lowest float, not -inf, so that the first correction
// exp(kNoMax - m) is exp(0) = 1 when every score so far is -inf (-inf - -inf would be NaN) and 0 for
// any finite score m above it.
constexpr float kNoMax = std::numeric_limits<float>::lowest();

// The queries of one work item and one block of keys, packed for the scores' GEMM: float32 (q
// scaled, K transposed) for the float32 micro-kernel, or bf16 pairs (K as [D/2][64][2], the layout
// of bf16_tile.h; Bf16Scores in prefill_bf16.h) for vdpbf16ps, whose products of two bf16 values
// are exact in float32.
struct F32Scores {
  using Packed = float;  // a key block: [D][BK] floats
  std::vector<float> Qp;
  F32Scores(int64_t M, int64_t D) : Qp(M * D) {}
  void load_q(int64_t r, const float* src, int64_t D, float scale) {
    for (int64_t d = 0; d < D; ++d) Qp[r * D + d] = src[d] * scale;
  }
  static void pack_k(const float* kp, int64_t ks, int64_t nk, int64_t D, float* kt) {
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < BK; ++j) kt[d * BK + j] = j < nk ? kp[j * ks + d] : 0.f;
  }
  void scores(int64_t rows, int64_t nkp, int64_t D, const float* kt, float* Sc) {
    gemm<false>(Qp.data(), D, kt, BK, rows, nkp, D, Sc, BK);
  }
  // The row's visible scores are final already (the scale is on q): their max with init.
  static float scale_max(float* s, int64_t n, float, float init) { return pagoda::max_f32(s, n, init); }
};

// A call's values, packed once, and p.v: O[r] = O[r] * corr[r] + sum_j P[r][j] V[j] over a key
// block's first `keys` keys. Float32 rows and FMAs here; Bf16Values (prefill_bf16.h) for vdpbf16ps.
struct F32Values {
  int64_t S, D, nkb;
  std::unique_ptr<float[]> rows_;  // [heads][S][D], not zeroed: pack writes every row read
  F32Values(int64_t heads, int64_t S_, int64_t D_, int64_t nkb_) : S(S_), D(D_), nkb(nkb_), rows_(new float[heads * S_ * D_]) {}
  static int64_t bytes(int64_t S, int64_t D, int64_t) { return S * D * 4; }
  const float* block(int64_t h, int64_t kb) const { return &rows_[(h * S + kb * BK) * D]; }
  // Packs block kb of head h (nk rows of src, rows ks apart); whether all of them are finite.
  bool pack(int64_t h, int64_t kb, const float* src, int64_t ks, int64_t nk) {
    float* dst = &rows_[(h * S + kb * BK) * D];
    for (int64_t j = 0; j < nk; ++j) std::copy_n(src + j * ks, D, dst + j * D);
    return pagoda::all_finite(dst, nk * D);
  }
  bool finite(int64_t h, int64_t kb, int64_t j0, int64_t j1) const { return pagoda::all_finite(block(h, kb) + j0 * D, (j1 - j0) * D); }
  float value(int64_t h, int64_t kb, int64_t j, int64_t d) const { return block(h, kb)[j * D + d]; }
  // The keys the GEMM may take when keys [all_see, nk) hold a non-finite value some rows must not see.
  static int64_t gemm_keys(int64_t all_see) { return all_see; }
  struct Scratch {};
  void accumulate(int64_t h, int64_t kb, const float* P, int64_t rows, int64_t keys, const float* corr, float* O,
                  Scratch&) const {
    correct(O, corr, rows, D);
    gemm<true>(P, BK, block(h, kb), D, rows, D, keys, O, D);
  }
};

// dst[d] = o[d] * inv, rounded to bf16 (to nearest even, as torch rounds) for a bf16 output.
inline void store_row(const float* o, float inv, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
}
inline void store_row(const float* o, float inv, int64_t D, uint16_t* dst) {
  int64_t d = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512 vi = _mm512_set1_ps(inv);
  for (; d + 16 <= D; d += 16) pagoda_bf16::store16(dst + d, pagoda_bf16::to_bf16(_mm512_mul_ps(_mm512_loadu_ps(o + d), vi)));
#endif
  for (; d < D; ++d) {
    const c10::BFloat16 b(o[d] * inv);
    std::memcpy(dst + d, &b, sizeof(*dst));
  }
}

// The kernel over inputs of type T (float, or bf16 bits) with the scores of Scores and the values of Values.
template <typename T, typename Scores, typename Values>
void run(const T* qp, const T* kp, const T* vp, T* op, int64_t n, int64_t Hq, int64_t D, int64_t S, int64_t Hkv,
         int64_t qs, int64_t ks, int64_t vs, int64_t qhs, int64_t khs, int64_t vhs, float fscale) {
  using Packed = typename Scores::Packed;
  const int64_t G = Hq / Hkv, ctx = S - n, M = G * BQ;
  const int64_t nqb = (n + BQ - 1) / BQ, nkb = (S + BK - 1) / BK;
  // Every KV head's keys and values are packed once for all the query blocks that read them (each
  // block packing its own copy cost as much as its GEMMs): K blocks in Scores' layout, V in Values',
  // and whether each V block is all finite. Heads go in groups whose packed copies take at most
  // kPackBytes (one group for a small model's prompt; a long context takes a head at a time).
  const int64_t head_bytes = nkb * D * BK * static_cast<int64_t>(sizeof(Packed)) + Values::bytes(S, D, nkb);
  const int64_t hg = std::clamp<int64_t>(kPackBytes / head_bytes, 1, Hkv);
  // Not zeroed (value-initialising them was ~3 % of a call): pack_k writes the whole of each block.
  std::unique_ptr<Packed[]> Kp(new Packed[hg * nkb * D * BK]);
  Values values(hg, S, D, nkb);
  std::vector<char> v_finite(hg * nkb);
  for (int64_t h0 = 0; h0 < Hkv; h0 += hg) {
    const int64_t nh = std::min(hg, Hkv - h0);
    const auto k_block = [&](int64_t h, int64_t kb) { return &Kp[((h - h0) * nkb + kb) * D * BK]; };
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp for schedule(static)
      for (int64_t item = 0; item < nh * nkb; ++item) {
        const int64_t h = h0 + item / nkb, j0 = (item % nkb) * BK, nk = std::min(BK, S - j0);
        Scores::pack_k(kp + j0 * ks + h * khs, ks, nk, D, k_block(h, j0 / BK));
        v_finite[item] = values.pack(h - h0, j0 / BK, vp + j0 * vs + h * vhs, vs, nk);
      }
      Scores qk(M, D);
      typename Values::Scratch scratch;
      std::vector<float> Sc(M * BK), O(M * D), mx(M), sum(M), mnew(M), corr(M);
      // Later query blocks see more keys: hand items out dynamically, the costliest first.
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < nqb * nh; ++item) {
        const int64_t qb = nqb - 1 - item / nh, h = h0 + item % nh;
        const int64_t i0 = qb * BQ, nq = std::min(BQ, n - i0);
        // Rows g * nq + i of the stacked block: query head h * G + g at chunk position i0 + i.
        const int64_t rows = G * nq;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < nq; ++i) qk.load_q(g * nq + i, qp + (i0 + i) * qs + (h * G + g) * qhs, D, fscale);
        std::fill(O.begin(), O.begin() + rows * D, 0.f);
        std::fill(mx.begin(), mx.begin() + rows, kNoMax);
        std::fill(sum.begin(), sum.begin() + rows, 0.f);
        const int64_t kend = ctx + i0 + nq;  // keys this block's last query sees
        for (int64_t j0 = 0; j0 < kend; j0 += BK) {
          const int64_t nk = std::min(BK, kend - j0);
          const int64_t nkp = (nk + 15) / 16 * 16;  // columns padded to whole tiles
          const int64_t hl = h - h0, kb = j0 / BK;
          qk.scores(rows, nkp, D, k_block(h, j0 / BK), Sc.data());
          // Keys [0, all_see) are visible to every row; row r also sees [all_see, visible(r)).
          const auto visible = [&](int64_t r) { return std::clamp<int64_t>(ctx + i0 + r % nq + 1 - j0, 0, nk); };
          const int64_t all_see = visible(0);
          // The rows' new maxima first, then their corrections in one loop that vectorises: one
          // exp_f32 a row, each a chain of dependent scalar steps, cost 2-6 % of the kernel.
          for (int64_t r = 0; r < rows; ++r) mnew[r] = Scores::scale_max(&Sc[r * BK], visible(r), fscale, mx[r]);
          for (int64_t r = 0; r < rows; ++r) corr[r] = pagoda::exp_f32(mx[r] - mnew[r]);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t vis = visible(r);
            float* s = &Sc[r * BK];
            const float m = mnew[r], correction = corr[r];
            const float add = pagoda::exp_minus_max_(s, vis, m);
            for (int64_t j = vis; j < nk; ++j) s[j] = 0.f;  // masked: weight 0
            sum[r] = sum[r] * correction + add;
            mx[r] = m;
          }
          // A masked key's weight is 0, but through the GEMM 0 * (an inf or NaN value) would still be
          // NaN: when some row does not see every key of the block and such a value is there, the GEMM
          // takes the keys all rows see and each row adds its own triangle.
          if (all_see == nk || v_finite[hl * nkb + kb] || values.finite(hl, kb, all_see, nk)) {
            values.accumulate(hl, kb, Sc.data(), rows, nk, corr.data(), O.data(), scratch);
          } else {
            const int64_t from = Values::gemm_keys(all_see);
            values.accumulate(hl, kb, Sc.data(), rows, from, corr.data(), O.data(), scratch);
            for (int64_t r = 0; r < rows; ++r) {
              const float* s = &Sc[r * BK];
              float* o = &O[r * D];
              for (int64_t j = from, vis = visible(r); j < vis; ++j) {
                const float p = std::is_same_v<T, float> ? s[j] : pagoda_bf16::round_bf16(s[j]);
                for (int64_t d = 0; d < D; ++d) o[d] += p * values.value(hl, kb, j, d);
              }
            }
          }
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t r = g * nq + i;
            const float inv = 1.f / sum[r];
            store_row(&O[r * D], inv, D, op + ((i0 + i) * Hq + h * G + g) * D);
          }
      }
    }
  }
}

}  // namespace

// q [n, Hq, D], k and v [S, Hkv, D] (any strides but a contiguous head_dim), n <= S, all float32 or
// all bf16; query i sits at position S - n + i and attends keys 0..S - n + i. Returns [n, Hq, D] in
// the inputs' dtype. bf16 takes AMX tiles for both GEMMs where the CPU has them and `tiles` allows
// (prefill_amx.h), else vdpbf16ps where the CPU has AVX512-BF16, with D % 32 == 0; elsewhere it is
// widened to float32 (the output rounded once).
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, bool tiles) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "prefill_attention takes float32 or bfloat16, the same for q, k and v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D && Hkv > 0 && Hq % Hkv == 0 && n <= S,
              "k and v must be [S, Hkv, D] with S >= the query count and Hkv dividing Hq");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  for (const auto* t : {&q, &k, &v}) TORCH_CHECK(t->stride(2) == 1, "head_dim must be contiguous");
  const float fscale = static_cast<float>(scale);
  if (dtype == torch::kBFloat16) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (D % 32 == 0) {
      auto out = torch::empty({n, Hq, D}, q.options());
      const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (tiles && pagoda_bf16::amx_permitted()) {
        run<uint16_t, AmxScores, AmxValues>(bits(q), bits(k), bits(v), o, n, Hq, D, S, Hkv, q.stride(0), k.stride(0),
                                            v.stride(0), q.stride(1), k.stride(1), v.stride(1), fscale);
        return out;
      }
#endif
      run<uint16_t, Bf16Scores, Bf16Values>(bits(q), bits(k), bits(v), o, n, Hq, D, S, Hkv, q.stride(0), k.stride(0),
                                            v.stride(0), q.stride(1), k.stride(1), v.stride(1), fscale);
      return out;
    }
#endif
    return attention(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), scale, tiles)
        .to(torch::kBFloat16);
  }
  auto out = torch::empty({n, Hq, D}, q.options());
  run<float, F32Scores, F32Values>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), n, Hq,
                        D, S, Hkv, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
                        fscale);
  return out;
}

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  return attention(std::move(q), std::move(k), std::move(v), scale, true);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // `tiles` False: the vdpbf16ps kernel where AMX would serve (the two kernels' bits differ; tests).
  m.def("prefill_attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        py::arg("tiles") = true);
  // For the fused CPU step (exec/csrc/fused_decode.cpp), which calls it from C++ for a lone prompt's step.
  m.def("_addresses", [] {
    return std::map<std::string, int64_t>{{"prefill_attention", reinterpret_cast<int64_t>(&prefill_attention)}};
  });
}
