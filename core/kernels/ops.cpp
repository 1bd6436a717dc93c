#include "core/kernels/ops.h"

#include "core/error.h"

#ifdef KAKEYA_CUDA
#include <ATen/core/grad_mode.h>

#include "core/kernels/cuda/decode_ops.h"
#include "core/kernels/cuda/spec_ops.h"
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

at::Tensor act_mul(const at::Tensor& gu, bool gelu_tanh) {
#ifdef KAKEYA_CUDA
  if (fused(gu)) return cuda::act_mul(gu, gelu_tanh);
#endif
  auto parts = gu.chunk(2, -1);
  return (gelu_tanh ? at::gelu(parts[0], "tanh") : at::silu(parts[0])) * parts[1];
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

namespace {
void check_code_args(int64_t D, int bits, const char* what) {
  KAKEYA_CHECK(bits == 8 || bits == 4, what << ": bits expected 8 or 4, got " << bits);
  KAKEYA_CHECK(D > 0 && D % kCodeGroup == 0,
               what << ": row length " << D << " is not a multiple of the code group " << kCodeGroup);
}
}  // namespace

std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int bits) {
  const int64_t D = x.size(-1), G = D / kCodeGroup;
  check_code_args(D, bits, "quantize_rows");
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 1);
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
  }
  auto side = at::cat({scale_h, min_h}, -1).reshape({-1, 2 * G});   // [N, 2G]: (scale, min) per group
  auto codes_shape = lead, side_shape = lead;
  codes_shape.push_back(code_bytes(D, bits));
  side_shape.push_back(2 * G);
  return {c.reshape(codes_shape), side.reshape(side_shape)};
}

at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& side, int bits, at::ScalarType dtype) {
  const int64_t D = codes.size(-1) * 8 / bits, G = D / kCodeGroup;
  check_code_args(D, bits, "dequantize_rows");
  KAKEYA_CHECK(codes.scalar_type() == at::kByte && side.scalar_type() == at::kHalf && side.size(-1) == 2 * G,
               "dequantize_rows: codes uint8 [..., " << code_bytes(D, bits) << "] and side f16 [..., " << 2 * G
                                                     << "] expected, got " << codes.sizes() << " / " << side.sizes());
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end() - 1);
  shape.push_back(D);
  auto c = codes.reshape({-1, codes.size(-1)});
  if (bits == 4) c = at::stack({c.bitwise_and(15), c.bitwise_right_shift(4)}, -1);  // [N, D/2, 2]
  auto cf = c.reshape({-1, G, kCodeGroup}).to(at::kFloat);
  auto sd = side.reshape({-1, G, 2}).to(at::kFloat);
  auto x = sd.narrow(-1, 1, 1) + sd.narrow(-1, 0, 1) * cf;          // min + scale · c
  return x.reshape(shape).to(dtype);
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
  cuda::restore_store(desc_, layers_, k_raw, v_raw, positions);
#else
  (void)k_raw, (void)v_raw, (void)positions;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_pos,
                            const at::Tensor& q_pos, int64_t window, double scale, double softcap,
                            const CopyRule& copies) {
#ifdef KAKEYA_CUDA
  return cuda::decode_attention(q, k, v, slot_pos, q_pos, window, scale, softcap, copies);
#else
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
  if (scores.is_cuda()) return cuda::argmax_rows(scores, map, out);
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
