// at::Tensor wrappers of core/kernels/cuda/spec_kernels.cuh (CUDA builds only); infer/fused.cpp
// calls them through core/kernels/ops.h.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/kernels/cuda/spec_kernels.cuh"
#include "core/kernels/cuda/spec_ops.h"

namespace kakeya::ops::cuda {
namespace k = kakeya::kernels;

namespace {
void check_long(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == at::kLong, name,
              ": expected a contiguous CUDA int64 tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(n < 0 || t.numel() == n, name, ": expected ", n, " entries, got ", t.numel());
}
template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
// One row x [.., K] (contiguous) against a head w [N, K] the greedy head kernels take.
bool one_row_head(const at::Tensor& x, const at::Tensor& w) {
  const int64_t K = x.size(-1), N = w.size(0);
  return x.numel() == K && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && w.is_cuda() &&
         w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == 2 && w.size(1) == K &&
         N < (int64_t)1 << 31;
}
}  // namespace

void greedy_accept(const at::Tensor& scores_in, const at::Tensor& block, at::Tensor& report) {
  auto scores = scores_in.contiguous();
  TORCH_CHECK(scores.is_cuda() && scores.dim() == 2, "greedy_accept scores: expected [T, V] on CUDA, got ", scores.sizes());
  TORCH_CHECK(scores.scalar_type() == at::kBFloat16 || scores.scalar_type() == at::kFloat,
              "greedy_accept scores: expected bf16 or f32, got ", scores.scalar_type());
  const int64_t T = scores.size(0), V = scores.size(1);
  check_long(block, T, "greedy_accept block");
  check_long(report, T + 1, "greedy_accept report");
  TORCH_CHECK(V < (int64_t)1 << 31, "greedy_accept: vocabulary of ", V, " exceeds int32 indices");
  c10::cuda::CUDAGuard g(scores.device());
  const int chunks = k::argmax_chunks((int)V);
  auto pval = at::empty({T * chunks}, scores.options().dtype(at::kFloat));
  auto pidx = at::empty({T * chunks}, scores.options().dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (scores.scalar_type() == at::kFloat)
    k::launch_greedy_accept<float>(scores.data_ptr<float>(), block.data_ptr<int64_t>(), report.data_ptr<int64_t>(),
                                   pval.data_ptr<float>(), pidx.data_ptr<int>(), T, V, stream);
  else
    k::launch_greedy_accept<__nv_bfloat16>(ptr<__nv_bfloat16>(scores), block.data_ptr<int64_t>(),
                                           report.data_ptr<int64_t>(), pval.data_ptr<float>(), pidx.data_ptr<int>(), T,
                                           V, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void argmax_rows(const at::Tensor& scores_in, const at::Tensor& map, at::Tensor& out) {
  auto scores = scores_in.contiguous();
  TORCH_CHECK(scores.is_cuda() && (scores.scalar_type() == at::kBFloat16 || scores.scalar_type() == at::kFloat),
              "argmax_rows scores: expected bf16 or f32 on CUDA, got ", scores.scalar_type(), " on ", scores.device());
  const int64_t V = scores.size(-1), rows = scores.numel() / V;
  check_long(out, rows, "argmax_rows out");
  if (map.defined()) check_long(map, V, "argmax_rows map");
  TORCH_CHECK(V < (int64_t)1 << 31, "argmax_rows: ", V, " columns exceed int32 indices");
  c10::cuda::CUDAGuard g(scores.device());
  const int chunks = k::argmax_chunks((int)V);
  auto pval = at::empty({rows * chunks}, scores.options().dtype(at::kFloat));
  auto pidx = at::empty({rows * chunks}, scores.options().dtype(at::kInt));
  const int64_t* m = map.defined() ? map.data_ptr<int64_t>() : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (scores.scalar_type() == at::kFloat)
    k::launch_argmax_rows<float>(scores.data_ptr<float>(), m, out.data_ptr<int64_t>(), pval.data_ptr<float>(),
                                 pidx.data_ptr<int>(), rows, V, stream);
  else
    k::launch_argmax_rows<__nv_bfloat16>(ptr<__nv_bfloat16>(scores), m, out.data_ptr<int64_t>(), pval.data_ptr<float>(),
                                         pidx.data_ptr<int>(), rows, V, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool linear_argmax(const at::Tensor& x_in, const at::Tensor& w, at::Tensor& out) {
  auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = w.size(0);
  if (!one_row_head(x, w)) return false;
  check_long(out, 1, "linear_argmax out");
  c10::cuda::CUDAGuard g(x.device());
  const int blocks = k::gemv_wide_blocks((int)N);
  auto pval = at::empty({blocks}, x.options().dtype(at::kFloat));
  auto pidx = at::empty({blocks}, x.options().dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream();
  bool launched;
  if (x.scalar_type() == at::kFloat)
    launched = k::launch_gemv_argmax<float>(x.data_ptr<float>(), w.data_ptr<float>(), (int)N, (int)K,
                                            pval.data_ptr<float>(), pidx.data_ptr<int>(), out.data_ptr<int64_t>(), stream);
  else
    launched = k::launch_gemv_argmax<__nv_bfloat16>(ptr<__nv_bfloat16>(x), ptr<__nv_bfloat16>(w), (int)N, (int)K,
                                                    pval.data_ptr<float>(), pidx.data_ptr<int>(),
                                                    out.data_ptr<int64_t>(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return launched;
}

bool screened_argmax(const at::Tensor& x_in, const at::Tensor& w, const HeadScreen& scr, at::Tensor& out) {
  auto x = x_in.contiguous();
  const int64_t K = x.size(-1), N = w.size(0);
  // A K the screen kernel does not take (not a multiple of 16, over 4,096) before any block count:
  // ScreenGeometry::blocks divides by its rows a block, 0 there.
  const k::ScreenGeometry geo = k::ScreenGeometry::of((int)K);
  if (!one_row_head(x, w) || geo.G == 0) return false;
  TORCH_CHECK(scr.codes.is_cuda() && scr.codes.scalar_type() == at::kChar && scr.codes.is_contiguous() &&
                  scr.codes.size(0) == N && scr.codes.size(1) == K,
              "screened_argmax: the screen's codes are ", scr.codes.sizes(), " ", scr.codes.scalar_type(),
              ", expected contiguous int8 [", N, ", ", K, "] on the head's device (ops::make_head_screen of it)");
  TORCH_CHECK(scr.scale.numel() == N && scr.err.numel() == N && scr.scale.scalar_type() == at::kFloat &&
                  scr.err.scalar_type() == at::kFloat && scr.summed.numel() == 1 && scr.summed.scalar_type() == at::kInt,
              "screened_argmax: the screen's scale / err / summed do not match a head of ", N, " rows");
  check_long(out, 1, "screened_argmax out");
  c10::cuda::CUDAGuard g(x.device());
  const int b1 = geo.blocks((int)N), b2 = k::screen_pick_blocks((int)N);
  // [N] upper bounds, [b1] lower maxima, [b2] pass 2's maxima; [b2] their indices, then pass 2's done count.
  auto up = at::empty({N + b1 + b2}, x.options().dtype(at::kFloat));
  auto pidx = at::empty({b2 + 1}, x.options().dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream();
  float* u = up.data_ptr<float>();
  int* pi = pidx.data_ptr<int>();
  auto* cnt = reinterpret_cast<unsigned*>(scr.summed.data_ptr<int>());
  auto* done = reinterpret_cast<unsigned*>(pi + b2);
  bool launched;
  if (x.scalar_type() == at::kFloat)
    launched = k::launch_screened_argmax<float>(x.data_ptr<float>(), w.data_ptr<float>(), scr.codes.data_ptr<int8_t>(),
                                                scr.scale.data_ptr<float>(), scr.err.data_ptr<float>(), (int)N, (int)K,
                                                u, u + N, u + N + b1, pi, cnt, done, out.data_ptr<int64_t>(),
                                                stream);
  else
    launched = k::launch_screened_argmax<__nv_bfloat16>(
        ptr<__nv_bfloat16>(x), ptr<__nv_bfloat16>(w), scr.codes.data_ptr<int8_t>(), scr.scale.data_ptr<float>(),
        scr.err.data_ptr<float>(), (int)N, (int)K, u, u + N, u + N + b1, pi, cnt, done, out.data_ptr<int64_t>(),
        stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return launched;
}

void advance_step(const at::Tensor& next, at::Tensor& out, at::Tensor& step, at::Tensor& cur, at::Tensor& pos) {
  check_long(next, 1, "advance_step next");
  check_long(out, -1, "advance_step out");
  check_long(step, 1, "advance_step step");
  check_long(cur, 1, "advance_step cur");
  check_long(pos, 1, "advance_step pos");
  c10::cuda::CUDAGuard g(next.device());
  k::launch_advance_step(next.data_ptr<int64_t>(), out.data_ptr<int64_t>(), out.numel(), step.data_ptr<int64_t>(),
                         cur.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void advance_block(const at::Tensor& report, at::Tensor& block, at::Tensor& pos0, at::Tensor& qpos,
                   const CarriedEmbedding* emb) {
  const int64_t T = qpos.numel();
  check_long(report, T + 1, "advance_block report");
  check_long(block, T, "advance_block block");
  check_long(pos0, 1, "advance_block pos0");
  check_long(qpos, T, "advance_block qpos");
  c10::cuda::CUDAGuard g(report.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  if (!emb) {
    k::launch_advance_block<float>(report.data_ptr<int64_t>(), T, block.data_ptr<int64_t>(), pos0.data_ptr<int64_t>(),
                                   qpos.data_ptr<int64_t>(), nullptr, 1.f, nullptr, 0, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const at::Tensor& t = emb->table;
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous() && emb->out.is_cuda() && emb->out.is_contiguous() &&
                  emb->out.numel() == t.size(1) && emb->out.scalar_type() == t.scalar_type() &&
                  (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat),
              "advance_block: embedding table ", t.sizes(), " ", t.scalar_type(), " and row ", emb->out.sizes(), " ",
              emb->out.scalar_type(), ": expected a contiguous [V, H] bf16/f32 table and a contiguous row of H of its dtype");
  const int H = (int)t.size(1);
  if (t.scalar_type() == at::kFloat)
    k::launch_advance_block<float>(report.data_ptr<int64_t>(), T, block.data_ptr<int64_t>(), pos0.data_ptr<int64_t>(),
                                   qpos.data_ptr<int64_t>(), t.data_ptr<float>(), (float)emb->scale,
                                   emb->out.data_ptr<float>(), H, stream);
  else
    k::launch_advance_block<__nv_bfloat16>(report.data_ptr<int64_t>(), T, block.data_ptr<int64_t>(),
                                           pos0.data_ptr<int64_t>(), qpos.data_ptr<int64_t>(), ptr<__nv_bfloat16>(t),
                                           (float)emb->scale, ptr<__nv_bfloat16>(emb->out), H, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void concat_rows(const std::vector<at::Tensor>& parts, at::Tensor* out, at::Tensor* ring, const at::Tensor& pos) {
  TORCH_CHECK(!parts.empty() && (int)parts.size() <= k::kMaxRowSources, "concat_rows: 1 to ", k::kMaxRowSources,
              " parts, got ", parts.size());
  const at::ScalarType st = parts[0].scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kFloat, "concat_rows: expected bf16 or f32, got ", st);
  const int64_t rows = parts[0].numel() / parts[0].size(-1);
  int64_t F = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p.is_cuda() && p.is_contiguous() && p.scalar_type() == st && p.numel() / p.size(-1) == rows,
                "concat_rows: every part must be a contiguous CUDA ", st, " tensor of ", rows, " rows, got ",
                p.sizes(), " ", p.scalar_type());
    F += p.size(-1);
  }
  auto check_dst = [&](const at::Tensor* d, const char* name, bool exact_rows) {
    if (!d) return;
    TORCH_CHECK(d->is_cuda() && d->is_contiguous() && d->scalar_type() == st && d->size(-1) == F &&
                    (!exact_rows || d->numel() / F == rows),
                "concat_rows ", name, ": expected a contiguous ", st, " [", exact_rows ? std::to_string(rows) : "R",
                ", ", F, "] CUDA tensor, got ", d->sizes(), " ", d->scalar_type());
  };
  check_dst(out, "out", true);
  check_dst(ring, "ring", false);
  if (ring) check_long(pos, rows, "concat_rows positions");
  if (rows == 0 || (!out && !ring)) return;
  c10::cuda::CUDAGuard g(parts[0].device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t* p = ring ? pos.data_ptr<int64_t>() : nullptr;
  const int64_t ring_rows = ring ? ring->numel() / F : 1;
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = 16 / sizeof(T);
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    bool vec = F % V == 0 && (!out || aligned(out->data_ptr())) && (!ring || aligned(ring->data_ptr()));
    k::RowSources<T> src;
    int off = 0;
    for (const auto& t : parts) {
      const int w = (int)t.size(-1);
      vec = vec && w % V == 0 && aligned(t.data_ptr());
      src.src[src.n] = ptr<T>(t);
      src.width[src.n] = w;
      src.offset[src.n++] = off;
      off += w;
    }
    k::launch_concat_rows<T>(src, p, (int)rows, (int)F, out ? ptr<T>(*out) : nullptr, ring ? ptr<T>(*ring) : nullptr,
                             ring_rows, vec, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (st == at::kFloat) run((float*)nullptr);
  else run((__nv_bfloat16*)nullptr);
}

}  // namespace kakeya::ops::cuda
