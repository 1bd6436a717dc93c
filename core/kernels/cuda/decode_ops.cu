#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/kernels/cuda/decode_kernels.cuh"
#include "core/kernels/cuda/decode_ops.h"

namespace kakeya::ops::cuda {
namespace k = kakeya::kernels;

namespace {

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}
void check_act(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, name,
              ": expected bf16 or f32, got ", t.scalar_type());
}
void check_w(const at::Tensor& w, int64_t n, const char* name) {
  check_cuda(w, name);
  TORCH_CHECK(w.scalar_type() == at::kFloat, name, ": norm weights must be f32, got ", w.scalar_type());
  TORCH_CHECK(w.numel() == n, name, ": expected ", n, " values, got ", w.numel());
}

// A K/V cache (or a view of one: a restored region, an exact ring): [B, H_kv, S, D] on CUDA,
// rows of D contiguous values, any batch/head strides, the same as `like`'s.
void check_cache_rows(const at::Tensor& c, const at::Tensor& like, const char* name) {
  TORCH_CHECK(c.is_cuda(), name, ": expected a CUDA tensor, got ", c.device());
  TORCH_CHECK(c.dim() == 4 && c.stride(3) == 1 && c.stride(2) == c.size(3) && c.strides() == like.strides(), name,
              ": expected [B, H_kv, S, D] with contiguous rows and K's strides, got sizes ", c.sizes(), " strides ",
              c.strides());
}
// RoPE tables [P, rot] on CUDA in dtype dt, rot even and <= the head dim D. Returns rot.
int64_t check_rope(const QKRopeArgs& a, at::ScalarType dt, int64_t D, const char* who) {
  check_cuda(a.cos, "rope cos");
  check_cuda(a.sin, "rope sin");
  TORCH_CHECK(a.cos.scalar_type() == dt && a.sin.scalar_type() == dt && a.sin.sizes() == a.cos.sizes(), who,
              ": RoPE tables must be ", dt, " and alike, got ", a.cos.scalar_type(), " ", a.cos.sizes(), " / ",
              a.sin.scalar_type(), " ", a.sin.sizes());
  const int64_t rot = a.cos.size(1);
  TORCH_CHECK(rot <= D && rot % 2 == 0, who, ": rotary dim ", rot, " vs head dim ", D);
  return rot;
}

// A residual step's copy of its new rows (RowCopy): a [R, F] ring on the device, in h's dtype,
// rows contiguous, H columns from col; every row of h with its own ring row (positions: one per
// row of h, [T_len] int64 — one sequence's positions, or ring rows of several sequences).
void check_copy(const RowCopy& copy, const at::Tensor& h, int64_t T_len, const char* who) {
  const at::Tensor& d = copy.dst;
  const int64_t H = h.size(-1);
  TORCH_CHECK(d.is_cuda() && d.dim() == 2 && d.stride(1) == 1 && d.scalar_type() == h.scalar_type() &&
                  copy.col >= 0 && copy.col + H <= d.size(1),
              who, " copy: expected a [R, F] ", h.scalar_type(), " CUDA ring with contiguous rows and ", H,
              " columns from ", copy.col, ", got ", d.sizes(), " ", d.scalar_type());
  TORCH_CHECK(h.numel() / H == T_len, who, " copy: a position per row expected, got ", h.sizes(), " for ",
              copy.positions.sizes(), " positions");
  check_cuda(copy.positions, "copy positions");
  TORCH_CHECK(copy.positions.scalar_type() == at::kLong && copy.positions.numel() == T_len, who,
              " copy positions: expected [", T_len, "] int64");
}

// Calls f with a typed null pointer selecting float or __nv_bfloat16.
template <typename F>
void dispatch(at::ScalarType st, F&& f) {
  if (st == at::kFloat) f((float*)nullptr);
  else f((__nv_bfloat16*)nullptr);
}
template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// A residual step's outputs (out of place: tap subscribers may hold the previous residual) and
// its copy's launch arguments, after checking the copy (RowCopy).
struct ResidualStep {
  at::Tensor h_out, y;
  int64_t copy_stride = 0, copy_rows = 1;
  const int64_t* copy_pos = nullptr;
  int T_len = 1;
  template <typename T> T* copy_dst(const RowCopy* copy) const { return copy ? ptr<T>(copy->dst) + copy->col : nullptr; }
};
ResidualStep residual_step(const at::Tensor& h, const RowCopy* copy, const char* who, bool with_y = true) {
  ResidualStep r;
  r.T_len = h.dim() >= 2 ? (int)h.size(-2) : 1;
  if (copy) {
    r.T_len = (int)copy->positions.numel();
    check_copy(*copy, h, r.T_len, who);
    r.copy_stride = copy->dst.stride(0);
    r.copy_rows = copy->dst.size(0);
    r.copy_pos = copy->positions.data_ptr<int64_t>();
  }
  r.h_out = at::empty_like(h);
  if (with_y) r.y = at::empty_like(h);
  return r;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, bool unit_offset) {
  auto x = x_in.contiguous();
  check_act(x, "rms_norm x");
  const int64_t H = x.size(-1);
  check_w(w, H, "rms_norm w");
  c10::cuda::CUDAGuard g(x.device());
  auto out = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_rms_norm<T>(ptr<T>(x), w.data_ptr<float>(), ptr<T>(out), x.numel() / H, H, eps, unit_offset,
                          at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void store_positions(at::Tensor& dst, const at::Tensor& positions_in, int64_t ring) {
  auto positions = positions_in.contiguous();
  check_cuda(dst, "store_positions dst");
  check_cuda(positions, "store_positions positions");
  TORCH_CHECK(dst.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && dst.dim() == 1 &&
                  positions.dim() == 1 && ring >= 0 && (ring == 0 || ring <= dst.numel()),
              "store_positions: expected [S] and [T] int64 and a ring of at most S slots, got ", dst.sizes(), " ",
              dst.scalar_type(), ", ", positions.sizes(), " ", positions.scalar_type(), ", ring ", ring);
  if (positions.numel() == 0) return;
  c10::cuda::CUDAGuard g(dst.device());
  k::launch_store_positions(positions.data_ptr<int64_t>(), (int)positions.numel(), ring, dst.data_ptr<int64_t>(),
                            at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::pair<at::Tensor, at::Tensor> embed_rms_norm(const at::Tensor& table, const at::Tensor& ids_in,
                                                 const at::Tensor& scale, const at::Tensor& w, double eps,
                                                 bool unit_offset) {
  auto ids = ids_in.contiguous();
  check_act(table, "embed_rms_norm table");
  TORCH_CHECK(table.dim() == 2, "embed_rms_norm table: expected [V, H], got ", table.sizes());
  const int64_t H = table.size(1);
  check_cuda(ids, "embed_rms_norm ids");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "embed_rms_norm ids: expected int64, got ", ids.scalar_type());
  check_cuda(scale, "embed_rms_norm scale");
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == table.scalar_type(), "embed_rms_norm scale: expected one ",
              table.scalar_type(), " value, got ", scale.sizes(), " ", scale.scalar_type());
  check_w(w, H, "embed_rms_norm w");
  c10::cuda::CUDAGuard g(table.device());
  auto sizes = ids.sizes().vec();
  sizes.push_back(H);
  auto h = at::empty(sizes, table.options()), x = at::empty(sizes, table.options());
  if (ids.numel() == 0) return {h, x};
  dispatch(table.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_embed_rms_norm<T>(ids.data_ptr<int64_t>(), ptr<T>(table), ptr<T>(scale), w.data_ptr<float>(), ptr<T>(h),
                                ptr<T>(x), ids.numel(), H, eps, unit_offset, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {h, x};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h_in, const at::Tensor& x_in, const at::Tensor& w_post,
                                               const at::Tensor& w_next, double eps, bool unit_offset,
                                               const RowCopy* copy) {
  auto h = h_in.contiguous(), x = x_in.contiguous();
  check_act(h, "add_rms_norm h");
  check_act(x, "add_rms_norm x");
  TORCH_CHECK(h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type(), "add_rms_norm: h ", h.sizes(), " vs x ",
              x.sizes());
  const int64_t H = h.size(-1);
  if (w_post.defined()) check_w(w_post, H, "add_rms_norm w_post");
  check_w(w_next, H, "add_rms_norm w_next");
  TORCH_CHECK(H * 4 <= 48 * 1024, "add_rms_norm: hidden size ", H, " exceeds the kernel's shared memory");
  c10::cuda::CUDAGuard g(h.device());
  const auto r = residual_step(h, copy, "add_rms_norm");
  dispatch(h.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_add_rms_norm<T>(ptr<T>(h), ptr<T>(x), w_post.defined() ? w_post.data_ptr<float>() : nullptr,
                              w_next.data_ptr<float>(), ptr<T>(r.h_out), ptr<T>(r.y), h.numel() / H, H, eps,
                              unit_offset, r.copy_dst<T>(copy), r.copy_stride, r.copy_pos, r.copy_rows, r.T_len,
                              at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {r.h_out, r.y};
}

at::Tensor act_mul(const at::Tensor& gu_in, bool gelu_tanh) {
  auto gu = gu_in.contiguous();
  check_act(gu, "act_mul gu");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "act_mul: last dim ", gu.size(-1), " must be even ([gate | up])");
  const int64_t I = gu.size(-1) / 2;
  c10::cuda::CUDAGuard g(gu.device());
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gu.options());
  dispatch(gu.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_act_mul<T>(ptr<T>(gu), ptr<T>(out), gu.numel() / (2 * I), I, gelu_tanh ? k::Act::GeluTanh : k::Act::Silu,
                         at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor qk_norm_rope_store(const at::Tensor& qkv_in, const at::Tensor& positions, const QKRopeArgs& a,
                              at::Tensor& k_cache, at::Tensor& v_cache) {
  auto qkv = qkv_in.contiguous();
  check_act(qkv, "qk_norm_rope_store qkv");
  check_cuda(positions, "qk_norm_rope_store positions");
  check_cache_rows(k_cache, k_cache, "k_cache");
  check_cache_rows(v_cache, k_cache, "v_cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  const int64_t B = qkv.size(0), T = qkv.size(1), Hq = a.num_heads, Hkv = a.num_kv_heads, D = a.head_dim;
  const int64_t width = (Hq + (a.v_from_k ? 1 : 2) * Hkv) * D;
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == width, "qkv: expected [B, T, ", width, "], got ", qkv.sizes());
  // [T]: every row at the same positions; [B, T]: each row its own sequence (a batch of sessions).
  const bool per_row = positions.dim() == 2;
  TORCH_CHECK(positions.is_contiguous() && (per_row ? positions.size(0) == B && positions.size(1) == T
                                                    : positions.dim() == 1 && positions.numel() == T),
              "positions: expected contiguous [", T, "] or [", B, ", ", T, "] int64, got ", positions.sizes());
  TORCH_CHECK(k_cache.size(0) == B && k_cache.size(1) == Hkv && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(),
              "k/v cache: expected [", B, ", ", Hkv, ", S, ", D, "], got ", k_cache.sizes(), " / ", v_cache.sizes());
  const int64_t ring = a.ring > 0 ? a.ring : k_cache.size(2);
  TORCH_CHECK(ring <= k_cache.size(2), "qk_norm_rope_store: ring of ", ring, " slots in a cache of ", k_cache.size(2));
  TORCH_CHECK(T <= ring, "qk_norm_rope_store: chunk of ", T, " tokens does not fit a ring of ", ring);
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type(), "qk_norm_rope_store: cache dtype must match qkv");
  if (a.q_norm.defined()) check_w(a.q_norm, D, "q_norm");
  if (a.k_norm.defined()) check_w(a.k_norm, D, "k_norm");
  if (a.v_norm.defined()) check_w(a.v_norm, D, "v_norm");
  TORCH_CHECK(a.sink == 0, "qk_norm_rope_store: attention sinks are copied by RestoreStore, not here");
  const int64_t rot = check_rope(a, qkv.scalar_type(), D, "qk_norm_rope_store");
  c10::cuda::CUDAGuard g(qkv.device());
  auto q = at::empty({B, T, Hq, D}, qkv.options());
  dispatch(qkv.scalar_type(), [&](auto* tag) {
    using Ty = std::remove_pointer_t<decltype(tag)>;
    k::launch_qk_norm_rope_store<Ty>(ptr<Ty>(qkv), a.q_norm.defined() ? a.q_norm.data_ptr<float>() : nullptr,
                                     a.k_norm.defined() ? a.k_norm.data_ptr<float>() : nullptr,
                                     a.v_norm.defined() ? a.v_norm.data_ptr<float>() : nullptr, a.v_from_k, ptr<Ty>(a.cos),
                                     ptr<Ty>(a.sin), positions.data_ptr<int64_t>(), per_row ? (int)T : 0, ptr<Ty>(q), ptr<Ty>(k_cache),
                                     ptr<Ty>(v_cache), B, T, Hq, Hkv, D, rot, k_cache.stride(0), k_cache.stride(1), ring,
                                     a.norm.eps, a.norm.unit_offset, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return q;
}

namespace {
// Coded rows of a region [B, H_kv, R, ...]: contiguous, uint8 codes and f16 side values that fit D.
void check_coded_slots(const CodedSlots& c, int64_t B, int64_t Hkv, int64_t D, const char* what) {
  check_row_code(D, c.code, what);
  for (const at::Tensor* t : {&c.k_codes, &c.v_codes, &c.k_side, &c.v_side}) {
    check_cuda(*t, what);
    TORCH_CHECK(t->is_contiguous() && t->dim() == 4 && t->size(0) == B && t->size(1) == Hkv &&
                    t->size(2) == c.k_codes.size(2),
                what, ": expected contiguous [", B, ", ", Hkv, ", R, .], got ", t->sizes());
  }
  TORCH_CHECK(c.k_codes.scalar_type() == at::kByte && c.v_codes.scalar_type() == at::kByte &&
                  c.k_codes.size(3) == code_bytes(D, c.code.k()) && c.v_codes.size(3) == code_bytes(D, c.code.v()),
              what, ": codes uint8 [.., ", code_bytes(D, c.code.k()), "] (K) and [.., ", code_bytes(D, c.code.v()),
              "] (V) expected, got ", c.k_codes.sizes(), " / ", c.v_codes.sizes());
  TORCH_CHECK(c.k_side.scalar_type() == at::kHalf && c.v_side.scalar_type() == at::kHalf &&
                  c.k_side.size(3) == side_halves(D, c.code) && c.v_side.size(3) == side_halves(D, c.code),
              what, ": side values f16 [.., ", side_halves(D, c.code), "] expected, got ", c.k_side.sizes());
  TORCH_CHECK(c.k_mean.defined() == c.v_mean.defined() && (!c.k_mean.defined() || c.code.rotated()), what,
              ": means go with rotated codes, both K and V");
  TORCH_CHECK(c.k_weight.defined() == c.code.weighted && (!c.code.weighted || c.k_mean.defined()), what, ": ",
              row_code_name(c.code), " rows ", c.code.weighted ? "need k_weight and means" : "take no k_weight");
  for (const at::Tensor* m : {&c.k_mean, &c.v_mean, &c.k_weight})
    if (m->defined()) {
      check_cuda(*m, what);
      TORCH_CHECK(m->scalar_type() == at::kFloat && m->dim() == 3 && m->size(0) == B && m->size(1) == Hkv && m->size(2) == D,
                  what, ": means and weights f32 [", B, ", ", Hkv, ", ", D, "] expected, got ", m->sizes());
    }
}
// The activation dtype a RestoreStore layer works in: its dense caches', or its exact ring's when coded.
at::ScalarType layer_dtype(const RestoreStore::Layer& L) {
  if (!L.codes.defined()) return L.k_cache.scalar_type();
  return L.args.sink_k.defined() ? L.args.sink_k.scalar_type() : L.args.cos.scalar_type();
}
}  // namespace

at::Tensor restore_store_descriptors(const std::vector<RestoreStore::Layer>& layers) {
  TORCH_CHECK(!layers.empty() && layers.size() <= 65535, "RestoreStore: ", layers.size(), " layers (1 .. 65535)");
  const RestoreStore::Layer& first = layers[0];
  std::vector<k::RestoreLayerDesc> desc;
  for (size_t i = 0; i < layers.size(); ++i) {
    const RestoreStore::Layer& L = layers[i];
    const QKRopeArgs& a = L.args;
    const CodedSlots& cs = L.codes;
    // The region's K/V as the kernel addresses them (dense caches, or the codes, whose rows
    // stand for the slots): dtype from the sink ring or caches, slots from whichever is stored.
    const at::Tensor &kc = cs.defined() ? cs.k_codes : L.k_cache, &vc = cs.defined() ? cs.v_codes : L.v_cache;
    const at::ScalarType dt = cs.defined() ? layer_dtype(L) : kc.scalar_type();
    TORCH_CHECK(a.num_heads == 0, "RestoreStore layer ", i, ": K/V only (num_heads 0), got ", a.num_heads);
    TORCH_CHECK(!a.v_norm.defined() && !a.v_from_k, "RestoreStore layer ", i,
                ": stores raw v from its own rows (no v_norm, no K=V layers)");
    if (cs.defined()) {
      TORCH_CHECK(!cs.code.weighted, "RestoreStore layer ", i, ": restored regions take unweighted codes, got ",
                  row_code_name(cs.code));
      check_coded_slots(cs, 1, a.num_kv_heads, a.head_dim, "RestoreStore codes");
    } else {
      check_cache_rows(kc, kc, "RestoreStore k_cache");
      check_cache_rows(vc, kc, "RestoreStore v_cache");
      TORCH_CHECK(kc.size(0) == 1 && kc.size(1) == a.num_kv_heads && kc.size(3) == a.head_dim &&
                      vc.sizes() == kc.sizes() && vc.scalar_type() == kc.scalar_type(),
                  "RestoreStore layer ", i, ": k/v caches ", kc.sizes(), " / ", vc.sizes(), " vs [1, ", a.num_kv_heads,
                  ", S, ", a.head_dim, "]");
    }
    TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat, "RestoreStore layer ", i, ": bf16 or f32 caches, got ", dt);
    TORCH_CHECK(a.num_kv_heads == first.args.num_kv_heads && a.head_dim == first.args.head_dim &&
                    dt == layer_dtype(first) && a.norm.eps == first.args.norm.eps &&
                    a.norm.unit_offset == first.args.norm.unit_offset && a.sink == first.args.sink,
                "RestoreStore layer ", i, ": kv heads, head dim, dtype, norm and sink must match layer 0's");
    const int64_t ring = a.ring > 0 ? a.ring : kc.size(2);
    TORCH_CHECK(ring <= kc.size(2), "RestoreStore layer ", i, ": ring of ", ring, " slots in a cache of ", kc.size(2));
    TORCH_CHECK(L.k_src >= 0 && L.v_src >= 0, "RestoreStore layer ", i, ": negative source column");
    if (a.k_norm.defined()) check_w(a.k_norm, a.head_dim, "RestoreStore k_norm");
    const int64_t rot = check_rope(a, dt, a.head_dim, "RestoreStore");
    TORCH_CHECK(a.sink == 0 || (a.sink_k.defined() && a.sink_v.defined()), "RestoreStore layer ", i, ": sink ", a.sink,
                " needs sink_k/sink_v");
    TORCH_CHECK(a.sink_k.defined() == a.sink_v.defined(), "RestoreStore layer ", i, ": sink_k and sink_v go together");
    if (a.sink_k.defined()) {  // the exact ring: sinks, and every position copy() stores
      // Uncoded, the sinks' ring shares the region's head stride (one stride in the descriptor).
      const at::Tensor& like = cs.defined() ? a.sink_k : kc;
      check_cache_rows(a.sink_k, like, "RestoreStore sink_k");
      check_cache_rows(a.sink_v, like, "RestoreStore sink_v");
      TORCH_CHECK(a.sink_ring > 0 && a.sink_ring <= a.sink_k.size(2) && a.sink_k.sizes().slice(0, 2) == kc.sizes().slice(0, 2) &&
                      a.sink_k.size(3) == a.head_dim && a.sink_k.sizes() == a.sink_v.sizes() && a.sink_k.scalar_type() == dt,
                  "RestoreStore layer ", i, ": sink buffers ", a.sink_k.sizes(), " / ring ", a.sink_ring,
                  " do not match the cache ", kc.sizes());
    }
    k::RestoreLayerDesc d{};
    d.k_w = a.k_norm.defined() ? a.k_norm.data_ptr<float>() : nullptr;
    d.cos = a.cos.data_ptr();
    d.sin = a.sin.data_ptr();
    if (cs.defined()) {
      d.kc = cs.k_codes.data_ptr();
      d.vc = cs.v_codes.data_ptr();
      d.ks = cs.k_side.data_ptr();
      d.vs = cs.v_side.data_ptr();
      d.code_head_stride = cs.k_codes.stride(1);
      d.v_code_head_stride = cs.v_codes.stride(1);
      d.side_head_stride = cs.k_side.stride(1);
      d.bits = cs.code.bits;
      d.v_bits = cs.code.v().bits;
      d.rotated = cs.code.rotated();
      d.uniform = cs.code.uniform;
    } else {
      d.k = kc.data_ptr();
      d.v = vc.data_ptr();
    }
    const bool exact_ring = a.sink_k.defined();
    d.sink_k = exact_ring ? a.sink_k.data_ptr() : nullptr;
    d.sink_v = exact_ring ? a.sink_v.data_ptr() : nullptr;
    // The exact ring is addressed with this stride too (the cache's head stride).
    d.head_stride = cs.defined() ? (exact_ring ? a.sink_k.stride(1) : 0) : kc.stride(1);
    d.k_src = L.k_src;
    d.v_src = L.v_src;
    d.ring = (int)ring;
    d.sink_ring = exact_ring ? (int)a.sink_ring : 1;
    d.rot = (int)rot;
    desc.push_back(d);
  }
  auto host = at::empty({(int64_t)(desc.size() * sizeof(k::RestoreLayerDesc))}, at::kByte);
  std::memcpy(host.data_ptr(), desc.data(), host.numel());
  return host.to((first.codes.defined() ? first.codes.k_codes : first.k_cache).device());
}

void restore_store(const at::Tensor& desc, const std::vector<RestoreStore::Layer>& layers, const at::Tensor& k_raw,
                   const at::Tensor& v_raw, const at::Tensor& positions) {
  const QKRopeArgs& a = layers[0].args;
  const at::ScalarType dt = layer_dtype(layers[0]);
  const at::Device dev = (layers[0].codes.defined() ? layers[0].codes.k_codes : layers[0].k_cache).device();
  // No raw rows: copy(), every position taken from its layer's exact ring as sinks are.
  const bool copy = !k_raw.defined();
  check_cuda(positions, "RestoreStore positions");
  const int64_t N = positions.numel(), D = a.head_dim, Hkv = a.num_kv_heads;
  TORCH_CHECK(positions.scalar_type() == at::kLong, "RestoreStore positions must be int64");
  if (copy) {
    for (size_t i = 0; i < layers.size(); ++i)
      TORCH_CHECK(layers[i].args.sink_k.defined(), "RestoreStore::copy: layer ", i,
                  " has no exact ring to copy from (args.sink_k/sink_v)");
  } else {
    check_cuda(k_raw, "RestoreStore k_raw");
    check_cuda(v_raw, "RestoreStore v_raw");
    TORCH_CHECK(k_raw.dim() == 2 && v_raw.dim() == 2 && k_raw.size(0) == N && v_raw.size(0) == N,
                "RestoreStore: raw rows [N, F] for ", N, " positions expected, got ", k_raw.sizes(), " / ", v_raw.sizes());
    TORCH_CHECK(k_raw.scalar_type() == dt && v_raw.scalar_type() == dt, "RestoreStore: raw rows must be ", dt, ", got ",
                k_raw.scalar_type());
    for (const auto& L : layers)
      TORCH_CHECK(L.k_src + Hkv * D <= k_raw.size(1) && L.v_src + Hkv * D <= v_raw.size(1),
                  "RestoreStore: a layer reads columns ", L.k_src, " / ", L.v_src, " + ", Hkv * D, " past the raw rows ",
                  k_raw.sizes(), " / ", v_raw.sizes());
  }
  for (const auto& L : layers)
    TORCH_CHECK(N <= (L.args.ring > 0 ? L.args.ring : (L.codes.defined() ? L.codes.k_codes : L.k_cache).size(2)),
                "RestoreStore: ", N, " positions do not fit a ring of ", L.args.ring);
  if (N == 0) return;
  c10::cuda::CUDAGuard g(dev);
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // copy(): every position below the "sink" count, so the kernel never reads a raw row.
    k::launch_restore_store<T>(copy ? nullptr : ptr<T>(k_raw), copy ? nullptr : ptr<T>(v_raw),
                               copy ? 0 : k_raw.size(1), copy ? 0 : v_raw.size(1),
                               reinterpret_cast<const k::RestoreLayerDesc*>(desc.data_ptr()), (int)layers.size(),
                               positions.data_ptr<int64_t>(), (int)N, (int)Hkv, (int)D,
                               copy ? std::numeric_limits<int>::max() : (int)a.sink, a.norm.eps,
                               a.norm.unit_offset, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void code_rows(at::Tensor& k, at::Tensor& v, const at::Tensor& src_slots, const at::Tensor& dst_rows, CodedSlots& to,
               int64_t sink, int64_t sink_slot0) {
  check_act(v, "code_rows v");
  check_cache_rows(k, v, "code_rows k");
  check_cuda(src_slots, "code_rows src_slots");
  check_cuda(dst_rows, "code_rows dst_rows");
  // [T] shared by the B rows, or [B, T]: each row its own (independent sequences)
  const bool per_row = dst_rows.dim() == 2;
  const int64_t B = k.size(0), Hkv = k.size(1), D = k.size(3), Tn = src_slots.size(-1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "code_rows: k ", k.sizes(), " vs v ", v.sizes());
  check_coded_slots(to, B, Hkv, D, "code_rows codes");
  TORCH_CHECK(src_slots.scalar_type() == at::kLong && dst_rows.scalar_type() == at::kLong &&
                  src_slots.is_contiguous() && dst_rows.is_contiguous() && src_slots.sizes() == dst_rows.sizes() &&
                  (per_row ? dst_rows.size(0) == B : dst_rows.dim() == 1),
              "code_rows: src_slots / dst_rows contiguous int64 [T] or [", B, ", T] expected, got ", src_slots.sizes(),
              " / ", dst_rows.sizes());
  TORCH_CHECK(Tn <= 2147483647, "code_rows: too many rows");
  TORCH_CHECK(sink >= 0 && (sink == 0 || (sink_slot0 >= 0 && sink_slot0 + sink <= k.size(2))), "code_rows: sink slots ",
              sink_slot0, " + ", sink, " outside the cache's ", k.size(2), " slots");
  if (Tn == 0) return;
  c10::cuda::CUDAGuard g(k.device());
  dispatch(k.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_code_rows<T>(ptr<T>(k), ptr<T>(v), k.stride(0), k.stride(1), src_slots.data_ptr<int64_t>(),
                           dst_rows.data_ptr<int64_t>(), per_row ? (int)Tn : 0, to.k_codes.data_ptr<uint8_t>(), to.v_codes.data_ptr<uint8_t>(),
                           reinterpret_cast<__half*>(to.k_side.data_ptr()), reinterpret_cast<__half*>(to.v_side.data_ptr()),
                           to.k_mean.defined() ? to.k_mean.data_ptr<float>() : nullptr,
                           to.v_mean.defined() ? to.v_mean.data_ptr<float>() : nullptr,
                           to.k_weight.defined() ? to.k_weight.data_ptr<float>() : nullptr, (int)B, (int)Hkv, (int)Tn, (int)to.k_codes.size(2), (int)D, to.code.rotated(), to.code.uniform, to.code.bits,
                           to.code.v().bits, sink, sink_slot0, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

bool dequantize_rows_supported(int64_t D, at::ScalarType dtype) {
  return (D == 64 || D == 128 || D == 256 || D == 512) && (dtype == at::kFloat || dtype == at::kBFloat16);
}

at::Tensor dequantize_rows(const at::Tensor& codes_in, const at::Tensor& side_in, const RowCode& code,
                           at::ScalarType dtype) {
  TORCH_CHECK(!code.split(), "dequantize_rows: ", row_code_name(code), " codes K and V rows apart (pass its k() or v())");
  const int64_t D = codes_in.size(-1) * 8 / code.bits;
  TORCH_CHECK(dequantize_rows_supported(D, dtype), "dequantize_rows: row length ", D, " in ", dtype,
              " (the kernel takes 64, 128, 256 or 512 values, f32 or bf16)");
  check_cuda(codes_in, "dequantize_rows codes");
  check_cuda(side_in, "dequantize_rows side");
  auto codes = codes_in.contiguous(), side = side_in.contiguous();
  const int64_t rows = codes.numel() / codes.size(-1);
  TORCH_CHECK(side.numel() == rows * side_halves(D, code), "dequantize_rows: side ", side.sizes(), " for ", rows, " rows");
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end() - 1);
  shape.push_back(D);
  auto out = at::empty(shape, codes.options().dtype(dtype));
  if (rows == 0) return out;
  c10::cuda::CUDAGuard g(codes.device());
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_dequantize_rows<T>(codes.data_ptr<uint8_t>(), reinterpret_cast<const __half*>(side.data_ptr()), rows,
                                 (int)D, code.rotated(), code.uniform, code.bits, ptr<T>(out),
                                 at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_pos,
                            const at::Tensor& q_pos, int64_t window, double scale, double softcap,
                            const CopyRule& copies, const AttnTail& tail) {
  auto q = q_in.contiguous();
  check_act(q, "decode_attention q");
  check_cuda(k, "decode_attention k");
  check_cuda(v, "decode_attention v");
  check_cuda(slot_pos, "decode_attention slot_pos");
  check_cuda(q_pos, "decode_attention q_pos");
  TORCH_CHECK(q.dim() == 4, "decode_attention q: expected [B, T, Hq, D], got ", q.sizes());
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1), S = slot_pos.size(-1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D, "decode_attention k/v: ", k.sizes(), " vs q ",
              q.sizes());
  const CodedSlots& cs = copies.codes;
  k::CodedRegion cr;
  if (cs.defined()) {
    TORCH_CHECK(copies.in_restored.defined(), "decode_attention: a coded region without a copy rule");
    check_coded_slots(cs, B, Hkv, D, "decode_attention codes");
    TORCH_CHECK(k.size(2) + cs.k_codes.size(2) == S, "decode_attention: ", k.size(2), " dense + ", cs.k_codes.size(2),
                " coded slots vs ", S, " slot positions");
    cr.kc = cs.k_codes.data_ptr<uint8_t>();
    cr.vc = cs.v_codes.data_ptr<uint8_t>();
    cr.ks = reinterpret_cast<const __half*>(cs.k_side.data_ptr());
    cr.vs = reinterpret_cast<const __half*>(cs.v_side.data_ptr());
    cr.bits = cs.code.bits;
    cr.vbits = cs.code.v().bits;
    cr.rotated = cs.code.rotated();
    cr.uniform = cs.code.uniform;
    if (cs.k_mean.defined()) {
      cr.km = cs.k_mean.data_ptr<float>();
      cr.vm = cs.v_mean.data_ptr<float>();
    }
    if (cs.k_weight.defined()) cr.kw = cs.k_weight.data_ptr<float>();
    cr.ring = (int)k.size(2);
    cr.rows = (int)cs.k_codes.size(2);
  } else {
    TORCH_CHECK(k.size(2) == S, "decode_attention: k/v hold ", k.size(2), " slots vs ", S, " slot positions");
  }
  TORCH_CHECK(Hq % Hkv == 0, "decode_attention: ", Hq, " q heads vs ", Hkv, " kv heads");
  // Per-row forms ([B, S] slots, [B, T] queries): each row an independent sequence (a batch of sessions).
  const bool sp_rows = slot_pos.dim() == 2, qp_rows = q_pos.dim() == 2;
  TORCH_CHECK(slot_pos.is_contiguous() && slot_pos.scalar_type() == at::kLong &&
                  (sp_rows ? slot_pos.size(0) == B : slot_pos.dim() == 1),
              "slot_pos: expected contiguous [", S, "] or [", B, ", ", S, "] int64, got ", slot_pos.sizes());
  TORCH_CHECK(q_pos.is_contiguous() && q_pos.scalar_type() == at::kLong &&
                  (qp_rows ? q_pos.size(0) == B && q_pos.size(1) == T
                           : q_pos.dim() == 1 && (q_pos.numel() == T || q_pos.numel() == 1)),
              "q_pos: expected [", T, "], [1] or [", B, ", ", T, "] int64, got ", q_pos.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "decode_attention: cache dtype must match q");
  TORCH_CHECK(B * T * Hq <= 65535, "decode_attention: ", B * T * Hq, " query rows exceed the grid (65535)");
  const bool* in_restored = nullptr;
  if (copies.in_restored.defined()) {
    check_cuda(copies.in_restored, "decode_attention in_restored");
    TORCH_CHECK(copies.in_restored.scalar_type() == at::kBool && copies.in_restored.numel() == S,
                "in_restored: expected [", S, "] bool");
    TORCH_CHECK(copies.window > 0 && copies.code_from >= 0, "decode_attention: copy rule window ", copies.window,
                " code_from ", copies.code_from);
    in_restored = copies.in_restored.data_ptr<bool>();
  }
  int64_t tn = 0;
  if (tail.defined()) {
    check_cuda(tail.k, "decode_attention tail k");
    check_cuda(tail.v, "decode_attention tail v");
    check_cuda(tail.pos, "decode_attention tail pos");
    tn = tail.k.size(2);
    TORCH_CHECK(tail.k.dim() == 4 && tail.k.sizes() == tail.v.sizes() && tail.k.size(0) == B && tail.k.size(1) == Hkv &&
                    tail.k.size(3) == D && tn > 0,
                "decode_attention tail k/v: expected [", B, ", ", Hkv, ", n, ", D, "], got ", tail.k.sizes(), " / ",
                tail.v.sizes());
    TORCH_CHECK(tail.k.is_contiguous() && tail.v.is_contiguous() && tail.k.scalar_type() == q.scalar_type() &&
                    tail.v.scalar_type() == q.scalar_type(),
                "decode_attention tail k/v: contiguous, in q's dtype");
    TORCH_CHECK(tail.pos.is_contiguous() && tail.pos.scalar_type() == at::kLong && tail.pos.dim() == 1 &&
                    tail.pos.numel() == tn,
                "decode_attention tail pos: expected contiguous [", tn, "] int64, got ", tail.pos.sizes());
    TORCH_CHECK(!sp_rows, "decode_attention: a tail with per-row slot positions (independent rows never attend one)");
  }
  c10::cuda::CUDAGuard g(q.device());
  // From one sequence's query rows, not the batch's: a session's result must not depend on the
  // sessions batched with it (the key blocks fix the order of the softmax sums).
  // Query heads per block: one in a decode step (but over a long history of rotated coded rows),
  // else every head of a KV head's group where the registers allow; KAKEYA_ATTN_GROUP=N caps it
  // (a measurement's switch: the same run timed with N = 1).
  static const int group_cap = [] {
    const char* e = std::getenv("KAKEYA_ATTN_GROUP");
    return e ? std::atoi(e) : 0;
  }();
  const bool long_rotated = cr.kc && cr.rotated && cr.rows >= k::kAttnGroupCodedRows;
  const int G = k::decode_attn_group((int)Hq, (int)Hkv, (int)D, (int)T, long_rotated, group_cap);
  const int keys = k::decode_attn_keys((int)(S + tn), (int)(T * Hq / G),
                                       at::cuda::getCurrentDeviceProperties()->multiProcessorCount, (int)T, G);
  auto partial = at::empty({B * T * Hq, k::decode_attn_chunks(S + tn, keys), D + 2}, q.options().dtype(at::kFloat));
  auto out = at::empty({B, T, Hq * D}, q.options());
  bool ok = false;
  dispatch(q.scalar_type(), [&](auto* tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    ok = k::launch_decode_attention<T_>(ptr<T_>(q), ptr<T_>(k), ptr<T_>(v), slot_pos.data_ptr<int64_t>(),
                                        sp_rows ? (int)S : 0, q_pos.data_ptr<int64_t>(),
                                        qp_rows || q_pos.numel() != 1 ? 1 : 0, qp_rows ? (int)T : 0, in_restored,
                                        (int)copies.window, copies.code_from,
                                        in_restored ? copies.keep_below : (int64_t)-1, cr,
                                        tn ? ptr<T_>(tail.k) : nullptr, tn ? ptr<T_>(tail.v) : nullptr,
                                        tn ? tail.pos.data_ptr<int64_t>() : nullptr, (int)tn, partial.data_ptr<float>(), ptr<T_>(out),
                                        B, T, Hq, Hkv, S, D, keys, G, window, scale, softcap,
                                        at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  TORCH_CHECK(ok, "decode_attention: head dim ", D, " not supported (64, 128, 256, 512)");
  return out;
}

namespace {
// The GEMV kernel when the shape suits it, else an undefined tensor. act != None:
// w is [gate; up] ([2N, K]) and the result act(gate)·up ([..., N]).
at::Tensor try_gemv(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& bias, k::Act act) {
  auto x = x_in.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / K;
  const int64_t N = act == k::Act::None ? w.size(0) : w.size(0) / 2;
  const bool ok = x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.size(1) == K &&
                  (!bias.defined() || (bias.scalar_type() == x.scalar_type() && bias.is_contiguous()));
  // Several rows: the tensor-core kernel in bf16 where the shape suits it; f32 keeps cuBLAS (the
  // lossless checks compare f32 decoders bit for bit, and the mma instructions take no f32 inputs).
  const bool mma = M > 1 && x.scalar_type() == at::kBFloat16 && k::mma_gemv_fits(M, N, K);
  if (!ok || (M != 1 && !mma)) return {};
  c10::cuda::CUDAGuard g(x.device());
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, x.options());
  bool launched = false;
  if (mma) {
    launched = k::launch_mma_gemv(ptr<__nv_bfloat16>(x), ptr<__nv_bfloat16>(w),
                                  bias.defined() ? ptr<__nv_bfloat16>(bias) : nullptr, ptr<__nv_bfloat16>(y), M, N, K,
                                  act, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return launched ? y : at::Tensor();
  }
  dispatch(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launched = k::launch_gemv<T>(ptr<T>(x), ptr<T>(w), bias.defined() ? ptr<T>(bias) : nullptr, ptr<T>(y), M, N, K,
                                 act, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                 at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return launched ? y : at::Tensor();
}
}  // namespace

std::pair<at::Tensor, at::Tensor> add_rms_norm_linear(const at::Tensor& h_in, const at::Tensor& x_in,
                                                      const at::Tensor& w_post, const at::Tensor& w_next, double eps,
                                                      bool unit_offset, const Linear& lin) {
  auto h = h_in.contiguous(), x = x_in.contiguous();
  const at::Tensor& w = lin.w;
  const int64_t K = h.size(-1);
  const bool ok = h.numel() == K && x.sizes() == h.sizes() && x.scalar_type() == h.scalar_type() &&
                  (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat) && w.is_cuda() &&
                  w.scalar_type() == h.scalar_type() && w.is_contiguous() && w.dim() == 2 && w.size(1) == K &&
                  (!lin.gated || w.size(0) % 2 == 0) &&
                  (!lin.bias.defined() || (lin.bias.scalar_type() == h.scalar_type() && lin.bias.is_contiguous()));
  if (!ok) return {};
  check_act(h, "add_rms_norm_linear h");
  check_act(x, "add_rms_norm_linear x");
  if (w_post.defined()) check_w(w_post, K, "add_rms_norm_linear w_post");
  check_w(w_next, K, "add_rms_norm_linear w_next");
  c10::cuda::CUDAGuard g(h.device());
  const auto r = residual_step(h, nullptr, "add_rms_norm_linear", /*with_y=*/false);
  const int64_t N = lin.gated ? w.size(0) / 2 : w.size(0);
  auto sizes = h.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, h.options());
  const k::Act act = !lin.gated ? k::Act::None : (lin.gelu_tanh ? k::Act::GeluTanh : k::Act::Silu);
  bool launched = false;
  dispatch(h.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launched = k::launch_residual_gemv<T>(
        ptr<T>(h), ptr<T>(x), w_post.defined() ? w_post.data_ptr<float>() : nullptr, w_next.data_ptr<float>(),
        ptr<T>(r.h_out), ptr<T>(w),
        lin.bias.defined() ? ptr<T>(lin.bias) : nullptr, ptr<T>(y), (int)N, (int)K, act, eps, unit_offset,
        at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!launched) return {};
  return {r.h_out, y};
}

void prefetch_l2(const std::vector<at::Tensor>& tensors) {
  const auto defined = std::count_if(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.defined(); });
  TORCH_CHECK(defined <= k::kPrefetchRanges, "prefetch_l2: ", defined, " tensors, at most ", k::kPrefetchRanges);
  k::PrefetchRanges r;
  c10::Device dev = c10::kCPU;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    check_cuda(t, "prefetch_l2 tensor");
    dev = t.device();
    // Its whole 16-byte units (what a bulk request takes), from the first 16-byte boundary.
    const auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t a = (p + 15) & ~uintptr_t(15);
    const int64_t bytes = (t.numel() * t.element_size() - (int64_t)(a - p)) & ~int64_t(15);
    if (bytes <= 0) continue;
    r.ptr[r.n] = reinterpret_cast<const char*>(a);
    r.bytes[r.n++] = bytes;
  }
  if (r.n == 0) return;
  c10::cuda::CUDAGuard g(dev);
  k::launch_prefetch_l2(r, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  auto y = try_gemv(x, w, bias, k::Act::None);
  return y.defined() ? y : at::linear(x, w, bias);
}

at::Tensor linear_act_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gelu_tanh) {
  TORCH_CHECK(w.size(0) % 2 == 0, "linear_act_mul: weight rows ", w.size(0), " must be even ([gate; up])");
  auto y = try_gemv(x, w, bias, gelu_tanh ? k::Act::GeluTanh : k::Act::Silu);
  return y.defined() ? y : act_mul(at::linear(x, w, bias), gelu_tanh);
}

at::Tensor expert_plan(const at::Tensor& experts, int64_t num_experts) {
  check_cuda(experts, "expert_plan experts");
  TORCH_CHECK(experts.scalar_type() == at::kLong, "expert_plan: expert indices must be int64, got ",
              experts.scalar_type());
  const int64_t P = experts.numel();
  TORCH_CHECK(P >= 1 && P <= k::kExpertPlanMaxPairs, "expert_plan: ", P, " (token, expert) pairs (1 .. ",
              k::kExpertPlanMaxPairs, ")");
  TORCH_CHECK(num_experts >= 1 && num_experts <= k::kExpertPlanMaxExperts, "expert_plan: ", num_experts,
              " experts (1 .. ", k::kExpertPlanMaxExperts, ")");
  c10::cuda::CUDAGuard g(experts.device());
  auto plan = at::empty({k::expert_plan_size(P)}, experts.options().dtype(at::kInt));
  k::launch_expert_plan(experts.data_ptr<int64_t>(), (int)P, (int)num_experts, plan.data_ptr<int>(),
                        at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return plan;
}

at::Tensor expert_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& plan, int64_t P, int64_t x_div,
                         int64_t most_per_expert, bool gated, bool gelu_tanh) {
  auto x = x_in.contiguous();
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.dim() == 3 && w.size(2) == K && (!gated || w.size(1) % 2 == 0), "expert_linear: weights ", w.sizes(),
              " for rows of ", K, gated ? " (gated: [E, 2N, K])" : " ([E, N, K])");
  TORCH_CHECK(plan.is_cuda() && plan.scalar_type() == at::kInt && plan.numel() == k::expert_plan_size(P),
              "expert_linear: plan of ", plan.numel(), " int32 entries for ", P, " pairs");
  if (!(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) || w.scalar_type() != x.scalar_type() ||
      !w.is_contiguous() || !w.is_cuda())
    return {};
  const int64_t N = gated ? w.size(1) / 2 : w.size(1);
  c10::cuda::CUDAGuard g(x.device());
  auto y = at::empty({P, N}, x.options());
  bool launched = false;
  dispatch(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launched = k::launch_expert_gemv<T>(ptr<T>(x), ptr<T>(w), plan.data_ptr<int>(), ptr<T>(y), (int)P, (int)N, (int)K,
                                        (int)x_div, (int)std::min<int64_t>(most_per_expert, P),
                                        gated ? (gelu_tanh ? k::Act::GeluTanh : k::Act::Silu) : k::Act::None,
                                        at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return launched ? y : at::Tensor();
}

bool route_experts(const at::Tensor& h_in, const at::Tensor& scale, const at::Tensor& proj, const at::Tensor& pes,
                   int64_t top_k, double eps, ExpertRoute& out, bool with_plan) {
  auto h = h_in.contiguous();
  check_act(h, "route_experts h");
  const int64_t N = h.size(0), H = h.size(1), E = proj.size(0);
  TORCH_CHECK(h.dim() == 2 && proj.dim() == 2 && proj.size(1) == H && scale.numel() == H && pes.numel() == E,
              "route_experts: h ", h.sizes(), ", scale ", scale.sizes(), ", proj ", proj.sizes(), ", per-expert scale ",
              pes.sizes());
  for (const at::Tensor* t : {&scale, &proj, &pes})
    if (t->scalar_type() != h.scalar_type() || !t->is_contiguous() || !t->is_cuda()) return false;
  c10::cuda::CUDAGuard g(h.device());
  auto logits = at::empty({N, E}, h.options());
  auto weights = at::empty({N, top_k}, h.options().dtype(at::kFloat));
  auto experts = at::empty({N, top_k}, h.options().dtype(at::kLong));
  at::Tensor plan;
  if (with_plan) plan = at::empty({k::expert_plan_size(N * top_k)}, h.options().dtype(at::kInt));
  bool launched = false;
  dispatch(h.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launched = k::launch_router<T>(ptr<T>(h), ptr<T>(scale), ptr<T>(proj), ptr<T>(pes), ptr<T>(logits),
                                   weights.data_ptr<float>(), experts.data_ptr<int64_t>(),
                                   with_plan ? plan.data_ptr<int>() : nullptr, (int)N, (int)E, (int)H, (int)top_k,
                                   (float)eps, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!launched) return false;
  out.weights = weights;
  out.experts = experts;
  out.plan = {experts.flatten(), plan, N};
  return true;
}

std::pair<at::Tensor, at::Tensor> moe_residual(const at::Tensor& h_in, const at::Tensor& f_in, const at::Tensor& y_in,
                                               const at::Tensor& r_in, const MoeNorms& n, const at::Tensor& w_next,
                                               double eps, bool unit_offset, const RowCopy* copy) {
  auto h = h_in.contiguous(), f = f_in.contiguous(), y = y_in.contiguous();
  check_act(h, "moe_residual h");
  TORCH_CHECK(f.sizes() == h.sizes() && f.scalar_type() == h.scalar_type() && y.scalar_type() == h.scalar_type(),
              "moe_residual: h ", h.sizes(), " ", h.scalar_type(), " vs f ", f.sizes(), " ", f.scalar_type(), ", y ",
              y.scalar_type());
  const int64_t H = h.size(-1), rows = h.numel() / H;
  const int64_t K = r_in.defined() ? r_in.size(-1) : 1;
  TORCH_CHECK(y.numel() == rows * K * H, "moe_residual: y ", y.sizes(), " for ", rows, " rows of ", K, " pairs × ", H);
  at::Tensor r;
  if (r_in.defined()) {
    r = r_in.contiguous();
    check_cuda(r, "moe_residual route weights");
    TORCH_CHECK(r.scalar_type() == at::kFloat && r.numel() == rows * K, "moe_residual: route weights ", r.sizes(),
                " ", r.scalar_type(), ", expected [", rows, ", ", K, "] f32");
  }
  check_w(n.dense, H, "moe_residual w_dense");
  check_w(n.experts, H, "moe_residual w_moe");
  check_w(n.ffn, H, "moe_residual w_ffn");
  check_w(w_next, H, "moe_residual w_next");
  if (n.scalar.defined()) {
    check_cuda(n.scalar, "moe_residual layer scalar");
    TORCH_CHECK(n.scalar.numel() == 1 && n.scalar.scalar_type() == h.scalar_type(), "moe_residual: layer scalar ",
                n.scalar.sizes(), " ", n.scalar.scalar_type(), ", expected one ", h.scalar_type());
  }
  TORCH_CHECK(3 * H * 4 <= 48 * 1024, "moe_residual: hidden size ", H, " exceeds the kernel's shared memory");
  c10::cuda::CUDAGuard g(h.device());
  const auto out = residual_step(h, copy, "moe_residual");
  dispatch(h.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    k::launch_moe_residual<T>(ptr<T>(h), ptr<T>(f), ptr<T>(y), r.defined() ? r.data_ptr<float>() : nullptr, (int)K,
                              n.dense.data_ptr<float>(), n.experts.data_ptr<float>(), n.ffn.data_ptr<float>(),
                              n.scalar.defined() ? ptr<T>(n.scalar) : nullptr, w_next.data_ptr<float>(),
                              ptr<T>(out.h_out), ptr<T>(out.y), (int)rows, (int)H, (float)eps, unit_offset,
                              out.copy_dst<T>(copy), out.copy_stride, out.copy_pos, out.copy_rows, out.T_len,
                              at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out.h_out, out.y};
}

}  // namespace kakeya::ops::cuda
