#include "core/kernels/ops.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#ifdef KAKEYA_CUDA
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/kernels/cuda/decode_ops.h"
#include "core/kernels/cuda/spec_ops.h"
#include "core/kernels/step_program.h"
#endif

namespace kakeya::ops {

#ifdef KAKEYA_CUDA
namespace {
// The fused kernels have no backward: while autograd records through an input
// (f_θ training recomputes attention with the model's norms), take the reference path.
bool fused(const at::Tensor& x, const at::Tensor& w = {}) {
  if (!x.is_cuda()) return false;
  if (!at::GradMode::is_enabled()) return true;
  return !x.requires_grad() && !(w.defined() && w.requires_grad());
}
}  // namespace
#endif

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, const NormSpec& ns) {
#ifdef KAKEYA_CUDA
  if (fused(x, w)) return cuda::rms_norm(x, w, ns.eps, ns.unit_offset);
#endif
  auto xf = x.to(at::kFloat);
  auto normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + ns.eps);
  // Gemma: (x̂·(1+w)) in f32, then cast; Llama/Qwen: cast x̂, then ·w in the model dtype.
  if (ns.unit_offset) return (normed * w).to(x.scalar_type());
  return w.to(x.scalar_type()) * normed.to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> embed_rms_norm(const at::Tensor& table, const at::Tensor& ids,
                                                 const at::Tensor& scale, const at::Tensor& w, const NormSpec& ns) {
#ifdef KAKEYA_CUDA
  if (fused(table, w)) return cuda::embed_rms_norm(table, ids, scale, w, ns.eps, ns.unit_offset);
#endif
  at::Tensor h = at::embedding(table, ids) * scale;
  return {h, rms_norm(h, w, ns)};
}

void copy_rows(const at::Tensor& x, const RowCopy& to) {
  const int64_t H = x.size(-1);
  to.dst.narrow(1, to.col, H).index_copy_(0, to.positions.remainder(to.dst.size(0)), x.reshape({-1, H}));
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w_post,
                                               const at::Tensor& w_next, const NormSpec& ns, const RowCopy* copy) {
#ifdef KAKEYA_CUDA
  if (fused(h) && fused(x)) return cuda::add_rms_norm(h, x, w_post, w_next, ns.eps, ns.unit_offset, copy);
#endif
  at::Tensor h2 = h + (w_post.defined() ? rms_norm(x, w_post, ns) : x);
  if (copy) copy_rows(h2, *copy);
  return {h2, rms_norm(h2, w_next, ns)};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
#ifdef KAKEYA_CUDA
  if (fused(x, w)) return cuda::linear(x, w, bias);
#endif
  return at::linear(x, w, bias);
}

at::Tensor linear_act_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gelu_tanh) {
#ifdef KAKEYA_CUDA
  if (fused(x, w)) return cuda::linear_act_mul(x, w, bias, gelu_tanh);
#endif
  return act_mul(at::linear(x, w, bias), gelu_tanh);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w_post,
                                                      const at::Tensor& w_next, const NormSpec& ns, const Linear& lin) {
#ifdef KAKEYA_CUDA
  if (fused(h, lin.w) && fused(x)) {
    auto r = cuda::add_rms_norm_linear(h, x, w_post, w_next, ns.eps, ns.unit_offset, lin);
    if (r.first.defined()) return r;
  }
#endif
  auto [h2, y] = add_rms_norm(h, x, w_post, w_next, ns);
  return {h2, lin.gated ? linear_act_mul(y, lin.w, lin.bias, lin.gelu_tanh) : linear(y, lin.w, lin.bias)};
}

at::Tensor act_mul(const at::Tensor& gu, bool gelu_tanh) {
#ifdef KAKEYA_CUDA
  if (fused(gu)) return cuda::act_mul(gu, gelu_tanh);
#endif
  auto parts = gu.chunk(2, -1);
  return (gelu_tanh ? at::gelu(parts[0], "tanh") : at::silu(parts[0])) * parts[1];
}

ExpertPlan plan_experts(const at::Tensor& experts, int64_t num_experts) {
  ExpertPlan p{experts.flatten(), {}, experts.dim() == 2 ? experts.size(0) : experts.numel()};
#ifdef KAKEYA_CUDA
  if (experts.is_cuda()) p.groups = cuda::expert_plan(p.experts, num_experts);
#endif
  return p;
}

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w, const ExpertPlan& plan, int64_t x_div, bool gated,
                         bool gelu_tanh) {
  const int64_t P = plan.experts.numel(), K = x.size(-1);
  KAKEYA_CHECK(x_div >= 1 && P % x_div == 0 && x.numel() == P / x_div * K,
               "expert_linear: x " << x.sizes() << " for " << P << " pairs, " << x_div << " pairs per row");
#ifdef KAKEYA_CUDA
  if (plan.groups.defined() && fused(x, w)) {
    auto y = cuda::expert_linear(x, w, plan.groups, P, x_div, plan.most_per_expert, gated, gelu_tanh);
    if (y.defined()) return y;
  }
#endif
  // Reference: gather each pair's expert ([P] weight copies) and its input row, batched products.
  auto xr = x.reshape({P / x_div, K});
  if (x_div > 1) xr = xr.repeat_interleave(x_div, 0);                                 // [P, K]
  auto y = at::matmul(w.index_select(0, plan.experts), xr.unsqueeze(-1)).squeeze(-1);  // [P, N or 2N]
  return gated ? act_mul(y, gelu_tanh) : y;
}

ExpertRoute route_experts(const at::Tensor& h, const at::Tensor& scale, const at::Tensor& proj,
                          const at::Tensor& per_expert_scale, int64_t top_k, const NormSpec& ns, bool with_plan) {
  const int64_t H = h.size(-1), E = proj.size(0);
  KAKEYA_CHECK(h.dim() == 2 && top_k >= 1 && top_k <= E,
               "route_experts: h " << h.sizes() << " (expected [N, H]), top " << top_k << " of " << E << " experts");
#ifdef KAKEYA_CUDA
  if (fused(h, proj)) {
    ExpertRoute r;
    if (cuda::route_experts(h, scale, proj, per_expert_scale, top_k, ns.eps, r, with_plan)) return r;
  }
#endif
  // Same op order as the reference: the weight-free norm (x̂ cast to the model dtype), × scale,
  // × H^-0.5, each in the model dtype.
  auto hf = h.to(at::kFloat);
  auto x = (hf * at::rsqrt(hf.pow(2).mean(-1, true) + ns.eps)).to(h.scalar_type()) * scale *
           std::pow((double)H, -0.5);                                          // [N, H]
  auto probs = at::softmax(ops::linear(x, proj), -1, at::kFloat);             // [N, E] f32
  auto [top, idx] = at::topk(probs, top_k, -1);                               // [N, K]
  top = top / top.sum(-1, true);
  ExpertRoute r{top * per_expert_scale.index_select(0, idx.flatten()).view_as(idx), idx, {}};
  if (with_plan) r.plan = plan_experts(idx, E);
  return r;
}

std::pair<at::Tensor, at::Tensor> moe_residual(const at::Tensor& h, const at::Tensor& f, const at::Tensor& y,
                                               const at::Tensor& r, const MoeNorms& n, const at::Tensor& w_next,
                                               const NormSpec& ns, const RowCopy* copy) {
#ifdef KAKEYA_CUDA
  if (fused(h) && fused(f) && fused(y)) return cuda::moe_residual(h, f, y, r, n, w_next, ns.eps, ns.unit_offset, copy);
#endif
  const int64_t H = h.size(-1);
  at::Tensor m = y;
  if (r.defined()) {
    // Each expert's output × its f32 weight, rounded to the model dtype, then summed (as the reference adds them).
    const int64_t K = r.size(-1);
    m = (y.view({-1, K, H}) * r.reshape({-1, K}).unsqueeze(-1)).to(h.scalar_type()).sum(1);  // [N, H]
  }
  auto f2 = rms_norm(f, n.dense, ns) + rms_norm(m.view(h.sizes()), n.experts, ns);
  auto h2 = h + rms_norm(f2, n.ffn, ns);
  // Gemma 4: the layer's whole output (residual stream included) ×= layer_scalar, in the model dtype.
  if (n.scalar.defined()) h2 = h2 * n.scalar;
  if (copy) copy_rows(h2, *copy);
  return {h2, rms_norm(h2, w_next, ns)};
}

#ifdef KAKEYA_CUDA
struct SideBranch::Impl {
  Impl(c10::cuda::CUDAStream m, c10::cuda::CUDAStream s) : main(m), side(s) {}
  c10::cuda::CUDAStream main, side;
  c10::cuda::CUDAEvent forked{cudaEventDisableTiming}, done{cudaEventDisableTiming};
  bool joined = false;
};
#else
struct SideBranch::Impl {};
#endif

SideBranch::SideBranch(const at::Tensor& like) {
#ifdef KAKEYA_CUDA
  if (!fused(like)) return;
  const auto dev = like.device().index();
  impl_ = std::make_unique<Impl>(c10::cuda::getCurrentCUDAStream(dev), c10::cuda::getStreamFromPool(false, dev));
  impl_->forked.record(impl_->main);
  impl_->forked.block(impl_->side);
#else
  (void)like;
#endif
}

SideBranch::~SideBranch() {
  try {
    join();
  } catch (...) {  // a destructor must not throw; the error surfaces at the stream's next check
  }
}

void SideBranch::run(const std::function<void()>& fn) {
#ifdef KAKEYA_CUDA
  if (impl_) {
    c10::cuda::CUDAStreamGuard guard(impl_->side);
    fn();
    return;
  }
#endif
  fn();
}

void SideBranch::join() {
#ifdef KAKEYA_CUDA
  if (!impl_ || impl_->joined) return;
  impl_->done.record(impl_->side);
  impl_->done.block(impl_->main);
  impl_->joined = true;
#endif
}

void prefetch_l2(const std::vector<at::Tensor>& tensors) {
#ifdef KAKEYA_CUDA
  for (const auto& t : tensors)
    if (t.defined()) {
      if (t.is_cuda()) cuda::prefetch_l2(tensors);
      return;
    }
#else
  (void)tensors;
#endif
}

L2Prefetch::L2Prefetch(const at::Tensor& like, int64_t rows) {
#ifdef KAKEYA_CUDA
  static const bool on = [] {
    const char* e = std::getenv("KAKEYA_PREFETCH");
    return !e || std::string(e) != "0";
  }();
  // A recorded step issues its prefetches inside no program: the side branches would be work
  // between the persistent kernel's instructions (StepProgram refuses them).
  if (on && rows <= kMaxRows && fused(like) && !StepProgram::recording()) like_ = like;
#else
  (void)like, (void)rows;
#endif
}

void L2Prefetch::ahead(const std::vector<at::Tensor>& tensors) {
  if (!active()) return;
  branches_.push_back(std::make_unique<SideBranch>(like_));
  branches_.back()->run([&] { prefetch_l2(tensors); });
}

bool cuda_kernels_available() {
#ifdef KAKEYA_CUDA
  return true;
#else
  return false;
#endif
}

at::Tensor qk_norm_rope_store(const at::Tensor& qkv, const at::Tensor& positions, const QKRopeArgs& a,
                              at::Tensor& k_cache, at::Tensor& v_cache) {
#ifdef KAKEYA_CUDA
  return cuda::qk_norm_rope_store(qkv, positions, a, k_cache, v_cache);
#else
  KAKEYA_FAIL("qk_norm_rope_store: built without CUDA kernels (KAKEYA_CUDA=OFF)");
#endif
}

const std::string& row_code_names() {
  static const std::string names = "int8 | int6 | int4 | lm5 | lm4 | lm3 | lm2 | ru5 | ru4 | ru3 | ru2 | pw5 | pw4 | pw3 | pw2";
  return names;
}

bool is_row_code_name(const std::string& s) {
  if (s == "int8" || s == "int6" || s == "int4") return true;
  auto bits = [](char b) { return b >= '2' && b <= '5'; };
  return (s.size() == 3 || (s.size() == 5 && s[3] == 'v' && bits(s[4]))) &&
         (s.compare(0, 2, "lm") == 0 || s.compare(0, 2, "ru") == 0 || s.compare(0, 2, "pw") == 0) && bits(s[2]);
}

RowCode parse_row_code(const std::string& s, const std::string& flag) {
  if (s == "none") return {};
  KAKEYA_CHECK(is_row_code_name(s), flag << ": expected none | " << row_code_names() << ", got '" << s
                                          << "' (a rotated code + v2 .. v5 codes V rows in those bits: pw5v3)");
  if (s == "int8") return {RowKind::Affine, 8};
  if (s == "int6") return {RowKind::Affine, 6};
  if (s == "int4") return {RowKind::Affine, 4};
  return {RowKind::Rotated, s[2] - '0', s[0] == 'p', s[0] == 'r', s.size() == 5 ? s[4] - '0' : 0};
}

std::pair<RowCode, std::vector<RowCode>> parse_layer_codes(const std::string& s, const std::string& flag) {
  const size_t plus = s.find('+');
  const RowCode base = parse_row_code(s.substr(0, plus), flag);
  std::vector<RowCode> layers;
  for (size_t at = plus; at != std::string::npos;) {
    const size_t next = s.find('+', at + 1);
    const std::string item = s.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    const size_t eq = item.find('=');
    const std::string layer = item.substr(0, eq);
    KAKEYA_CHECK(eq != std::string::npos && !layer.empty() && layer.size() <= 6 &&
                     std::all_of(layer.begin(), layer.end(), [](char ch) { return ch >= '0' && ch <= '9'; }),
                 flag << ": '" << item << "' in '" << s << "': expected LAYER=CODE (a layer's own code, e.g. pw4+17=pw5v4)");
    const int64_t l = std::stoll(layer);
    const RowCode code = parse_row_code(item.substr(eq + 1), flag);
    KAKEYA_CHECK(code.defined(), flag << ": layer " << l << " in '" << s << "': 'none' is not a code (layers take codes)");
    if ((int64_t)layers.size() <= l) layers.resize(l + 1);
    KAKEYA_CHECK(!layers[l].defined(), flag << ": layer " << l << " given twice in '" << s << "'");
    layers[l] = code;
    at = next;
  }
  KAKEYA_CHECK(layers.empty() || base.defined(), flag << ": '" << s << "': layers' own codes over no default code");
  return {base, layers};
}

std::string layer_codes_name(const RowCode& base, const std::vector<RowCode>& layers) {
  std::string n = row_code_name(base);
  for (size_t l = 0; l < layers.size(); ++l)
    if (layers[l].defined()) n += "+" + std::to_string(l) + "=" + row_code_name(layers[l]);
  return n;
}

std::string row_code_name(const RowCode& c) {
  if (!c.defined()) return "none";
  return (c.rotated() ? (c.weighted ? "pw" : c.uniform ? "ru" : "lm") : "int") + std::to_string(c.bits) +
         (c.split() ? "v" + std::to_string(c.v_bits) : "");
}

void check_row_code(int64_t D, const RowCode& c, const std::string& what) {
  if (c.split()) {
    KAKEYA_CHECK(c.rotated(), what << ": a split code (V rows in other bits) is a rotated one, got " << row_code_name(c));
    KAKEYA_CHECK(c.v_bits >= 2 && c.v_bits <= 5, what << ": " << row_code_name(c) << ": V bits expected 2, 3, 4 or 5");
    check_row_code(D, c.k(), what);
    KAKEYA_CHECK(rotated_code_fits(D, c), what << ": " << row_code_name(c) << ": V rows in " << c.v_bits
                                               << " bits do not fit rows of " << D << " values (whole bytes a lane)");
    return;
  }
  if (c.rotated()) {
    KAKEYA_CHECK(c.bits >= 2 && c.bits <= 5, what << ": " << row_code_name(c) << ": bits expected 2, 3, 4 or 5");
    KAKEYA_CHECK(!(c.weighted && c.uniform), what << ": weighted rows (pwB) take Lloyd-Max levels, not uniform ones");
    KAKEYA_CHECK(rotated_code_fits(D, c),
                 what << ": " << row_code_name(c) << " codes rows of a power-of-two length in 64..512 whose 32nds are "
                      << "whole bytes of codes, at most 8 a lane; the head dim is " << D
                      << (D == 128 ? " (use lm4 or lm2)" : D == 64 ? " (use lm4)" : D == 512 ? " (use lm4, lm3 or lm2)" : ""));
  } else {
    KAKEYA_CHECK(!c.weighted && !c.uniform,
                 what << ": weighted rows are rotated codes (pw2 .. pw5), and so are uniform ones (ru2 .. ru5)");
    KAKEYA_CHECK(c.bits == 8 || c.bits == 6 || c.bits == 4, what << ": affine codes take 8, 6 or 4 bits, got " << c.bits);
    KAKEYA_CHECK(D > 0 && D % kCodeGroup == 0,
                 what << ": row length " << D << " is not a multiple of the code group " << kCodeGroup);
    KAKEYA_CHECK(c.bits != 6 || D % 128 == 0,
                 what << ": int6 codes rows whose 32nds are whole bytes of codes (a multiple of 128 values); the row "
                      << "length is " << D << " (use int8 or int4)");
  }
}

float uniform_step(int bits) {
  // The spacing of 2^bits evenly spaced levels that minimizes the N(0,1) squared error (fitted by
  // ternary search on a 1.8M-point grid of the density); tests/test_ops.cpp checks it is a minimum.
  static const float steps[4] = {0.9956858f, 0.5860178f, 0.3352013f, 0.1881388f};
  KAKEYA_CHECK(bits >= 2 && bits <= 5, "uniform rotated row code: bits expected 2, 3, 4 or 5, got " << bits);
  return steps[bits - 2];
}

const std::vector<float>& rotated_levels(int bits, bool uniform) {
  if (uniform) {
    static const std::vector<std::vector<float>> tables = [] {
      std::vector<std::vector<float>> t;
      for (int b = 2; b <= 5; ++b) {
        std::vector<float> lv;
        const int L = 1 << b;
        for (int i = 0; i < L; ++i) lv.push_back(((float)i - 0.5f * (float)(L - 1)) * uniform_step(b));
        t.push_back(lv);
      }
      return t;
    }();
    KAKEYA_CHECK(bits >= 2 && bits <= 5, "rotated row code: bits expected 2, 3, 4 or 5, got " << bits);
    return tables[bits - 2];
  }
  // N(0,1) Lloyd-Max levels (positive half; the tables are symmetric). tests/test_ops.cpp checks them
  // against the numerically fitted tables of calib/codec/lloyd_max.h.
  static const std::vector<float> t2 = {-1.5104176f, -0.4527800f, 0.4527800f, 1.5104176f};
  static const std::vector<float> t3 = {-2.1519457f, -1.3439093f, -0.7560053f, -0.2450942f,
                                        0.2450942f,  0.7560053f,  1.3439093f,  2.1519457f};
  static const std::vector<float> t4 = {-2.7325896f, -2.0690172f, -1.6180464f, -1.2562312f, -0.9423405f, -0.6567591f,
                                        -0.3880483f, -0.1283950f, 0.1283950f,  0.3880483f,  0.6567591f,  0.9423405f,
                                        1.2562312f,  1.6180464f,  2.0690172f,  2.7325896f};
  static const std::vector<float> t5 = {
      -3.2607325f, -2.6911196f, -2.3177394f, -2.0287284f, -1.7872332f, -1.5762281f, -1.3863403f, -1.2118044f,
      -1.0487833f, -0.8945651f, -0.7471357f, -0.6049336f, -0.4666995f, -0.3313783f, -0.1980518f, -0.0658897f,
      0.0658897f,  0.1980518f,  0.3313783f,  0.4666995f,  0.6049336f,  0.7471357f,  0.8945651f,  1.0487833f,
      1.2118044f,  1.3863403f,  1.5762281f,  1.7872332f,  2.0287284f,  2.3177394f,  2.6911196f,  3.2607325f};
  KAKEYA_CHECK(bits >= 2 && bits <= 5, "rotated row code: bits expected 2, 3, 4 or 5, got " << bits);
  return bits == 2 ? t2 : bits == 3 ? t3 : bits == 4 ? t4 : t5;
}

at::Tensor fwht(const at::Tensor& x) {
  const int64_t D = x.size(-1);
  KAKEYA_CHECK(D > 0 && (D & (D - 1)) == 0, "fwht: length " << D << " is not a power of two");
  auto y = x.to(at::kFloat).reshape({-1, D});
  for (int64_t h = 1; h < D; h *= 2) {
    auto p = y.view({-1, D / (2 * h), 2, h});
    auto a = p.select(2, 0), b = p.select(2, 1);
    y = at::stack({a + b, a - b}, 2).view({-1, D});
  }
  return (y * (float)(1.0 / std::sqrt((double)D))).view(x.sizes());
}

namespace {
// The rotated code's small tables, copied to a device once per (table, size, device): the
// reference path also runs inside captured CUDA graphs (restored prefill chunks decode coded
// regions through it), where no copy from host memory may be enqueued. Never freed: the
// tensors must not outlive the CUDA context at exit.
enum class Table { Levels, Mids, Signs, UniformLevels, UniformMids };
const at::Tensor& device_table(Table what, int64_t n, const at::Device& dev) {
  static std::mutex m;
  static auto* tables = new std::map<std::tuple<int, int64_t, int, int>, at::Tensor>();
  std::lock_guard<std::mutex> lk(m);
  at::Tensor& t = (*tables)[{(int)what, n, (int)dev.type(), dev.has_index() ? (int)dev.index() : -1}];
  if (t.defined()) return t;
  std::vector<float> v;  // Signs: n = D; the others: n = bits
  const bool uniform = what == Table::UniformLevels || what == Table::UniformMids;
  if (what == Table::Signs) {
    for (int64_t i = 0; i < n; ++i) v.push_back(rotation_sign(i));
  } else if (what == Table::Levels || what == Table::UniformLevels) {
    v = rotated_levels((int)n, uniform);
  } else {
    const auto& lv = rotated_levels((int)n, uniform);  // the midpoints between neighbouring levels
    for (size_t i = 0; i + 1 < lv.size(); ++i) v.push_back(0.5f * (lv[i] + lv[i + 1]));
  }
  t = at::tensor(v).to(dev);
  return t;
}
at::Tensor rotation_signs(int64_t D, at::Device dev) { return device_table(Table::Signs, D, dev); }
const at::Tensor& code_levels(const RowCode& c, const at::Device& dev) {
  return device_table(c.uniform ? Table::UniformLevels : Table::Levels, c.bits, dev);
}
const at::Tensor& code_mids(const RowCode& c, const at::Device& dev) {
  return device_table(c.uniform ? Table::UniformMids : Table::Mids, c.bits, dev);
}
// idx [N, D] uint8 (< 2^bits) -> [N, D·bits/8] uint8, little-endian bit stream.
at::Tensor pack_indices(const at::Tensor& idx, int bits) {
  const int64_t N = idx.size(0), D = idx.size(1);
  auto shifts = at::arange(bits, idx.options().dtype(at::kLong));
  auto bitv = idx.to(at::kLong).unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1);  // [N, D, bits]
  auto w = at::arange(8, idx.options().dtype(at::kLong));
  return bitv.reshape({N, D * bits / 8, 8}).bitwise_left_shift(w).sum(-1).to(at::kByte);
}
at::Tensor unpack_indices(const at::Tensor& codes, int64_t D, int bits) {
  const int64_t N = codes.size(0);
  auto w = at::arange(8, codes.options().dtype(at::kLong));
  auto bitv = codes.to(at::kLong).unsqueeze(-1).bitwise_right_shift(w).bitwise_and(1).reshape({N, D, bits});
  auto shifts = at::arange(bits, codes.options().dtype(at::kLong));
  return bitv.bitwise_left_shift(shifts).sum(-1);  // [N, D] int64
}
}  // namespace

std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const RowCode& code) {
  const int64_t D = x.size(-1);
  check_row_code(D, code, "quantize_rows");
  KAKEYA_CHECK(!code.split(), "quantize_rows: " << row_code_name(code) << " codes K and V rows apart (pass its k() or v())");
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 1);
  auto codes_shape = lead, side_shape = lead;
  codes_shape.push_back(code_bytes(D, code));
  side_shape.push_back(side_halves(D, code));
  if (code.rotated()) {
    auto xf = x.to(at::kFloat).reshape({-1, D});                       // [N, D]
    auto y = fwht(xf * rotation_signs(D, x.device()));                 // [N, D]
    auto n = xf.pow(2).sum(-1, true).sqrt();                           // [N, 1]
    auto inv = at::where(n.gt(0), (float)std::sqrt((double)D) / n, at::zeros_like(n));
    auto u = y * inv;
    auto idx = at::bucketize(u, code_mids(code, x.device()));  // count of thresholds < u
    auto c = code_levels(code, x.device()).index_select(0, idx.flatten()).view(idx.sizes());  // [N, D]
    auto g = n / c.pow(2).sum(-1, true).sqrt();                        // the row's norm kept
    auto side = g.contiguous().view(at::kHalf);                         // [N, 2]: f32 bytes as halves
    return {pack_indices(idx.to(at::kByte), code.bits).reshape(codes_shape), side.reshape(side_shape)};
  }
  const int bits = code.bits;
  const int64_t G = D / kCodeGroup;
  auto xf = x.to(at::kFloat).reshape({-1, G, kCodeGroup});          // [N, G, 32]
  auto mn = std::get<0>(xf.min(-1, true)), mx = std::get<0>(xf.max(-1, true));
  const double levels = (1 << bits) - 1;
  auto scale_h = ((mx - mn) / levels).to(at::kHalf), min_h = mn.to(at::kHalf);  // [N, G, 1]
  auto sf = scale_h.to(at::kFloat), mf = min_h.to(at::kFloat);
  auto c = at::where(sf.gt(0), at::round((xf - mf) / sf), at::zeros_like(xf)).clamp(0, levels).to(at::kByte);
  c = c.reshape({-1, D});                                           // [N, D]
  if (bits == 4) {
    auto pairs = c.view({-1, D / 2, 2});
    c = pairs.select(-1, 0).bitwise_or(pairs.select(-1, 1).bitwise_left_shift(4));  // [N, D/2]
  } else if (bits == 6) {
    c = pack_indices(c, 6);                                         // [N, D·6/8]
  }
  auto side = at::cat({scale_h, min_h}, -1).reshape({-1, 2 * G});   // [N, 2G]: (scale, min) per group
  return {c.reshape(codes_shape), side.reshape(side_shape)};
}

at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& side, const RowCode& code, at::ScalarType dtype) {
  KAKEYA_CHECK(code.defined() && codes.dim() >= 1, "dequantize_rows: no code");
  KAKEYA_CHECK(!code.split(), "dequantize_rows: " << row_code_name(code) << " codes K and V rows apart (pass its k() or v())");
  const int64_t D = codes.size(-1) * 8 / code.bits;
  check_row_code(D, code, "dequantize_rows");
  KAKEYA_CHECK(codes.scalar_type() == at::kByte && side.scalar_type() == at::kHalf &&
                   side.size(-1) == side_halves(D, code) && codes.size(-1) == code_bytes(D, code),
               "dequantize_rows: codes uint8 [..., " << code_bytes(D, code) << "] and side f16 [..., "
                                                     << side_halves(D, code) << "] expected, got " << codes.sizes()
                                                     << " / " << side.sizes());
#ifdef KAKEYA_CUDA
  if (codes.is_cuda() && cuda::dequantize_rows_supported(D, dtype)) return cuda::dequantize_rows(codes, side, code, dtype);
#endif
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end() - 1);
  shape.push_back(D);
  auto c = codes.reshape({-1, codes.size(-1)});
  if (code.rotated()) {
    auto idx = unpack_indices(c, D, code.bits);                                // [N, D]
    auto g = side.reshape({-1, 2}).contiguous().view(at::kFloat);             // [N, 1]
    auto y = code_levels(code, codes.device()).index_select(0, idx.flatten()).view(idx.sizes()) * g;
    return (fwht(y) * rotation_signs(D, codes.device())).reshape(shape).to(dtype);
  }
  const int64_t G = D / kCodeGroup;
  if (code.bits == 4) c = at::stack({c.bitwise_and(15), c.bitwise_right_shift(4)}, -1);  // [N, D/2, 2]
  if (code.bits == 6) c = unpack_indices(c, D, 6);                                         // [N, D]
  auto cf = c.reshape({-1, G, kCodeGroup}).to(at::kFloat);
  auto sd = side.reshape({-1, G, 2}).to(at::kFloat);
  auto x = sd.narrow(-1, 1, 1) + sd.narrow(-1, 0, 1) * cf;          // min + scale · c
  return x.reshape(shape).to(dtype);
}

void code_rows(at::Tensor& k, at::Tensor& v, const at::Tensor& src_slots, const at::Tensor& dst_rows, CodedSlots& to,
               int64_t sink, int64_t sink_slot0) {
#ifdef KAKEYA_CUDA
  if (k.is_cuda()) return cuda::code_rows(k, v, src_slots, dst_rows, to, sink, sink_slot0);
#endif
  if (dst_rows.dim() == 2) {  // per row: row b's slots and rows (independent sequences)
    for (int64_t b = 0; b < k.size(0); ++b) {
      auto kb = k.narrow(0, b, 1), vb = v.narrow(0, b, 1);
      CodedSlots tb = to;
      for (at::Tensor* t : tb.tensors())
        if (t->defined()) *t = t->narrow(0, b, 1);
      code_rows(kb, vb, src_slots.select(0, b), dst_rows.select(0, b), tb, sink, sink_slot0);
    }
    return;
  }
  auto rk = k.index_select(2, src_slots), rv = v.index_select(2, src_slots);
  auto centred = [](const at::Tensor& x, const at::Tensor& mean) {
    return mean.defined() ? x.to(at::kFloat) - mean.unsqueeze(2) : x;
  };
  auto kx = centred(rk, to.k_mean);
  if (to.k_weight.defined()) kx = kx * to.k_weight.unsqueeze(2);
  auto [kc, ks] = quantize_rows(kx, to.code.k());
  auto [vc, vs] = quantize_rows(centred(rv, to.v_mean), to.code.v());
  if (sink > 0) {
    auto t = dst_rows.lt(sink).nonzero().view({-1});  // SYNC: the reference path (CPU)
    if (t.numel() > 0) {
      k.index_copy_(2, dst_rows.index_select(0, t) + sink_slot0, rk.index_select(2, t));
      v.index_copy_(2, dst_rows.index_select(0, t) + sink_slot0, rv.index_select(2, t));
    }
  }
  to.k_codes.index_copy_(2, dst_rows, kc);
  to.k_side.index_copy_(2, dst_rows, ks);
  to.v_codes.index_copy_(2, dst_rows, vc);
  to.v_side.index_copy_(2, dst_rows, vs);
}

RestoreStore::RestoreStore(std::vector<Layer> layers) : layers_(std::move(layers)) {
#ifdef KAKEYA_CUDA
  desc_ = cuda::restore_store_descriptors(layers_);
#else
  KAKEYA_FAIL("RestoreStore: built without CUDA kernels (KAKEYA_CUDA=OFF)");
#endif
}

void RestoreStore::run(const at::Tensor& k_raw, const at::Tensor& v_raw, const at::Tensor& positions) const {
#ifdef KAKEYA_CUDA
  KAKEYA_CHECK(k_raw.defined() && v_raw.defined(), "RestoreStore::run: raw rows expected (copy() takes none)");
  cuda::restore_store(desc_, layers_, k_raw, v_raw, positions);
#else
  (void)k_raw, (void)v_raw, (void)positions;
#endif
}

void RestoreStore::copy(const at::Tensor& positions) const {
#ifdef KAKEYA_CUDA
  cuda::restore_store(desc_, layers_, at::Tensor(), at::Tensor(), positions);
#else
  (void)positions;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_pos,
                            const at::Tensor& q_pos, int64_t window, double scale, double softcap,
                            const CopyRule& copies, const AttnTail& tail) {
#ifdef KAKEYA_CUDA
  return cuda::decode_attention(q, k, v, slot_pos, q_pos, window, scale, softcap, copies, tail);
#else
  (void)tail;
  KAKEYA_FAIL("decode_attention: built without CUDA kernels (KAKEYA_CUDA=OFF)");
#endif
}

void greedy_accept(const at::Tensor& scores, const at::Tensor& block, at::Tensor& report) {
#ifdef KAKEYA_CUDA
  if (scores.is_cuda()) return cuda::greedy_accept(scores, block, report);
#endif
  const int64_t T = scores.size(0);
  at::Tensor post = scores.argmax(-1);  // [T]
  at::Tensor match = block.narrow(0, 1, T - 1).eq(post.narrow(0, 0, T - 1)).to(at::kLong);
  report.narrow(0, 0, T).copy_(post);
  report.narrow(0, T, 1).copy_(match.cumprod(0).sum().add(1).view({1}));
}

void argmax_rows(const at::Tensor& scores, const at::Tensor& map, at::Tensor& out) {
#ifdef KAKEYA_CUDA
  if (scores.is_cuda() && (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16))
    return cuda::argmax_rows(scores, map, out);
#endif
  at::Tensor idx = scores.reshape({-1, scores.size(-1)}).argmax(-1);  // [rows]
  out.view({-1}).copy_(map.defined() ? map.index_select(0, idx) : idx);
}

void advance_block(const at::Tensor& report, at::Tensor& block, at::Tensor& pos0, at::Tensor& qpos,
                   const CarriedEmbedding* emb) {
#ifdef KAKEYA_CUDA
  if (report.is_cuda()) return cuda::advance_block(report, block, pos0, qpos, emb);
#endif
  const int64_t T = qpos.numel();
  at::Tensor n = report.narrow(0, T, 1);  // [1]
  at::Tensor tok = report.narrow(0, 0, T).index_select(0, n - 1);  // [1]
  block.select(1, 0).copy_(tok);
  pos0.add_(n);
  at::add_out(qpos, at::arange(T, qpos.options()), pos0);
  if (emb) emb->out.copy_((at::embedding(emb->table, tok) * emb->scale).view(emb->out.sizes()));
}

HeadScreen make_head_screen(const at::Tensor& w) {
  KAKEYA_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
               "make_head_screen: expected a [V, K] f32 or bf16 head, got " << w.sizes() << " " << w.scalar_type());
  const int64_t V = w.size(0), K = w.size(1);
  const double u = std::ldexp(1.0, -24), gamma = K * u / (1 - K * u);  // an f32 sum of K products
  HeadScreen s;
  s.codes = at::empty({V, K}, w.options().dtype(at::kChar));
  s.scale = at::empty({V}, w.options().dtype(at::kFloat));
  s.err = at::empty({V}, w.options().dtype(at::kFloat));
  s.summed = at::zeros({1}, w.options().dtype(at::kInt));
  for (int64_t r0 = 0; r0 < V; r0 += 8192) {
    const int64_t n = std::min<int64_t>(8192, V - r0);
    const at::Tensor wd = w.narrow(0, r0, n).to(at::kDouble);                 // [n, K]
    const at::Tensor sc = (wd.abs().amax(1) / 127.0).to(at::kFloat);           // [n]: the kernel's scale
    const at::Tensor scd = sc.to(at::kDouble).unsqueeze(1);                    // [n, 1]
    // A scale that rounded below the row's largest / 127 only clamps; err then counts the clamp.
    const at::Tensor q = at::where(scd > 0, at::round(wd / scd), at::zeros_like(wd)).clamp(-127, 127);
    const at::Tensor qs = q * scd;                                             // the screen's row
    // The quantization error by Cauchy-Schwarz; the kernel's f32 sum of x·w_r and the screen's of
    // x·q_r (then times the scale: one rounding more) each within gamma·||x||·||row||.
    const at::Tensor err = ((wd - qs).norm(2, 1) + gamma * wd.norm(2, 1) + (gamma + 2 * u) * qs.norm(2, 1)) * (1 + 1e-9);
    at::Tensor ef = err.to(at::kFloat);
    ef = at::where(ef.to(at::kDouble) < err, at::nextafter(ef, at::full_like(ef, INFINITY)), ef);  // rounded up
    s.codes.narrow(0, r0, n).copy_(q.to(at::kChar));
    s.scale.narrow(0, r0, n).copy_(sc);
    s.err.narrow(0, r0, n).copy_(ef);
  }
  return s;
}

std::pair<at::Tensor, at::Tensor> head_screen_bounds(const at::Tensor& x, const HeadScreen& s) {
  KAKEYA_CHECK(s.defined() && x.numel() == s.codes.size(1),
               "head_screen_bounds: expected x of " << (s.defined() ? s.codes.size(1) : 0) << " values, got " << x.sizes());
  const at::Tensor xf = x.reshape({-1}).to(at::kFloat);
  const at::Tensor a = at::mv(s.codes.to(at::kFloat), xf) * s.scale;
  const at::Tensor e = xf.norm() * s.err;
  return {a - e, a + e};
}

void linear_argmax(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const HeadScreen* screen) {
#ifdef KAKEYA_CUDA
  if (fused(x, w) && screen && screen->defined() && cuda::screened_argmax(x, w, *screen, out)) return;
  if (fused(x, w) && cuda::linear_argmax(x, w, out)) return;
#endif
  // On the CPU the screen would save nothing: ATen's GEMV reads the head at its own speed.
  argmax_rows(linear(x, w, at::Tensor()), {}, out);
}

void store_positions(at::Tensor& dst, const at::Tensor& positions, int64_t ring) {
#ifdef KAKEYA_CUDA
  if (dst.is_cuda()) return cuda::store_positions(dst, positions, ring);
#endif
  dst.index_copy_(0, ring > 0 ? positions.remainder(ring) : positions, positions);
}

void advance_step(const at::Tensor& next, at::Tensor& out, at::Tensor& step, at::Tensor& cur, at::Tensor& pos) {
#ifdef KAKEYA_CUDA
  if (next.is_cuda()) return cuda::advance_step(next, out, step, cur, pos);
#endif
  out.index_copy_(0, step, next);
  cur.copy_(next.view({1, 1}));
  pos.add_(1);
  step.add_(1);
}

void concat_rows(const std::vector<at::Tensor>& parts, at::Tensor* out, at::Tensor* ring, const at::Tensor& pos) {
#ifdef KAKEYA_CUDA
  if (parts.at(0).is_cuda()) return cuda::concat_rows(parts, out, ring, pos);
#endif
  at::Tensor rows = parts.size() == 1 ? parts[0] : at::cat(parts, -1);
  rows = rows.reshape({-1, rows.size(-1)});  // [T, F]
  if (out) out->view({-1, rows.size(-1)}).copy_(rows);
  if (ring) ring->index_copy_(0, pos.remainder(ring->size(0)), rows);
}

}  // namespace kakeya::ops
