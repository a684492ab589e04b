// A decode step's decoder layers in one call: the Llama family's layer (RMSNorm with the residual
// add, QKV projection, rotary, KV write, paged decode attention, output projection, RMSNorm, gate-up
// projection, SiLU-and-multiply, down projection) for a pure-decode step, each row one sequence's
// next token, or for the step of one prompt with no cached prefix (its attention by the prefill
// kernel, as the modules call it); at most kQuantMaxRows rows with quantized weights.
//
// Why: with one to a few sequences a step's kernels take ~5 ms of SmolLM2's ~9, and the Python that
// calls them (~25 calls a layer, 30 layers) most of the rest. Here the same kernels are called, in
// the same order on the same tensors, from C++: the results are the Python path's bit for bit.
//
// The kernels live in the other extensions (model/csrc/layer_ops.cpp, exec/csrc/paged_decode.cpp,
// prefill_attention.cpp, gemm_bf16.cpp, quant_matmul.cpp); each exports its entry points' addresses
// (`_addresses`), which the plan is built with. oneDNN's packed linears are called through torch's
// dispatcher.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <map>
#include <string>
#include <vector>

namespace {

using Opt = c10::optional<torch::Tensor>;
using RmsNormFn = torch::Tensor (*)(torch::Tensor, torch::Tensor, double);
using AddRmsNormFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, double);
using RotaryFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor);
using SiluMulFn = torch::Tensor (*)(torch::Tensor);
using DecodeFn = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, double);
using WriteKVFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor);
using PrefillFn = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, double);
using GemmFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const Opt&, int64_t, const Opt&);
using GemmSiluFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, const Opt&);
using GemmBlocksFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const Opt&, int64_t, bool);
using GemmBlocksSiluFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, bool);
using GemmI8Fn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const Opt&, int64_t);
using QuantFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, const Opt&, int64_t);
using MoEFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                const torch::Tensor&, int64_t);

constexpr int64_t kQuantMaxRows = 8;  // quant_matmul.cpp's fused rows (quant_linear.FUSED_ROWS)

// cpu_linear.bucket_rows: m up to 16, else m rounded up to a multiple of an eighth of the power of
// two below it, so that oneDNN builds few primitives.
int64_t bucket_rows(int64_t m) {
  if (m <= 16) return m;
  int bits = 0;
  while ((int64_t{1} << bits) <= m) ++bits;
  const int64_t step = int64_t{1} << (bits - 4);
  return (m + step - 1) / step * step;
}

// oneDNN's packed linear as cpu_linear._packed_linear calls it: rows padded with zeros to the bucket.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const Opt& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const Opt&,
                                                  c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                                                  c10::optional<c10::string_view>)>();
  const int64_t m = x.size(0), rows = bucket_rows(m);
  torch::Tensor in = x.contiguous();
  if (rows != m) {
    torch::Tensor padded = torch::zeros({rows, x.size(1)}, x.options());
    padded.narrow(0, 0, m).copy_(in);
    in = padded;
  }
  torch::Tensor out = op.call(in, packed, bias, "none", c10::List<c10::optional<c10::Scalar>>(), c10::string_view(""));
  return rows != m ? out.narrow(0, 0, m) : out;
}

// One projection: oneDNN packed (0; its GGUF blocks, if kept, serve a few rows of a step of decodes
// where oneDNN has AMX), the bf16 GEMM over its packed weight (1: `packed` in its layout, `n` output
// columns), or weights kept quantized, row blocks side by side, then the bias (2), or int8 weights
// with a scale per column, then the bias: in the bf16 GEMM's layout (3) or the W8A8 GEMM's (4); or an
// MLP's gate_up with SiLU-and-multiply in the bf16 GEMM (5: gemm_bf16_silu, `n`: the activation's).
struct Linear {
  int kind = 0;
  torch::Tensor packed, scale;
  int64_t n = 0;
  Opt bias;
  Opt blocks;  // kinds 0, 1, 5: the same weights in GGUF blocks, for a few rows (gemm_bf16.cpp)
  std::vector<torch::Tensor> qdata;
  std::vector<int64_t> qtype;
  std::vector<Opt> qscale;
  int64_t tile_rows = 0;
};

// An MoE layer's routed experts in place of the dense MLP: the router, then the grouped kernel
// (exec/csrc/moe_experts.cpp) over its packed experts, as FusedMoE.routed calls them; or, for
// experts kept quantized (model/quantized.QuantExperts), a projection per expert (`gate_up`, `down`).
struct Experts {
  bool present = false;
  Linear router;
  torch::Tensor w13, w2;
  std::vector<Linear> gate_up, down;
  int64_t top_k = 0, expert_start = 0;
  bool renormalize = false;
};

struct Layer {
  Experts experts;
  torch::Tensor in_norm, post_norm, k_cache, v_cache;
  Opt q_norm, k_norm;  // Qwen3's per-head RMSNorms of q and k
  double qk_eps = 0.0;
  double in_eps, post_eps, scale;
  int64_t heads, kv_heads, head_dim;
  Linear qkv, o, gate_up, down;
};

// RMSNorm over [T, heads, D] as layers.rms_norm_reference computes it (the modules take that path
// for 3-D tensors), with the same ATen ops, so the same bits.
torch::Tensor head_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (x.scalar_type() == torch::kFloat32) return at::rms_norm(x, {x.size(-1)}, weight, eps);
  torch::Tensor xf = x.to(torch::kFloat32);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * xf.to(x.scalar_type());
}

struct Kernels {
  RmsNormFn rms_norm;
  AddRmsNormFn add_rms_norm_;
  RotaryFn rotary_;
  SiluMulFn silu_and_mul;
  DecodeFn paged_decode;
  WriteKVFn write_kv;
  GemmFn gemm_bf16 = nullptr;    // only where the CPU has AVX512-BF16
  GemmSiluFn gemm_bf16_silu = nullptr;
  GemmBlocksFn gemm_bf16_blocks = nullptr;
  GemmBlocksSiluFn gemm_bf16_blocks_silu = nullptr;
  GemmI8Fn gemm_i8_bf16 = nullptr;
  GemmI8Fn gemm_int8 = nullptr;  // the W8A8 GEMM (gemm_int8.cpp), only where the CPU has AVX512-VNNI
  QuantFn quant_matmul = nullptr;  // only for models with quantized weights
  MoEFn moe_experts = nullptr;     // only for MoE models with the grouped kernel
  PrefillFn prefill_attention = nullptr;  // for a prompt's step (prefill_attention.cpp), where it builds
};

template <typename F>
F address(const std::map<std::string, int64_t>& at, const std::string& name, bool required = true) {
  auto it = at.find(name);
  TORCH_CHECK(it != at.end() || !required, "fused decode: no address for kernel ", name);
  return it == at.end() ? nullptr : reinterpret_cast<F>(it->second);
}

class DecodePlan {
 public:
  explicit DecodePlan(const std::map<std::string, int64_t>& at) {
    k_.rms_norm = address<RmsNormFn>(at, "rms_norm");
    k_.add_rms_norm_ = address<AddRmsNormFn>(at, "add_rms_norm_");
    k_.rotary_ = address<RotaryFn>(at, "rotary_");
    k_.silu_and_mul = address<SiluMulFn>(at, "silu_and_mul");
    k_.paged_decode = address<DecodeFn>(at, "paged_decode");
    k_.write_kv = address<WriteKVFn>(at, "write_kv");
    k_.gemm_bf16 = address<GemmFn>(at, "gemm_bf16", false);
    k_.gemm_bf16_silu = address<GemmSiluFn>(at, "gemm_bf16_silu", false);
    k_.gemm_bf16_blocks = address<GemmBlocksFn>(at, "gemm_bf16_blocks", false);
    k_.gemm_bf16_blocks_silu = address<GemmBlocksSiluFn>(at, "gemm_bf16_blocks_silu", false);
    k_.gemm_i8_bf16 = address<GemmI8Fn>(at, "gemm_i8_bf16", false);
    k_.gemm_int8 = address<GemmI8Fn>(at, "gemm_int8", false);
    k_.quant_matmul = address<QuantFn>(at, "quant_matmul", false);
    k_.moe_experts = address<MoEFn>(at, "moe_experts_bf16", false);
    k_.prefill_attention = address<PrefillFn>(at, "prefill_attention", false);
  }

  void add_layer(torch::Tensor in_norm, double in_eps, torch::Tensor post_norm, double post_eps, Linear qkv,
                 Linear o, Linear gate_up, Linear down, torch::Tensor k_cache, torch::Tensor v_cache, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, double scale) {
    for (const Linear* l : {&qkv, &o, &gate_up, &down}) {
      TORCH_CHECK((l->kind != 1 || k_.gemm_bf16) && (l->kind != 5 || k_.gemm_bf16_silu) &&
                      (l->kind != 0 || !l->blocks || k_.gemm_bf16_blocks), "fused decode: a bf16 GEMM linear without its kernel");
      TORCH_CHECK(l->kind != 3 || k_.gemm_i8_bf16, "fused decode: an int8 GEMM linear without its kernel");
      TORCH_CHECK(l->kind != 4 || k_.gemm_int8, "fused decode: a W8A8 linear without its kernel");
      TORCH_CHECK(l->kind != 2 || k_.quant_matmul, "fused decode: a quantized linear without its kernel");
      quantized_ = quantized_ || l->kind == 2;
    }
    Layer l;
    l.in_norm = in_norm, l.post_norm = post_norm, l.k_cache = k_cache, l.v_cache = v_cache;
    l.in_eps = in_eps, l.post_eps = post_eps, l.scale = scale;
    l.heads = heads, l.kv_heads = kv_heads, l.head_dim = head_dim;
    l.qkv = std::move(qkv), l.o = std::move(o), l.gate_up = std::move(gate_up), l.down = std::move(down);
    layers_.push_back(std::move(l));
  }

  // Qwen3: the last added layer's q and k go through per-head RMSNorms before the rotary.
  void set_qk_norms(torch::Tensor q_norm, torch::Tensor k_norm, double eps) {
    TORCH_CHECK(!layers_.empty(), "fused decode: no layer to give q/k norms");
    layers_.back().q_norm = q_norm;
    layers_.back().k_norm = k_norm;
    layers_.back().qk_eps = eps;
  }

  // An MoE layer: the last added layer's MLP is its routed experts (the gate_up and down given to
  // add_layer are not used).
  void set_experts(Linear router, torch::Tensor w13, torch::Tensor w2, int64_t top_k, bool renormalize,
                   int64_t expert_start) {
    TORCH_CHECK(!layers_.empty(), "fused decode: no layer to give experts");
    TORCH_CHECK(k_.moe_experts, "fused decode: experts without the grouped MoE kernel");
    TORCH_CHECK(router.kind != 1 || k_.gemm_bf16, "fused decode: a bf16 GEMM router without its kernel");
    TORCH_CHECK(router.kind != 2, "fused decode: a quantized router");
    Experts& e = layers_.back().experts;
    e.present = true;
    e.router = std::move(router);
    e.w13 = w13, e.w2 = w2;
    e.top_k = top_k, e.renormalize = renormalize, e.expert_start = expert_start;
  }

  // An MoE layer whose experts are kept quantized: each expert's gate-up and down projections.
  void set_quantized_experts(Linear router, std::vector<Linear> gate_up, std::vector<Linear> down, int64_t top_k,
                             bool renormalize) {
    TORCH_CHECK(!layers_.empty() && !gate_up.empty() && gate_up.size() == down.size(), "fused decode: experts");
    TORCH_CHECK(router.kind != 1 || k_.gemm_bf16, "fused decode: a bf16 GEMM router without its kernel");
    for (const std::vector<Linear>* ls : {&gate_up, &down})
      for (const Linear& l : *ls) {
        TORCH_CHECK(l.kind >= 2 && (l.kind != 2 || k_.quant_matmul) && (l.kind != 3 || k_.gemm_i8_bf16) &&
                        (l.kind != 4 || k_.gemm_int8), "fused decode: a quantized expert without its kernel");
        quantized_ = quantized_ || l.kind == 2;
      }
    Experts& e = layers_.back().experts;
    e.present = true;
    e.router = std::move(router);
    e.gate_up = std::move(gate_up), e.down = std::move(down);
    e.top_k = top_k, e.renormalize = renormalize, e.expert_start = 0;
  }

  // h: the embeddings [M, H]; each row a sequence's next token, or (`prompt`) one prompt's tokens with
  // no earlier context; up to `block_rows` rows read kind 0's blocks, beyond `ours_rows` on AMX tiles
  // (cpu_linear.block_rows). Returns
  // (the last layer's output, the residual stream), which the final norm adds and normalises.
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor h, torch::Tensor positions, torch::Tensor rope_table,
                                               torch::Tensor slots, torch::Tensor block_tables,
                                               torch::Tensor seq_lens, bool prompt, int64_t block_rows, int64_t ours_rows) {
    const int64_t m = h.size(0);
    block_rows_ = block_rows, ours_rows_ = ours_rows;
    TORCH_CHECK(!prompt || k_.prefill_attention, "fused decode: a prompt's step without the prefill kernel");
    TORCH_CHECK(m >= 1 && (m <= kQuantMaxRows || !quantized_), "fused decode: quantized weights take 1 to ",
                kQuantMaxRows, " rows");
    torch::Tensor residual;
    for (const Layer& l : layers_) {
      if (!residual.defined()) {
        residual = h;
        h = k_.rms_norm(h, l.in_norm, l.in_eps);
      } else {
        k_.add_rms_norm_(h, residual, l.in_norm, l.in_eps);
      }
      const int64_t q_size = l.heads * l.head_dim, kv_size = l.kv_heads * l.head_dim;
      torch::Tensor qkv = linear(h, l.qkv);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({m, l.heads, l.head_dim});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({m, l.kv_heads, l.head_dim});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({m, l.kv_heads, l.head_dim});
      if (l.q_norm.has_value()) {
        q = head_rms_norm(q, *l.q_norm, l.qk_eps);
        k = head_rms_norm(k, *l.k_norm, l.qk_eps);
      }
      k_.rotary_(q, positions, rope_table);
      k_.rotary_(k, positions, rope_table);
      k_.write_kv(l.k_cache, l.v_cache, k, v, slots);
      // A prompt's step: its rows attend to each other causally, over their own fresh K/V, as
      // TorchPagedAttention._prefill computes it for a prompt with no earlier context.
      torch::Tensor attn = prompt ? k_.prefill_attention(q, k, v, l.scale)
                                  : k_.paged_decode(q, l.k_cache, l.v_cache, block_tables, seq_lens, l.scale);
      h = linear(attn.reshape({m, q_size}), l.o);
      k_.add_rms_norm_(h, residual, l.post_norm, l.post_eps);
      h = l.experts.present ? routed(h, l.experts) : linear(silu_of_gate_up(h, l.gate_up), l.down);
    }
    return {h, residual};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool quantized() const { return quantized_; }

 private:
  // FusedMoE.routed with fused_moe.select_experts' ATen calls (softmax in float32, topk, the
  // renormalisation), so the same experts and weights, and grouped_fused_experts' kernel call.
  torch::Tensor routed(const torch::Tensor& h, const Experts& e) const {
    const torch::Tensor probs = at::softmax(linear(h, e.router), -1, torch::kFloat32);
    auto [weights, ids] = at::topk(probs, e.top_k, -1);
    if (e.renormalize) weights = weights / weights.sum(-1, true);
    if (!e.gate_up.empty()) return per_expert(h, e, weights, ids);
    return k_.moe_experts(h.contiguous(), ids.contiguous(), weights.contiguous(), e.w13, e.w2, e.expert_start);
  }

  // fused_moe.fused_experts with its ATen calls (one rank, all experts its own): the (token,
  // expert) pairs sorted by expert, each expert's run of rows through its projections.
  torch::Tensor per_expert(const torch::Tensor& h, const Experts& e, const torch::Tensor& weights,
                           const torch::Tensor& ids) const {
    const int64_t experts = static_cast<int64_t>(e.gate_up.size());
    const torch::Tensor local = ids.reshape(-1);
    const torch::Tensor order = at::argsort(local, true);
    const torch::Tensor counts = at::bincount(local, {}, experts).cpu();
    const int64_t* count = counts.data_ptr<int64_t>();
    const int64_t rows = order.size(0);
    const torch::Tensor tokens = at::floor_divide(order, e.top_k);
    const torch::Tensor sorted_x = h.index_select(0, tokens);
    torch::Tensor gate_up, down;
    for (int pass = 0; pass < 2; ++pass) {
      const torch::Tensor& in = pass == 0 ? sorted_x : gate_up;
      torch::Tensor out;
      for (int64_t x = 0, start = 0; x < experts; start += count[x], ++x) {
        if (!count[x]) continue;
        const torch::Tensor y = linear(in.narrow(0, start, count[x]), pass == 0 ? e.gate_up[x] : e.down[x]);
        if (!out.defined()) out = h.new_empty({rows, y.size(1)});
        out.narrow(0, start, count[x]).copy_(y);
      }
      if (pass == 0) gate_up = k_.silu_and_mul(out);
      else down = out;
    }
    const torch::Tensor scale = weights.reshape(-1).index_select(0, order).unsqueeze(1);
    if (h.scalar_type() == torch::kFloat32) down.mul_(scale);
    else down = (down.to(torch::kFloat32) * scale).to(h.scalar_type());
    return at::zeros_like(h).index_add_(0, tokens, down);
  }

  // silu(gate) * up of an MLP's [gate | up] projection: in its GEMM's epilogue where the GEMM has one
  // (kind 5; kind 0's blocks for a step's few rows, when the halves are whole 64-column tasks), else
  // the projection then silu_and_mul. The same bits either way (gemm_bf16.cpp).
  torch::Tensor silu_of_gate_up(const torch::Tensor& x, const Linear& l) const {
    if (l.kind == 5) return linear(x, l);
    if (on_blocks(x, l) && !l.bias.has_value() && k_.gemm_bf16_blocks_silu && l.n % 128 == 0)
      return k_.gemm_bf16_blocks_silu(x.stride(-1) == 1 ? x : x.contiguous(), *l.blocks, l.n / 2, x.size(0) > ours_rows_);
    return k_.silu_and_mul(linear(x, l));
  }

  // Whether x's rows read l's GGUF blocks (oneDNN-packed weights that keep them, a step's few rows).
  bool on_blocks(const torch::Tensor& x, const Linear& l) const {
    return l.kind == 0 && l.blocks.has_value() && x.size(0) <= block_rows_;
  }

  torch::Tensor linear(const torch::Tensor& x, const Linear& l) const {
    if (l.kind == 5) return k_.gemm_bf16_silu(x.stride(-1) == 1 ? x : x.contiguous(), l.packed, l.n, l.blocks);
    if (l.kind == 1) return k_.gemm_bf16(x.stride(-1) == 1 ? x : x.contiguous(), l.packed, l.bias, l.n, l.blocks);
    if (l.kind == 3 || l.kind == 4) {
      const GemmI8Fn f = l.kind == 3 ? k_.gemm_i8_bf16 : k_.gemm_int8;
      const torch::Tensor out = f(x.stride(-1) == 1 ? x : x.contiguous(), l.packed, l.scale, Opt(), l.n);
      return l.bias.has_value() ? out + *l.bias : out;
    }
    if (on_blocks(x, l))
      return k_.gemm_bf16_blocks(x.stride(-1) == 1 ? x : x.contiguous(), *l.blocks, l.bias, l.n, x.size(0) > ours_rows_);
    if (l.kind != 2) return packed_linear(x, l.packed, l.bias);
    const torch::Tensor xc = x.contiguous();
    std::vector<torch::Tensor> outs;
    outs.reserve(l.qdata.size());
    for (size_t i = 0; i < l.qdata.size(); ++i)
      outs.push_back(k_.quant_matmul(xc, l.qdata[i], l.qtype[i], l.qscale[i], l.tile_rows));
    torch::Tensor out = outs.size() == 1 ? outs[0] : torch::cat(outs, -1);
    return l.bias.has_value() ? out + *l.bias : out;
  }

  Kernels k_;
  std::vector<Layer> layers_;
  bool quantized_ = false;  // then at most kQuantMaxRows rows: beyond, the modules dequantize for a GEMM
  int64_t block_rows_ = 0, ours_rows_ = 0;  // the running step's (run)
};

Linear packed(torch::Tensor packed, Opt bias, Opt blocks, int64_t n) {
  Linear l;
  l.packed = packed, l.bias = bias, l.blocks = blocks, l.n = n;
  return l;
}

Linear gemm(torch::Tensor packed, Opt bias, int64_t n, Opt blocks) {
  Linear l = ::packed(packed, bias, blocks, n);
  l.kind = 1;
  return l;
}

Linear gemm_silu(torch::Tensor packed, int64_t n, Opt blocks) {
  Linear l = gemm(packed, Opt(), n, blocks);
  l.kind = 5;
  return l;
}

Linear gemm_i8(torch::Tensor packed, torch::Tensor scale, Opt bias, int64_t n) {
  Linear l = gemm(packed, bias, n, Opt());
  l.kind = 3;
  l.scale = scale;
  return l;
}

Linear w8a8(torch::Tensor packed, torch::Tensor scale, Opt bias, int64_t n) {
  Linear l = gemm_i8(packed, scale, bias, n);
  l.kind = 4;
  return l;
}

Linear quantized(std::vector<torch::Tensor> data, std::vector<int64_t> types, std::vector<Opt> scales, Opt bias,
                 int64_t tile_rows) {
  TORCH_CHECK(!data.empty() && data.size() == types.size() && data.size() == scales.size(), "quantized parts");
  Linear l;
  l.kind = 2;
  l.qdata = std::move(data);
  l.qtype = std::move(types);
  l.qscale = std::move(scales);
  l.bias = bias;
  l.tile_rows = tile_rows;
  return l;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Linear>(m, "Linear");
  m.def("packed_linear", &packed, py::arg("packed"), py::arg("bias"), py::arg("blocks") = py::none(), py::arg("n") = 0);
  m.def("gemm_linear", &gemm, py::arg("packed"), py::arg("bias"), py::arg("n"), py::arg("blocks") = py::none());
  m.def("gemm_silu_linear", &gemm_silu);
  m.def("int8_gemm_linear", &gemm_i8);
  m.def("w8a8_linear", &w8a8);
  m.def("quant_linear", &quantized);
  m.attr("QUANT_MAX_ROWS") = kQuantMaxRows;
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<const std::map<std::string, int64_t>&>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("set_qk_norms", &DecodePlan::set_qk_norms)
      .def("set_experts", &DecodePlan::set_experts)
      .def("set_quantized_experts", &DecodePlan::set_quantized_experts)
      .def("run", &DecodePlan::run)
      .def("num_layers", &DecodePlan::num_layers)
      .def("quantized", &DecodePlan::quantized);
}
