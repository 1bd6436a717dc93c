// Framework-free CUDA kernels for the decoder's hot path (FlashInfer layering:
// this file knows raw pointers and streams only; core/kernels/cuda/decode_ops.cu wraps
// it for at::Tensor; core/kernels/ops.h is the one declaration the model calls).
//
// Rounding follows HF transformers' op order in the activation dtype T, so a
// fused kernel returns what the unfused LibTorch ops return: every place where
// PyTorch would materialise a T tensor, we round to T (to_t(from_t(...))).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace kakeya::kernels {

template <typename T> __device__ __forceinline__ float from_t(T x);
template <> __device__ __forceinline__ float from_t<float>(float x) { return x; }
template <> __device__ __forceinline__ float from_t<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T to_t(float x);
template <> __device__ __forceinline__ float to_t<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
// Round through T (what storing an intermediate tensor of dtype T does).
template <typename T> __device__ __forceinline__ float rnd(float x) { return from_t<T>(to_t<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum / max over the block; every thread gets the result. `red` holds >= 32 floats.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : (MAX ? -INFINITY : 0.f);
  return MAX ? warp_max(v) : warp_sum(v);
}
__device__ __forceinline__ float block_sum(float v, float* red) { return block_reduce<false>(v, red); }
__device__ __forceinline__ float block_max(float v, float* red) { return block_reduce<true>(v, red); }

// RMSNorm of one value given the row's inverse RMS. Gemma (unit_offset): the
// weight is 1+w folded in f32 and the product is rounded once; Llama/Qwen round
// x̂ to T before multiplying by w.
template <typename T>
__device__ __forceinline__ float norm_value(float x, float inv_rms, float w, bool unit_offset) {
  return unit_offset ? x * inv_rms * w : w * rnd<T>(x * inv_rms);
}

// Gated-MLP activations, with PyTorch's formulas (tanh GELU, SiLU).
enum class Act { None, GeluTanh, Silu };
__device__ __forceinline__ float apply_act(float g, Act act) {
  if (act == Act::GeluTanh) {
    const float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2/pi)
    return 0.5f * g * (1.f + tanhf(kBeta * (g + kKappa * g * g * g)));
  }
  return g / (1.f + __expf(-g));
}

// ---------------------------------------------------------------------------
// Programmatic dependent launch (Hopper). A decode step is ~170 kernels of a few microseconds
// each, and every boundary costs a launch, a ramp-up and a tail in which the GPU idles. Kernels
// here are launched with launch_pdl: the next kernel on the stream may start as soon as every
// block of the one before it has started (pdl_trigger, first thing in each kernel), so its
// blocks sit resident and its launch overlaps the previous kernel's work. Before pdl_wait() a
// kernel reads only what no kernel of the step writes (weights) and writes nothing; pdl_wait()
// returns once the kernel before it has finished and its writes are visible. Every kernel calls
// it on every path before it touches activations: the next kernel's wait covers only its own
// predecessor, so the chain is ordered only if each link waits. Kernels launched with <<<>>>
// (ATen's, and any launched without the attribute) keep full stream order. A failed launch leaves
// its error where cudaGetLastError finds it, as <<<>>> does: the wrappers (decode_ops.cu,
// spec_ops.cu) check after every launch.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The two, for a kernel with nothing to read before its inputs.
__device__ __forceinline__ void pdl_begin() {
  pdl_trigger();
  pdl_wait();
}

// The block a kernel body runs as: the hardware's (a kernel launched on its own), or one task of an
// instruction of the step's persistent kernel (megakernel.cuh), which runs the same bodies. Bodies
// read their block through it, never blockIdx / gridDim.
struct Blk {
  int x, y;  // blockIdx.x, blockIdx.y
  int nx;    // gridDim.x
};
__device__ __forceinline__ Blk hw_blk() { return {(int)blockIdx.x, (int)blockIdx.y, (int)gridDim.x}; }
// True when this block ran a task of the same launch just before this one: the persistent kernel's
// blocks take tasks blockIdx.x, + gridDim.x, ... in turn (a kernel's own block runs one), so what the
// earlier task left in shared memory is still there. For one-dimensional launches only (the residual
// GEMV's): a kernel's own block at blockIdx.y > 0 would count as a later task.
__device__ __forceinline__ bool ran_before(Blk b) { return b.y * b.nx + b.x >= (int)gridDim.x; }

// While a decode step is recorded for the persistent kernel (megakernel.cu: ops::StepProgram) on
// this thread, launch_pdl hands it each launch (kernel, geometry and arguments); true: recorded as
// an instruction, not to be launched; false: launch it now (a kernel the persistent kernel has no
// body for, or too large a grid).
struct StepRecording;
StepRecording* step_recording();
bool record_launch(StepRecording* r, const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   const void* args, size_t bytes);

// A kernel's arguments as one value, laid out alike by the host and the device compiler (the
// persistent kernel reads a recorded launch's arguments from it: apply_pack).
template <typename... P>
struct ArgPack;
template <>
struct ArgPack<> {};
template <typename H, typename... R>
struct ArgPack<H, R...> {
  H head;
  ArgPack<R...> rest;
};
inline ArgPack<> make_pack() { return {}; }
template <typename H, typename... R>
ArgPack<H, R...> make_pack(H h, R... r) {
  return {h, make_pack(r...)};
}
// f(the pack's values...).
template <typename F, typename... Done>
__device__ __forceinline__ void apply_pack(F& f, const ArgPack<>&, const Done&... d) {
  f(d...);
}
template <typename F, typename H, typename... R, typename... Done>
__device__ __forceinline__ void apply_pack(F& f, const ArgPack<H, R...>& p, const Done&... d) {
  apply_pack(f, p.rest, d..., p.head);
}

template <typename... P, typename... A>
void launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A&&... args) {
  if (StepRecording* r = step_recording()) {
    const ArgPack<P...> pack = make_pack(static_cast<P>(args)...);
    if (record_launch(r, reinterpret_cast<const void*>(kernel), grid, block, smem, s, &pack, sizeof pack)) return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

// ---------------------------------------------------------------------------
// A row's Σ v² in the one order every residual-step kernel sums it (so that a GEMV that folds the
// step into its prologue gives the residual kernel's bits): the row in kNormSegs segments of
// norm_seg_len(H) values, segment s summed as one warp sums it (lane l its values s·L + l,
// s·L + l + 32, ... in turn, one FMA each, then warp_sum), and the segments' sums added in order.
// A block of 8 warps then takes a warp a segment and one barrier for the row (the order it
// replaced, a block of H threads' warps, cost a GEMV's prologue two barriers a norm).
constexpr int kNormSegs = 8;
__host__ __device__ inline int norm_seg_len(int H) { return (H + kNormSegs - 1) / kNormSegs; }
// Segment s's sum (every lane of the warp calls it and gets it). v(i): the row's i-th value as f32.
template <typename V>
__device__ __forceinline__ float seg_sumsq(V v, int s, int H) {
  const int L = norm_seg_len(H), b = s * L, e = min(H, b + L);
  float ss = 0.f;
#pragma unroll 4
  for (int i = b + (threadIdx.x & 31); i < e; i += 32) {
    const float a = v(i);
    ss = fmaf(a, a, ss);
  }
  return warp_sum(ss);
}
// The row's sum from its segments' sums red[0 .. kNormSegs).
__device__ __forceinline__ float segs_total(const float* red) {
  float t = red[0];
#pragma unroll
  for (int s = 1; s < kNormSegs; ++s) t += red[s];
  return t;
}
// Every thread of the block calls it: its warps sum the segments into red (a warp a segment, in
// turn when the block has fewer), one barrier, and every thread gets the row's sum. red must not
// be read by an earlier call any more (norm_sumsq's barrier, or an array of its own).
template <typename V>
__device__ __forceinline__ float block_row_sumsq(V v, int H, float* red) {
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int s = warp; s < kNormSegs; s += nwarps) {
    const float p = seg_sumsq(v, s, H);
    if ((threadIdx.x & 31) == 0) red[s] = p;
  }
  __syncthreads();
  return segs_total(red);
}

// out[r, :] = rms_norm(x[r, :]) · w            x, out: [rows, H]; w: [H] f32
template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const float* __restrict__ w, T* __restrict__ out, int H,
                                float eps, bool unit_offset) {
  pdl_begin();
  __shared__ float red[kNormSegs];
  const T* xr = x + (int64_t)blockIdx.x * H;
  T* orow = out + (int64_t)blockIdx.x * H;
  const float inv = rsqrtf(block_row_sumsq([&](int i) { return from_t<T>(xr[i]); }, H, red) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) orow[i] = to_t<T>(norm_value<T>(from_t<T>(xr[i]), inv, w[i], unit_offset));
}

// Threads for a block that norms one row of H values: one per value (up to 1024). A thread's
// values come one loop iteration after another, each waiting on its loads, so a row costs a
// memory round trip per value a thread holds, per pass. Measured (H100, ncu, a decode step of
// Gemma 3 270M, H = 640): the residual step took 6.8 us with 4 values per thread and 4.0 us with
// one; unrolling the 4-value loops did not help (6.7 us); one warp per row holding 20 values in
// registers took 14.8 us. (A 2816-wide row with 256 threads had taken ~10 us.)
__host__ __device__ inline int norm_threads(int H) {
  const int t = (H + 31) / 32 * 32;
  return t < 32 ? 32 : (t > 1024 ? 1024 : t);
}

// Σ v[i]² over a row of H values in shared memory (written by any thread of the block before the
// call), in block_row_sumsq's order; every thread of the block calls it and gets the sum. red:
// kNormSegs floats.
__device__ __forceinline__ float norm_sumsq(const float* v, int H, float* red) {
  __syncthreads();  // v complete; red no longer read by a previous call
  return block_row_sumsq([&](int i) { return v[i]; }, H, red);
}

template <typename T>
void launch_rms_norm(const T* x, const float* w, T* out, int rows, int H, float eps, bool unit_offset, cudaStream_t s) {
  launch_pdl(rms_norm_kernel<T>, rows, norm_threads(H), 0, s, x, w, out, H, eps, unit_offset);
}

// The forward's first rows: h = table[id]·scale in T (at::embedding, then a multiply by the T
// scalar *scale), and x = rms_norm(h)·w with rms_norm_kernel's sums (norm_sumsq: any block size
// gives them). ids: [rows] int64; table: [V, H]; h, x: [rows, H]. Dynamic smem: H floats.
// ids are the step before's output (a decode step's token): a plain pointer, since the persistent
// kernel runs this body after other work of the same launch (megakernel.cuh).
template <typename T>
__device__ __forceinline__ void embed_rms_norm_body(Blk blk, const int64_t* ids, const T* __restrict__ table,
                                                    const T* __restrict__ scale, const float* __restrict__ w,
                                                    T* __restrict__ h, T* __restrict__ x, int H, float eps,
                                                    bool unit_offset) {
  pdl_begin();
  __shared__ float red[32];
  extern __shared__ float hs[];  // [H] the scaled row
  const T* row = table + ids[blk.x] * H;
  const float sc = from_t<T>(scale[0]);
  T* hr = h + (int64_t)blk.x * H;
  T* xr = x + (int64_t)blk.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = rnd<T>(from_t<T>(row[i]) * sc);
    hr[i] = to_t<T>(v);
    hs[i] = v;
  }
  const float inv = rsqrtf(norm_sumsq(hs, H, red) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) xr[i] = to_t<T>(norm_value<T>(hs[i], inv, w[i], unit_offset));
}
template <typename T>
__global__ void embed_rms_norm_kernel(const int64_t* ids, const T* __restrict__ table, const T* __restrict__ scale,
                                      const float* __restrict__ w, T* __restrict__ h, T* __restrict__ x, int H,
                                      float eps, bool unit_offset) {
  embed_rms_norm_body<T>(hw_blk(), ids, table, scale, w, h, x, H, eps, unit_offset);
}

template <typename T>
void launch_embed_rms_norm(const int64_t* ids, const T* table, const T* scale, const float* w, T* h, T* x, int rows,
                           int H, float eps, bool unit_offset, cudaStream_t s) {
  launch_pdl(embed_rms_norm_kernel<T>, rows, norm_threads(H), H * sizeof(float), s, ids, table, scale, w, h, x, H, eps,
             unit_offset);
}

// A KV cache's slot positions at a forward: dst[slot] = p for each position p, slot = p mod ring
// (ring > 0) or p (one block; the positions map to distinct slots).
__device__ __forceinline__ void store_positions_body(Blk, const int64_t* positions, int T, int64_t ring,
                                                     int64_t* __restrict__ dst) {
  pdl_begin();
  for (int i = threadIdx.x; i < T; i += blockDim.x) {
    const int64_t p = positions[i];
    dst[ring > 0 ? p % ring : p] = p;
  }
}
// A template (as argmax_blocks_kernel and advance_step_kernel): decode_ops.cu and megakernel.cu both
// include this header, and a plain kernel defined here would be defined twice.
template <int = 0>
__global__ void store_positions_kernel(const int64_t* positions, int T, int64_t ring, int64_t* __restrict__ dst) {
  store_positions_body(hw_blk(), positions, T, ring, dst);
}

inline void launch_store_positions(const int64_t* positions, int T, int64_t ring, int64_t* dst, cudaStream_t s) {
  launch_pdl(store_positions_kernel<>, 1, 256, 0, s, positions, T, ring, dst);
}

// The end of a residual step, every thread of the block: the new residual hs [H] (f32 values of
// T in shared memory, written by any thread before) written to h_out and, when given, the copy
// row c; the next pre-norm of it to y, summed as norm_sumsq sums. h_out, c, y point at the row.
template <typename T>
__device__ __forceinline__ void store_residual(const float* hs, T* __restrict__ h_out, T* __restrict__ c,
                                               T* __restrict__ y, const float* __restrict__ w_next, int H, float eps,
                                               bool unit_offset, float* red) {
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = hs[i];
    h_out[i] = to_t<T>(v);
    if (c) c[i] = to_t<T>(v);
  }
  const float inv = rsqrtf(norm_sumsq(hs, H, red) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) y[i] = to_t<T>(norm_value<T>(hs[i], inv, w_next[i], unit_offset));
}

// ---------------------------------------------------------------------------
// The residual step of a decoder layer, fused:
//   a = w_post ? rms_norm(x)·w_post : x        (Gemma's post-attention / post-FFN norm)
//   h_out = h + a                              (the residual stream; out of place, since
//                                              tap subscribers may keep the previous h)
//   y = rms_norm(h_out)·w_next                 (the next pre-norm)
// h, x, h_out, y: [rows, H]; w_post (nullable), w_next: [H] f32. Dynamic smem: 2H floats.
// copy (optional): the new residual's rows also go to copy + (pos[row % T] mod copy_rows) ·
// copy_stride (a ring of per-position rows, e.g. the drafter's target features, written
// here instead of by a kernel of its own).
// h, x are the kernels before's outputs: plain pointers (embed_rms_norm_body says why).
template <typename T>
__device__ __forceinline__ void add_rms_norm_body(Blk blk, const T* h, const T* x, const float* __restrict__ w_post,
                                                  const float* __restrict__ w_next, T* __restrict__ h_out,
                                                  T* __restrict__ y, int H, float eps, bool unit_offset,
                                                  T* __restrict__ copy, int64_t copy_stride, const int64_t* copy_pos,
                                                  int64_t copy_rows, int T_len) {
  pdl_begin();
  extern __shared__ float smem[];  // [2H]: x, then the new residual
  float* xs = smem;
  float* hs = smem + H;
  __shared__ float red[32];
  const int64_t base = (int64_t)blk.x * H;
  T* c = copy ? copy + (copy_pos[blk.x % T_len] % copy_rows) * copy_stride : nullptr;
  // Both rows are read up front so their memory latencies overlap.
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    xs[i] = from_t<T>(x[base + i]);
    hs[i] = from_t<T>(h[base + i]);
  }
  const float inv_x = w_post ? rsqrtf(norm_sumsq(xs, H, red) / H + eps) : 1.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float a = w_post ? rnd<T>(norm_value<T>(xs[i], inv_x, w_post[i], unit_offset)) : xs[i];
    hs[i] = rnd<T>(hs[i] + a);
  }
  store_residual<T>(hs, h_out + base, c, y + base, w_next, H, eps, unit_offset, red);
}
template <typename T>
__global__ void add_rms_norm_kernel(const T* h, const T* x, const float* __restrict__ w_post,
                                    const float* __restrict__ w_next, T* __restrict__ h_out, T* __restrict__ y, int H,
                                    float eps, bool unit_offset, T* __restrict__ copy, int64_t copy_stride,
                                    const int64_t* copy_pos, int64_t copy_rows, int T_len) {
  add_rms_norm_body<T>(hw_blk(), h, x, w_post, w_next, h_out, y, H, eps, unit_offset, copy, copy_stride, copy_pos,
                       copy_rows, T_len);
}

template <typename T>
void launch_add_rms_norm(const T* h, const T* x, const float* w_post, const float* w_next, T* h_out, T* y, int rows,
                         int H, float eps, bool unit_offset, T* copy, int64_t copy_stride, const int64_t* copy_pos,
                         int64_t copy_rows, int T_len, cudaStream_t s) {
  launch_pdl(add_rms_norm_kernel<T>, rows, norm_threads(H), 2 * H * sizeof(float), s, h, x, w_post, w_next, h_out, y,
             H, eps, unit_offset, copy, copy_stride, copy_pos, copy_rows, T_len);
}

// ---------------------------------------------------------------------------
// One head of D values (all threads of the block): RMS-normed by w (nullptr: no norm) into
// xs [D] (rounded to T), then RoPE'd into dst with the table rows c, s of its position
// (rotary pairs over the first rot dims, the rest passed through).
template <typename T>
__device__ __forceinline__ void norm_rope_head(const T* __restrict__ src, const float* __restrict__ w,
                                               const T* __restrict__ c, const T* __restrict__ s, T* __restrict__ dst,
                                               int D, int rot, float eps, bool unit_offset, float* xs, float* red) {
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float v = from_t<T>(src[i]);
    ss += v * v;
  }
  float inv = 1.f;
  if (w) inv = rsqrtf(block_sum(ss, red) / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float v = from_t<T>(src[i]);
    xs[i] = w ? rnd<T>(norm_value<T>(v, inv, w[i], unit_offset)) : v;
  }
  __syncthreads();
  const int half = rot / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    // HF: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1]; each product rounded to T.
    float x1 = xs[i], x2 = xs[i + half];
    dst[i] = to_t<T>(rnd<T>(x1 * from_t<T>(c[i])) + rnd<T>(-x2 * from_t<T>(s[i])));
    dst[i + half] = to_t<T>(rnd<T>(x2 * from_t<T>(c[i + half])) + rnd<T>(x1 * from_t<T>(s[i + half])));
  }
  for (int i = rot + threadIdx.x; i < D; i += blockDim.x) dst[i] = to_t<T>(xs[i]);
}

// One K/V head of the position pos into a cache (all threads of the block). k_cache/v_cache:
// this (sequence, head)'s rows, slot-major (slot·D + i), slot = pos mod ring. k (raw) is normed
// by k_w and RoPE'd with the tables cos_t/sin_t [P, rot]; v (raw) is copied, or RMS-normed by
// v_w when given (Gemma 4's v_norm). Positions < sink
// are copied instead from sink_k/sink_v (rows laid out the same, slot = pos mod sink_ring):
// attention sinks keep their exact K/V when a restored region takes them in. The whole block
// takes one branch (one position): no barrier is skipped halfway.
template <typename T>
__device__ __forceinline__ void store_kv_head(const T* __restrict__ k, const T* __restrict__ v,
                                              const float* __restrict__ k_w, const T* __restrict__ cos_t,
                                              const T* __restrict__ sin_t, int64_t pos, T* __restrict__ k_cache,
                                              T* __restrict__ v_cache, int ring, const T* __restrict__ sink_k,
                                              const T* __restrict__ sink_v, int sink, int sink_ring, int D, int rot,
                                              float eps, bool unit_offset, float* xs, float* red,
                                              const float* __restrict__ v_w = nullptr) {
  const int64_t off = (pos % ring) * D;
  if (pos < sink) {
    const int64_t from = (pos % sink_ring) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      k_cache[off + i] = sink_k[from + i];
      v_cache[off + i] = sink_v[from + i];
    }
    return;
  }
  if (v_w) {
    // A norm without rotation (rot 0); its block reduction's barrier orders the reuse of xs below.
    norm_rope_head<T>(v, v_w, cos_t, sin_t, v_cache + off, D, 0, eps, unit_offset, xs, red);
  } else {
    for (int i = threadIdx.x; i < D; i += blockDim.x) v_cache[off + i] = v[i];
  }
  norm_rope_head<T>(k, k_w, cos_t + pos * rot, sin_t + pos * rot, k_cache + off, D, rot, eps, unit_offset, xs, red);
}

// ---------------------------------------------------------------------------
// q/k head norm + RoPE + K/V cache store, one block per (token, head).
//   qkv:  [B·T, Hq·D + 2·Hkv·D]  (the fused projection output, row-major), or [B·T, Hq·D + Hkv·D]
//         when v_from_k (Gemma 4's K=V layers: V is the raw K projection)
//   heads 0..Hq-1 are q heads -> q_out [B·T, Hq, D];
//   heads Hq..Hq+Hkv-1 are k heads -> k_cache[b, h, slot, :], with v copied (v_w: normed) to v_cache.
//   cos, sin: [P, rot] in T (HF casts its tables to the activation dtype).
//   positions: [T] int64 shared by the B rows (pos_bs 0), or [B, T] (pos_bs T: rows that are
//   independent sequences, a batch of sessions); slot = position mod ring (the cache's exact ring: all S slots on
//   plain layers, the first `ring` on restored ones; a restored region when the caller passes
//   its view). k_cache/v_cache element (b, h, slot, i) sits at b·cache_bs + h·cache_hs + slot·D + i.
//   q_w/k_w/v_w: [D] f32 norm weights, nullptr when the family has no such norm.
// Threads: one per rotary pair (rot/2), plus pass-through dims past rot.
// qkv and positions: plain pointers (embed_rms_norm_body says why).
template <typename T>
__device__ __forceinline__ void qk_norm_rope_store_body(Blk blk, const T* qkv, const float* __restrict__ q_w,
                                                        const float* __restrict__ k_w, const float* __restrict__ v_w,
                                                        bool v_from_k, const T* __restrict__ cos_t,
                                                        const T* __restrict__ sin_t, const int64_t* positions,
                                                        T* __restrict__ q_out, T* __restrict__ k_cache,
                                                        T* __restrict__ v_cache, int T_len, int pos_bs, int Hq,
                                                        int Hkv, int D, int rot, int64_t cache_bs, int64_t cache_hs,
                                                        int ring, float eps, bool unit_offset) {
  pdl_begin();
  __shared__ float red[32];
  extern __shared__ float xs[];  // [D] the normed head, rounded to T
  const int n = blk.x;           // token row: b·T + t
  const int head = blk.y;
  const int t = n % T_len, b = n / T_len;
  const int row_w = (Hq + (v_from_k ? 1 : 2) * Hkv) * D;
  const T* src = qkv + (int64_t)n * row_w + (int64_t)head * D;
  const int64_t pos = positions[(int64_t)b * pos_bs + t];
  if (head < Hq) {
    norm_rope_head<T>(src, q_w, cos_t + pos * rot, sin_t + pos * rot, q_out + ((int64_t)n * Hq + head) * D, D, rot,
                      eps, unit_offset, xs, red);
    return;
  }
  const int hk = head - Hq;
  const int64_t base = (int64_t)b * cache_bs + (int64_t)hk * cache_hs;
  const T* v = v_from_k ? src : qkv + (int64_t)n * row_w + (int64_t)(Hq + Hkv + hk) * D;
  store_kv_head<T>(src, v, k_w, cos_t, sin_t, pos, k_cache + base, v_cache + base, ring, nullptr, nullptr, 0, 1, D, rot,
                   eps, unit_offset, xs, red, v_w);
}
template <typename T>
__global__ void qk_norm_rope_store_kernel(const T* qkv, const float* __restrict__ q_w, const float* __restrict__ k_w,
                                          const float* __restrict__ v_w, bool v_from_k, const T* __restrict__ cos_t,
                                          const T* __restrict__ sin_t, const int64_t* positions, T* __restrict__ q_out,
                                          T* __restrict__ k_cache, T* __restrict__ v_cache, int T_len, int pos_bs,
                                          int Hq, int Hkv, int D, int rot, int64_t cache_bs, int64_t cache_hs,
                                          int ring, float eps, bool unit_offset) {
  qk_norm_rope_store_body<T>(hw_blk(), qkv, q_w, k_w, v_w, v_from_k, cos_t, sin_t, positions, q_out, k_cache, v_cache,
                             T_len, pos_bs, Hq, Hkv, D, rot, cache_bs, cache_hs, ring, eps, unit_offset);
}

// Threads for a block that norms and RoPEs one head of D values: one per value, as norm_threads
// (the q/k step of a decode step at D = 256: 4.8 us with 2 values per thread, 4.0 us with one;
// one warp per head with the values in registers took 5.5 us; H100, ncu).
inline int head_threads(int D) { return std::min(1024, D); }

template <typename T>
void launch_qk_norm_rope_store(const T* qkv, const float* q_w, const float* k_w, const float* v_w, bool v_from_k,
                               const T* cos_t, const T* sin_t,
                               const int64_t* positions, int pos_bs, T* q_out, T* k_cache, T* v_cache, int B, int T_len,
                               int Hq, int Hkv, int D, int rot, int64_t cache_bs, int64_t cache_hs, int ring, float eps,
                               bool unit_offset, cudaStream_t s) {
  dim3 grid(B * T_len, Hq + Hkv);
  launch_pdl(qk_norm_rope_store_kernel<T>, grid, head_threads(D), D * sizeof(float), s, qkv, q_w, k_w, v_w, v_from_k,
             cos_t, sin_t, positions, q_out, k_cache, v_cache, T_len, pos_bs, Hq, Hkv, D, rot, cache_bs, cache_hs, ring,
             eps, unit_offset);
}

// ---------------------------------------------------------------------------
// Restoration's store into several layers at once (infer/restored.h: one launch per batch
// instead of one per layer). Per layer (blockIdx.z) a descriptor in device memory, written
// once (the buffers never move), so a launch needs no host work and graphs capture it.
struct RestoreLayerDesc {
  const float* k_w;              // [D] f32 k norm, or nullptr
  const void* cos;               // [P, rot] T
  const void* sin;
  void* k;                       // restored region: element (h, slot, i) at h·head_stride + slot·D + i
  void* v;
  const void* sink_k;            // the layer's exact ring, same strides (nullptr: no sinks)
  const void* sink_v;
  int64_t head_stride;
  int64_t k_src, v_src;          // column of this layer's head 0 in the k/v raw rows
  // A coded region (bits > 0; k and v unused): row (h, slot) at kc + h·code_head_stride +
  // slot·code_bytes, side values at ks + h·side_head_stride + slot·side_halves (v: vc, vs, with
  // v_code_head_stride and v_bits, which differ from K's for a split code).
  void* kc;
  void* vc;
  void* ks;
  void* vs;
  int64_t code_head_stride, v_code_head_stride, side_head_stride;
  int ring, sink_ring, rot, bits, v_bits;
  bool rotated;                  // the code's kind (ops::RowCode): rotated, else affine
  bool uniform;                  // rotated: evenly spaced levels (ruB), else Lloyd-Max ones
};

// ---------------------------------------------------------------------------
// Coded rows (core/kernels/ops.h quantize_rows, whose arithmetic this follows step for step so
// the codes match the reference): groups of 32 values, x ≈ min + scale · c.
__device__ __forceinline__ unsigned code_of(float x, float scale, float mn, int levels) {
  if (!(scale > 0.f)) return 0u;
  const float c = rintf(__fdiv_rn(__fsub_rn(x, mn), scale));
  return (unsigned)fminf(fmaxf(c, 0.f), (float)levels);
}

// One row of D values (a shared-memory copy, already rounded to T) into its codes and side
// values, one thread per group.
template <typename T>
__device__ __forceinline__ void code_row(const T* row, int D, int bits, uint8_t* __restrict__ codes,
                                         __half* __restrict__ side) {
  const int levels = (1 << bits) - 1;
  for (int g = threadIdx.x; g < D / 32; g += blockDim.x) {
    const T* x = row + g * 32;
    float mn = from_t<T>(x[0]), mx = mn;
    for (int i = 1; i < 32; ++i) {
      const float v = from_t<T>(x[i]);
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
    const __half sh = __float2half_rn(__fdiv_rn(__fsub_rn(mx, mn), (float)levels)), mh = __float2half_rn(mn);
    side[2 * g] = sh;
    side[2 * g + 1] = mh;
    const float sf = __half2float(sh), mf = __half2float(mh);
    if (bits == 8) {
      for (int i = 0; i < 32; ++i) codes[g * 32 + i] = (uint8_t)code_of(from_t<T>(x[i]), sf, mf, levels);
    } else if (bits == 6) {  // value i at bits 6i .. 6i + 5 of the group's 24 bytes
      uint32_t acc = 0;
      int nb = 0, o = g * 24;
      for (int i = 0; i < 32; ++i) {
        acc |= code_of(from_t<T>(x[i]), sf, mf, levels) << nb;
        for (nb += 6; nb >= 8; nb -= 8, acc >>= 8) codes[o++] = (uint8_t)acc;
      }
    } else {
      for (int i = 0; i < 32; i += 2)
        codes[(g * 32 + i) / 2] = (uint8_t)(code_of(from_t<T>(x[i]), sf, mf, levels) |
                                            (code_of(from_t<T>(x[i + 1]), sf, mf, levels) << 4));
    }
  }
}

// Rotated codes (core/kernels/ops.h RowKind::Rotated; the reference is ops::quantize_rows).
// The levels of 2 to 5 bits, the same numbers as ops::rotated_levels (in constant memory: a table
// local to a function would be rebuilt on the stack at every lookup): rows 0-3 the N(0,1) Lloyd-Max
// levels, rows 4-7 the evenly spaced ones, ((float)i - 0.5f·(2^bits - 1)) · uniform_step(bits) in float.
static __constant__ float kRotLevels[8][32] = {
    {-1.5104176f, -0.4527800f, 0.4527800f, 1.5104176f},
    {-2.1519457f, -1.3439093f, -0.7560053f, -0.2450942f, 0.2450942f, 0.7560053f, 1.3439093f, 2.1519457f},
    {-2.7325896f, -2.0690172f, -1.6180464f, -1.2562312f, -0.9423405f, -0.6567591f, -0.3880483f, -0.1283950f,
     0.1283950f, 0.3880483f, 0.6567591f, 0.9423405f, 1.2562312f, 1.6180464f, 2.0690172f, 2.7325896f},
    {-3.2607325f, -2.6911196f, -2.3177394f, -2.0287284f, -1.7872332f, -1.5762281f, -1.3863403f, -1.2118044f,
     -1.0487833f, -0.8945651f, -0.7471357f, -0.6049336f, -0.4666995f, -0.3313783f, -0.1980518f, -0.0658897f,
     0.0658897f,  0.1980518f,  0.3313783f,  0.4666995f,  0.6049336f,  0.7471357f,  0.8945651f,  1.0487833f,
     1.2118044f,  1.3863403f,  1.5762281f,  1.7872332f,  2.0287284f,  2.3177394f,  2.6911196f,  3.2607325f},
{-1.4935287237167358f, -0.4978429079055786f, 0.4978429079055786f, 1.4935287237167358f},
{-2.0510623455047607f, -1.4650444984436035f, -0.8790266513824463f, -0.2930088937282562f, 0.2930088937282562f, 0.8790266513824463f, 1.4650444984436035f, 2.0510623455047607f},
{-2.514009714126587f, -2.1788084506988525f, -1.8436070680618286f, -1.5084058046340942f, -1.1732045412063599f, -0.8380032181739807f, -0.5028019547462463f, -0.16760064661502838f, 0.16760064661502838f, 0.5028019547462463f, 0.8380032181739807f, 1.1732045412063599f, 1.5084058046340942f, 1.8436070680618286f, 2.1788084506988525f, 2.514009714126587f},
{-2.916151285171509f, -2.7280125617980957f, -2.5398738384246826f, -2.3517348766326904f, -2.1635961532592773f, -1.9754574298858643f, -1.7873185873031616f, -1.599179744720459f, -1.411041021347046f, -1.2229021787643433f, -1.0347633361816406f, -0.8466246128082275f, -0.6584857702255249f, -0.47034698724746704f, -0.2822082042694092f, -0.09406939893960953f, 0.09406939893960953f, 0.2822082042694092f, 0.47034698724746704f, 0.6584857702255249f, 0.8466246128082275f, 1.0347633361816406f, 1.2229021787643433f, 1.411041021347046f, 1.599179744720459f, 1.7873185873031616f, 1.9754574298858643f, 2.1635961532592773f, 2.3517348766326904f, 2.5398738384246826f, 2.7280125617980957f, 2.916151285171509f}};
// ops::uniform_step: the spacing of the evenly spaced levels.
static __constant__ float kUniformStep[4] = {0.9956858f, 0.5860178f, 0.3352013f, 0.1881388f};
__device__ __forceinline__ const float* rot_levels(int bits, bool uniform) { return kRotLevels[(uniform ? 4 : 0) + bits - 2]; }
__device__ __forceinline__ float rot_level(int bits, int i, bool uniform) { return rot_levels(bits, uniform)[i]; }
__device__ __forceinline__ float rot_sign(int i) { return ((unsigned)i * 0x9E3779B1u) >> 31 ? -1.f : 1.f; }
// 1 / sqrt(D) as the host computes it ((float)(1.0 / std::sqrt((double)D))).
__device__ __forceinline__ float inv_sqrt_dim(int D) { return (float)(1.0 / sqrt((double)D)); }

// H·v / sqrt(D) of a row spread over a warp, lane holding values lane·VPL .. lane·VPL + VPL - 1:
// butterflies within the lane (spans 1 .. VPL/2), then across lanes (spans VPL .. 16·VPL), the
// order ops::fwht uses.
template <int VPL>
__device__ __forceinline__ void warp_fwht(float* v, int lane) {
#pragma unroll
  for (int h = 1; h < VPL; h *= 2)
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (!(i & h)) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
#pragma unroll
  for (int m = 1; m < 32; m *= 2)
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = (lane & m) ? o - v[i] : v[i] + o;
    }
  const float rs = inv_sqrt_dim(VPL * 32);
#pragma unroll
  for (int i = 0; i < VPL; ++i) v[i] *= rs;
}

// One row of D = 32·VPL values (any memory, in T) into its rotated code by one warp, each lane
// holding VPL consecutive values (whose codes are the lane's VPL·bits/8 bytes of the row): no
// barriers. The arithmetic follows ops::quantize_rows step for step (the norm's sum order aside).
// held: when not null, the row is also copied there as it is. mean: when not null, coded is
// row - mean ([D] f32); weight: when not null, that times weight ([D] f32, a weighted code).
template <typename T, int VPL>
__device__ __forceinline__ void warp_rot_code(const T* row, int bits, bool uniform, uint8_t* __restrict__ codes,
                                              float* __restrict__ side, T* held, const float* __restrict__ mean,
                                              const float* __restrict__ weight, int lane) {
  constexpr int D = VPL * 32;
  float v[VPL];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const T x = row[lane * VPL + i];
    if (held) held[lane * VPL + i] = x;
    v[i] = from_t<T>(x);
    if (mean) v[i] -= mean[lane * VPL + i];
    if (weight) v[i] *= weight[lane * VPL + i];
    ss += v[i] * v[i];
    v[i] *= rot_sign(lane * VPL + i);
  }
  const float n = sqrtf(warp_sum(ss));
  warp_fwht<VPL>(v, lane);
  const float inv = n > 0.f ? __fdiv_rn((float)sqrt((double)D), n) : 0.f;
  const int L = 1 << bits;
  uint64_t w = 0;
  float cs = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    // The nearest level: past every midpoint u exceeds (the warp walks the table in step).
    const float u = v[i] * inv;
    int c = 0;
    const float* levels = rot_levels(bits, uniform);
    float lv = levels[0];
    for (int j = 0; j + 1 < L; ++j) {
      const float lo = levels[j], hi = levels[j + 1];
      if (u > 0.5f * (lo + hi)) {
        c = j + 1;
        lv = hi;
      }
    }
    w |= (uint64_t)c << (i * bits);
    cs += lv * lv;
  }
  const float csum = warp_sum(cs);
  const int nb = VPL * bits / 8;
  for (int b = 0; b < nb; ++b) codes[lane * nb + b] = (uint8_t)(w >> (8 * b));
  if (lane == 0) *side = __fdiv_rn(n, sqrtf(csum));
}

// warp_rot_code for a head dim known at run time (64, 128, 256 or 512).
template <typename T>
__device__ __forceinline__ void warp_rot_code_d(const T* row, int D, int bits, bool uniform, uint8_t* codes, float* side,
                                                T* held, const float* mean, const float* weight, int lane) {
  switch (D) {
    case 64: warp_rot_code<T, 2>(row, bits, uniform, codes, side, held, mean, weight, lane); break;
    case 128: warp_rot_code<T, 4>(row, bits, uniform, codes, side, held, mean, weight, lane); break;
    case 256: warp_rot_code<T, 8>(row, bits, uniform, codes, side, held, mean, weight, lane); break;
    default: warp_rot_code<T, 16>(row, bits, uniform, codes, side, held, mean, weight, lane); break;
  }
}

// The VPL levels of a rotated row's lane (g · level, in the rotated frame); lv: the levels in shared memory.
template <int VPL>
__device__ __forceinline__ void load_rotated(const uint8_t* __restrict__ codes, const float* __restrict__ side,
                                             int bits, int lane, const float* lv, float* out) {
  const int nb = VPL * bits / 8;
  const uint8_t* p = codes + lane * nb;
  uint64_t w = 0;
  for (int b = 0; b < nb; ++b) w |= (uint64_t)p[b] << (8 * b);
  const float g = *side;
  const unsigned mask = (1u << bits) - 1u;
#pragma unroll
  for (int i = 0; i < VPL; ++i) out[i] = g * lv[(w >> (i * bits)) & mask];
}

// NB bytes from p (NB-aligned: a row's bytes start at a multiple of its 32- or 128-byte size)
// in one load where the width allows, into b.
template <int NB>
__device__ __forceinline__ void load_bytes(const uint8_t* __restrict__ p, uint8_t* b) {
  if constexpr (NB == 16) *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(p);
  else if constexpr (NB == 8) *reinterpret_cast<uint2*>(b) = *reinterpret_cast<const uint2*>(p);
  else if constexpr (NB == 4) *reinterpret_cast<uint32_t*>(b) = *reinterpret_cast<const uint32_t*>(p);
  else if constexpr (NB == 2) *reinterpret_cast<uint16_t*>(b) = *reinterpret_cast<const uint16_t*>(p);
  else b[0] = p[0];
}

// load_rotated for 4-bit rows: one load of the lane's VPL / 2 code bytes, and one lookup per
// byte in lv2, the levels of both its nibbles (value 2i: byte i's low nibble, as load_rotated).
// The attention kernel is bound by its loads: a row took VPL / 2 byte loads and VPL lookups.
template <int VPL>
__device__ __forceinline__ void load_rotated4(const uint8_t* __restrict__ codes, const float* __restrict__ side,
                                              int lane, const float2* lv2, float* out) {
  alignas(8) uint8_t b[VPL / 2];
  load_bytes<VPL / 2>(codes + lane * (VPL / 2), b);
  const float g = *side;
#pragma unroll
  for (int i = 0; i < VPL / 2; ++i) {
    const float2 t = lv2[b[i]];
    out[2 * i] = g * t.x;
    out[2 * i + 1] = g * t.y;
  }
}

// load_rotated for 5-bit rows of D = 256 (VPL 8): the lane's 5 code bytes (lane·5 .. lane·5 + 4) lie
// in the two aligned 32-bit words from byte (lane·5) & ~3 (a row's 160 bytes start word-aligned, and the
// last lane's bytes end the row), so two word loads and constant shifts replace five byte loads.
__device__ __forceinline__ void load_rotated5(const uint8_t* __restrict__ codes, const float* __restrict__ side, int lane,
                                              const float* lv, float* out) {
  const int b0 = lane * 5;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(codes) + (b0 >> 2);
  const uint64_t x = (((uint64_t)w[1] << 32) | w[0]) >> (8 * (b0 & 3));
  const float g = *side;
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = g * lv[(x >> (5 * i)) & 31u];
}

// load_rotated5 for evenly spaced levels (ru5): value = g·step·(c - 15.5), one multiply-add each.
__device__ __forceinline__ void load_uniform5(const uint8_t* __restrict__ codes, const float* __restrict__ side, int lane,
                                             float* out) {
  const int b0 = lane * 5;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(codes) + (b0 >> 2);
  const uint64_t x = (((uint64_t)w[1] << 32) | w[0]) >> (8 * (b0 & 3));
  const float gs = *side * kUniformStep[3], off = -15.5f * gs;
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = fmaf(gs, (float)((x >> (5 * i)) & 31u), off);
}

// The VPL values lane·VPL .. lane·VPL + VPL - 1 of a coded row (VPL even, within one group):
// one load of the lane's code bytes and one of its group's (scale, min) pair. SIX: the row is in 6
// bits (int6; VPL 4, 8 or 16), else in `bits` = 8 or 4. int6 is a template case, not a third runtime
// one: a third branch in the attention kernel's key loop made int8 regions' decode steps 3.7% slower
// (H200, one lease, exact-int8:64 at 8k: 0.982x -> 0.946x AR).
template <int VPL, bool SIX = false>
__device__ __forceinline__ void load_coded(const uint8_t* __restrict__ codes, const __half* __restrict__ side, int bits,
                                           int lane, float* out) {
  const int d0 = lane * VPL;
  const float2 sm = __half22float2(*reinterpret_cast<const __half2*>(side + 2 * (d0 / 32)));  // (scale, min)
  if constexpr (SIX) {
    // The lane's NB = VPL·6/8 bytes as three loads of NB/3 bytes each (aligned: rows of 32·NB bytes),
    // value i at bits 6i .. 6i + 5 of them.
    static_assert(VPL == 4 || VPL == 8 || VPL == 16, "int6 rows: D = 128, 256 or 512");
    constexpr int NB = VPL * 6 / 8;
    if constexpr (VPL == 16) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(codes + lane * NB);
      const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
      const uint64_t lo = ((uint64_t)w1 << 32) | w0, hi = ((uint64_t)w2 << 16) | (w1 >> 16);  // bits 0..47, 48..95
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        out[i] = sm.y + sm.x * (float)((lo >> (6 * i)) & 63u);
        out[i + 8] = sm.y + sm.x * (float)((hi >> (6 * i)) & 63u);
      }
    } else {
      using U = std::conditional_t<VPL == 8, uint16_t, uint8_t>;
      const U* u = reinterpret_cast<const U*>(codes + lane * NB);
      constexpr int W = 8 * (int)sizeof(U);
      const uint64_t x = (uint64_t)u[0] | ((uint64_t)u[1] << W) | ((uint64_t)u[2] << (2 * W));
#pragma unroll
      for (int i = 0; i < VPL; ++i) out[i] = sm.y + sm.x * (float)((x >> (6 * i)) & 63u);
    }
  } else if (bits == 8) {
    alignas(16) uint8_t b[VPL];
    load_bytes<VPL>(codes + d0, b);
#pragma unroll
    for (int i = 0; i < VPL; ++i) out[i] = sm.y + sm.x * (float)b[i];
  } else {
    alignas(16) uint8_t b[VPL / 2];
    load_bytes<VPL / 2>(codes + d0 / 2, b);
#pragma unroll
    for (int i = 0; i < VPL; i += 2) {
      out[i] = sm.y + sm.x * (float)(b[i / 2] & 15u);
      out[i + 1] = sm.y + sm.x * (float)(b[i / 2] >> 4);
    }
  }
}

// k_raw/v_raw: [N, row] raw rows (row stride `row`); the head h of layer z at column
// desc[z].k_src + h·D (v: v_src). positions: [N]. One block per (position, kv head, layer).
template <typename T>
__global__ void restore_store_kernel(const T* __restrict__ k_raw, const T* __restrict__ v_raw, int64_t k_row,
                                     int64_t v_row, const RestoreLayerDesc* __restrict__ desc,
                                     const int64_t* __restrict__ positions, int D, int sink, float eps,
                                     bool unit_offset) {
  pdl_begin();
  __shared__ float red[32];
  extern __shared__ float xs[];
  const int n = blockIdx.x, h = blockIdx.y;
  const RestoreLayerDesc L = desc[blockIdx.z];
  const int64_t base = (int64_t)h * L.head_stride, pos = positions[n];
  // A coded region: the dense rows go to shared memory (a ring of one slot), then into their codes.
  const bool coded = L.bits > 0;  // the same for the whole block
  T* kr = coded ? reinterpret_cast<T*>(xs + D) : (T*)L.k + base;
  T* vr = coded ? kr + D : (T*)L.v + base;
  store_kv_head<T>(k_raw + (int64_t)n * k_row + L.k_src + (int64_t)h * D,
                   v_raw + (int64_t)n * v_row + L.v_src + (int64_t)h * D, L.k_w, (const T*)L.cos, (const T*)L.sin, pos,
                   kr, vr, coded ? 1 : L.ring, L.sink_k ? (const T*)L.sink_k + base : nullptr,
                   L.sink_v ? (const T*)L.sink_v + base : nullptr, L.sink_k ? sink : 0, L.sink_ring, D, L.rot, eps,
                   unit_offset, xs, red);
  if (!coded) return;
  __syncthreads();
  const int64_t slot = pos % L.ring, cb = (int64_t)D * L.bits / 8;
  uint8_t* kc = (uint8_t*)L.kc + h * L.code_head_stride + slot * cb;
  uint8_t* vc = (uint8_t*)L.vc + h * L.v_code_head_stride + slot * ((int64_t)D * L.v_bits / 8);
  if (L.rotated) {  // warp 0 codes K, warp 1 V
    const int warp = threadIdx.x >> 5;
    if (warp < 2)
      warp_rot_code_d<T>(warp ? vr : kr, D, warp ? L.v_bits : L.bits, L.uniform, warp ? vc : kc,
                         reinterpret_cast<float*>((__half*)(warp ? L.vs : L.ks) + h * L.side_head_stride + slot * 2),
                         (T*)nullptr, nullptr, nullptr, threadIdx.x & 31);
    return;
  }
  const int64_t sh = D / 16;
  code_row<T>(kr, D, L.bits, kc, (__half*)L.ks + h * L.side_head_stride + slot * sh);
  code_row<T>(vr, D, L.bits, vc, (__half*)L.vs + h * L.side_head_stride + slot * sh);
}

template <typename T>
void launch_restore_store(const T* k_raw, const T* v_raw, int64_t k_row, int64_t v_row, const RestoreLayerDesc* desc,
                          int layers, const int64_t* positions, int N, int Hkv, int D, int sink, float eps,
                          bool unit_offset, cudaStream_t s) {
  dim3 grid(N, Hkv, layers);
  // xs [D] f32, then (coded regions) the K and V rows in T.
  // At least two warps: a rotated code takes one per row (K, V).
  launch_pdl(restore_store_kernel<T>, grid, head_threads(D) < 64 ? 64 : head_threads(D),
             D * sizeof(float) + 2 * D * sizeof(T), s, k_raw, v_raw, k_row, v_row, desc, positions, D, sink, eps,
             unit_offset);
}

// Rows of a dense cache into coded rows (ops::code_rows): block (t, h, b) codes the K and V rows
// at slot src[t] of head h into row dst[t], and copies them to slot sink_slot0 + dst[t] when
// dst[t] < sink; src, dst are row b's from b·idx_bs (idx_bs 0: shared by the rows). k, v: [B, Hkv, S, D]
// (strides cache_bs, cache_hs); codes [B, Hkv, R, cb] (V rows in v_bits, which a split code's K rows do not
// share) and side [B, Hkv, R, sh halves], contiguous; km, vm: [B, Hkv, D] f32 means coded rows leave out
// (rotated codes; nullptr: none); kw: [B, Hkv, D] f32 weights of K rows (weighted codes; nullptr:
// none). 64 threads: a rotated code takes a warp per row (K, V).
template <typename T>
__global__ void code_rows_kernel(T* k, T* v, int64_t cache_bs, int64_t cache_hs, const int64_t* __restrict__ src,
                                 const int64_t* __restrict__ dst, int idx_bs, uint8_t* kc, uint8_t* vc, __half* ks, __half* vs,
                                 const float* km, const float* vm, const float* kw, int Hkv, int R, int D, bool rotated,
                                 bool uniform, int bits, int v_bits, int64_t sink, int64_t sink_slot0) {
  pdl_begin();
  extern __shared__ float row_f[];  // affine: the row in T
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  src += (int64_t)b * idx_bs;
  dst += (int64_t)b * idx_bs;
  const int64_t p = dst[t], base = b * cache_bs + h * cache_hs, r = ((int64_t)b * Hkv + h) * R + p;
  const int cb = D * bits / 8;
  if (rotated) {
    const int kv = threadIdx.x >> 5;
    T* x = kv ? v : k;
    const float* mean = kv ? vm : km;
    warp_rot_code_d<T>(x + base + src[t] * D, D, kv ? v_bits : bits, uniform, kv ? vc + r * (D * v_bits / 8) : kc + r * cb,
                       reinterpret_cast<float*>((kv ? vs : ks) + r * 2),
                       p < sink ? x + base + (sink_slot0 + p) * D : nullptr,
                       mean ? mean + ((int64_t)b * Hkv + h) * D : nullptr,
                       !kv && kw ? kw + ((int64_t)b * Hkv + h) * D : nullptr, threadIdx.x & 31);
    return;
  }
  T* row = reinterpret_cast<T*>(row_f);
  for (int kv = 0; kv < 2; ++kv) {
    T* x = (kv ? v : k) + base;
    T* held = p < sink ? x + (sink_slot0 + p) * D : nullptr;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      row[i] = x[src[t] * D + i];
      if (held) held[i] = row[i];
    }
    __syncthreads();
    code_row<T>(row, D, bits, (kv ? vc : kc) + r * cb, (kv ? vs : ks) + r * (D / 16));
    __syncthreads();
  }
}

template <typename T>
void launch_code_rows(T* k, T* v, int64_t cache_bs, int64_t cache_hs, const int64_t* src, const int64_t* dst,
                      int idx_bs, uint8_t* kc, uint8_t* vc, __half* ks, __half* vs, const float* km, const float* vm,
                      const float* kw, int B, int Hkv, int Tn, int R, int D, bool rotated, bool uniform, int bits,
                      int v_bits, int64_t sink, int64_t sink_slot0, cudaStream_t s) {
  dim3 grid(Tn, Hkv, B);
  launch_pdl(code_rows_kernel<T>, grid, 64, rotated ? 0 : D * sizeof(T), s, k, v, cache_bs, cache_hs, src, dst, idx_bs,
             kc, vc, ks, vs, km, vm, kw, Hkv, R, D, rotated, uniform, bits, v_bits, sink, sink_slot0);
}

// Coded rows back to dense ones (ops::dequantize_rows, the reference): one warp per row of
// D = 32·VPL values, lane holding VPL consecutive ones; rotated rows are rotated back in
// registers (warp_fwht, then the signs), as the attention kernel does with its value sum.
template <typename T, int VPL>
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ codes, const __half* __restrict__ side,
                                       int64_t rows, bool rotated, bool uniform, int bits, T* __restrict__ out) {
  pdl_begin();
  constexpr int D = VPL * 32;
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int64_t cb = D * bits / 8;
  float v[VPL];
  if (rotated) {
    load_rotated<VPL>(codes + r * cb, reinterpret_cast<const float*>(side) + r, bits, lane, rot_levels(bits, uniform), v);
    warp_fwht<VPL>(v, lane);
#pragma unroll
    for (int i = 0; i < VPL; ++i) v[i] *= rot_sign(lane * VPL + i);
  } else {
    if constexpr (VPL >= 4) {
      if (bits == 6) load_coded<VPL, true>(codes + r * cb, side + r * 2 * (D / 32), bits, lane, v);
      else load_coded<VPL>(codes + r * cb, side + r * 2 * (D / 32), bits, lane, v);
    } else {
      load_coded<VPL>(codes + r * cb, side + r * 2 * (D / 32), bits, lane, v);
    }
  }
  T* o = out + r * D + lane * VPL;
#pragma unroll
  for (int i = 0; i < VPL; ++i) o[i] = to_t<T>(v[i]);
}

template <typename T>
void launch_dequantize_rows(const uint8_t* codes, const __half* side, int64_t rows, int D, bool rotated, bool uniform,
                            int bits, T* out, cudaStream_t s) {
  constexpr int kWarps = 4;
  const unsigned blocks = (unsigned)((rows + kWarps - 1) / kWarps);
  switch (D) {
    case 64: launch_pdl(dequantize_rows_kernel<T, 2>, blocks, 32 * kWarps, 0, s, codes, side, rows, rotated, uniform, bits, out); break;
    case 128: launch_pdl(dequantize_rows_kernel<T, 4>, blocks, 32 * kWarps, 0, s, codes, side, rows, rotated, uniform, bits, out); break;
    case 256: launch_pdl(dequantize_rows_kernel<T, 8>, blocks, 32 * kWarps, 0, s, codes, side, rows, rotated, uniform, bits, out); break;
    default: launch_pdl(dequantize_rows_kernel<T, 16>, blocks, 32 * kWarps, 0, s, codes, side, rows, rotated, uniform, bits, out); break;
  }
}

// ---------------------------------------------------------------------------
// Decode attention (T queries per sequence: decode steps, verify and drafter
// blocks) over a cache whose slots carry absolute positions (-1 = empty), split
// over the key axis (flash-decoding). Each (sequence, query, head) row is an
// independent one-query problem: blocks are few-token, so re-reading K/V per
// query costs less than the mask tensors and SDPA launches it replaces.
//   q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; slot_pos: [S] shared by the B rows (sp_bs 0) or
//   [B, S] (sp_bs S); q_pos: [T] (qstride 1) or [1] shared by all T queries (qstride 0), the
//   same for every row (qp_bs 0) or per row, [B, T] (qp_bs T): rows that are independent
//   sequences at their own positions (a batch of sessions)
//   partial: [B·T·Hq, chunks, D + 2] f32 (acc, max, sum); out: [B, T, Hq, D]
// Visibility: 0 <= p <= q_pos[t] and (window == 0 or q_pos[t] - p < window), and
// where in_restored != nullptr (restored / coded layers, core/model/kv_cache.h) the slot's
// region must match whether p is recent for the query (q - p < rwin); a coded row holding
// p < code_from is hidden (a coded layer's exact sinks serve those positions); a restored-region
// slot with p >= keep_below (>= 0: a layer that drops its restored positions) is hidden.
// A restored region held as coded rows (ops::CodedSlots): slot j >= ring is row j - ring of
// kc/vc (code_bytes each) with side values ks/vs; the dense k/v then hold the ring's slots only.
// A rotated code's rows are attended in the rotated frame: the query is rotated once per block
// (q·x̂ = rot(q)·(g·c)), the coded slots' value rows summed there and rotated back once at the end.
// A tail (AttnTail): tn more dense, exact slots after the cache's S, row r of tk/tv [B, Hkv, tn, D]
// holding position tpos[r] (a chunk's own keys, attended before the chunk is written to its ring).
struct CodedRegion {
  const uint8_t* kc = nullptr;  // nullptr: no coded region
  const uint8_t* vc = nullptr;
  const __half* ks = nullptr;
  const __half* vs = nullptr;
  const float* km = nullptr;  // rotated codes: [B, Hkv, D] f32 means the rows left out (nullptr: none)
  const float* vm = nullptr;
  const float* kw = nullptr;  // weighted codes: [B, Hkv, D] f32 K weights (rows read as decoded / kw + km)
  int bits = 0, ring = 0, rows = 0;
  int vbits = 0;  // V rows' bits (a split code's differ from K's bits)
  bool rotated = false;
  bool uniform = false;  // rotated: evenly spaced levels (ruB)
};

// Row r of a rotated code of `bits` bits into the lane's VPL values (g · level, the rotated frame);
// lv: the levels, lv2 (4 bits): a byte's two levels, both in shared memory. bits is grid-uniform.
template <int VPL>
__device__ __forceinline__ void load_rotated_row(const uint8_t* __restrict__ codes, const __half* __restrict__ side,
                                                 int64_t r, int bits, bool uniform, int lane, const float* lv,
                                                 const float2* lv2, float* out) {
  constexpr int D = VPL * 32;
  const float* g = reinterpret_cast<const float*>(side) + r;
  if (bits == 4) {
    load_rotated4<VPL>(codes + r * (D / 2), g, lane, lv2, out);
    return;
  }
  if constexpr (VPL == 8) {
    if (bits == 5) {
      if (uniform) load_uniform5(codes + r * (D * 5 / 8), g, lane, out);
      else load_rotated5(codes + r * (D * 5 / 8), g, lane, lv, out);
      return;
    }
  }
  load_rotated<VPL>(codes + r * (D * bits / 8), g, bits, lane, lv, out);
}

constexpr int kAttnWarps = 8;
constexpr int kAttnChunk = 64;  // keys per block where several query rows share the grid (decode_attn_keys)

// Query heads per block: the G query heads of one KV head (grouped-query attention) share every
// key's slot position, row load, decode and visibility test, so each warp's chain of dependent
// loads serves G heads, and a coded row is decoded once for them instead of once per head. Their
// state (q, the rotated q, two accumulators) takes 4·G·VPL registers per lane: G = 4 at D = 256
// holds 230 registers, one block per SM against two at G = 1. That pays where a block's keys serve
// many queries (a prefill chunk's 64, verify blocks), not in a decode step's one: there each warp
// walks one to eight keys and G heads multiply its work (a rotated code's query and value rotations
// most), so a decode step takes G = 1 (decode_attn_group), but over a long history of rotated coded
// rows, whose blocks walk hundreds of keys. kAttnGroupValues bounds G·VPL (16 values of state per lane
// and array).
constexpr int kAttnGroupValues = 32;

// G sums over the warp, their shuffles interleaved (the same order per value as warp_sum).
template <int G>
__device__ __forceinline__ void warp_sums(float* v) {
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int g = 0; g < G; ++g) v[g] += __shfl_xor_sync(0xffffffffu, v[g], o);
}

// One key's softmax step for the G heads of a block: sdot[g] its score for head g, vv its value
// row (lane's VPL values), added into acc (the rotated frame's accr for a rotated coded row: rot_row);
// the other accumulator (and lc) only rescaled.
// The sums are rescaled only when the key raises the running max (sd is warp-uniform: every lane
// holds the same warp sum), which after a block's first keys is rare: a rescale by exp(0) = 1 was
// most keys' work.
template <int G, int VPL>
__device__ __forceinline__ void attn_update(const float* sdot, const float* vv, bool rot, bool rot_row, float softcap,
                                            float* m, float* l, float* lc, float (*acc)[VPL], float (*accr)[VPL]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float sd = sdot[g];
    if (softcap > 0.f) sd = tanhf(sd / softcap) * softcap;
    if (sd > m[g]) {
      const float corr = __expf(m[g] - sd);
      m[g] = sd;
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < VPL; ++i) acc[g][i] *= corr;
      if (rot) {
        lc[g] *= corr;
#pragma unroll
        for (int i = 0; i < VPL; ++i) accr[g][i] *= corr;
      }
    }
    const float pj = __expf(sd - m[g]);
    l[g] += pj;
    if (rot_row) {
      lc[g] += pj;
#pragma unroll
      for (int i = 0; i < VPL; ++i) accr[g][i] = fmaf(pj, vv[i], accr[g][i]);
    } else {
#pragma unroll
      for (int i = 0; i < VPL; ++i) acc[g][i] = fmaf(pj, vv[i], acc[g][i]);
    }
  }
}

// SIX: the coded rows (if any) are int6 ones (load_coded).
// The query, the caches, the slot positions and the tail are written by the kernels before (the
// persistent kernel's same launch): plain pointers (embed_rms_norm_body says why).
template <typename T, int VPL, int G, bool SIX>  // VPL: values per lane = D / 32; G: query heads per block
__device__ __forceinline__ void decode_attn_partial_body(
    Blk blk, const T* q, const T* k, const T* v, const int64_t* slot_pos, int sp_bs, const int64_t* q_pos, int qstride,
    int qp_bs, const bool* in_restored, int rwin, int64_t code_from, int64_t keep_below, CodedRegion cr, const T* tk,
    const T* tv, const int64_t* tpos, int tn, float* __restrict__ partial, int Tq, int Hq, int Hkv, int S, int keys,
    int window, float scale, float softcap) {
  pdl_begin();
  constexpr int D = VPL * 32;
  const int chunk = blk.x, nchunks = blk.nx;
  // The block's first query row (b, t, hq0): rows row0 .. row0 + G - 1 are heads hq0 .. hq0 + G - 1
  // of one (b, t), all reading KV head hk (G divides Hq / Hkv).
  const int row0 = blk.y * G;
  const int b = row0 / (Tq * Hq), t = (row0 / Hq) % Tq, hq0 = row0 % Hq, hk = hq0 / (Hq / Hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t qp = q_pos[(int64_t)b * qp_bs + t * qstride];
  slot_pos += (int64_t)b * sp_bs;
  float qv[G][VPL], acc[G][VPL], qr[G][VPL], accr[G][VPL];  // qr, accr: the rotated frame (rotated codes only)
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      qv[g][i] = from_t<T>(q[(int64_t)(row0 + g) * D + lane * VPL + i]) * scale;
      acc[g][i] = 0.f;
      accr[g][i] = 0.f;
    }
  const bool rot = cr.kc && cr.rotated;  // the same for the whole grid
  __shared__ float lv[2][32];     // the rotated code's levels (up to 5 bits) of K rows, of V rows
  __shared__ float2 lv2[2][256];  // 4-bit codes: the levels of a byte's two values (K, V)
  // Coded rows with means: score q·(x̂ + mean_k) = rot(q)·(g·c) + q·mean_k; value rows add
  // (Σ of their weights)·mean_v once at the end (lc: that sum, rescaled as l is).
  float qmu[G], lc[G], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    qmu[g] = 0.f;
    lc[g] = 0.f;
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  if (rot) {
    if (cr.km) {
      const float* km = cr.km + ((int64_t)b * Hkv + hk) * D + lane * VPL;
#pragma unroll
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < VPL; ++i) qmu[g] += qv[g][i] * km[i];
      warp_sums<G>(qmu);
    }
    // Weighted rows: q·(x̂'/w) = (q/w)·x̂', so the query is divided by the weights before its rotation.
    const float* kw = cr.kw ? cr.kw + ((int64_t)b * Hkv + hk) * D + lane * VPL : nullptr;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < VPL; ++i) qr[g][i] = (kw ? qv[g][i] / kw[i] : qv[g][i]) * rot_sign(lane * VPL + i);
      warp_fwht<VPL>(qr[g], lane);
    }
    for (int kv = 0; kv < 2; ++kv) {
      const int bits = kv ? cr.vbits : cr.bits;
      if (threadIdx.x < (1 << bits)) lv[kv][threadIdx.x] = rot_level(bits, threadIdx.x, cr.uniform);
      if (bits == 4)
        for (int x = threadIdx.x; x < 256; x += blockDim.x)
          lv2[kv][x] = make_float2(rot_level(4, x & 15, cr.uniform), rot_level(4, x >> 4, cr.uniform));
    }
    __syncthreads();
  }
  const int dense = cr.kc ? cr.ring : S;  // slots the dense k/v hold
  const T* kb = k + ((int64_t)b * Hkv + hk) * dense * D;
  const T* vb = v + ((int64_t)b * Hkv + hk) * dense * D;
  const int64_t crow0 = ((int64_t)b * Hkv + hk) * cr.rows;  // this head's first coded row
  const T* tkb = tk + ((int64_t)b * Hkv + hk) * tn * D;     // this head's tail rows (tn 0: none)
  const T* tvb = tv + ((int64_t)b * Hkv + hk) * tn * D;
  const int start = chunk * keys, end = min(S + tn, start + keys);
  for (int j = start + warp; j < end; j += kAttnWarps) {
    // Exact and rotated rows: every load of the key issues before its visibility is known (the
    // addresses depend on j alone), so a warp waits one memory round trip per key, not two (the
    // slot's position, then its row); an invisible slot's row is read for nothing (every slot has
    // one). Affine coded rows (intB regions) load behind the test: loading them early made a
    // sliding layer's step with int4 regions slower (H100, ncu: 6.4 -> 7.1 us), where exact rows
    // gained (full-attention layer at 8k: 21.8 -> 18.1 us; lm4 / pw4 rows 28.8 / 30.2 -> 25.5 / 27.1).
    const bool tail_row = j >= S;  // warp-uniform: an exact key of the tail
    const int64_t p = tail_row ? tpos[j - S] : slot_pos[j];
    const bool restored_slot = !tail_row && in_restored && in_restored[j];
    const bool coded_row = !tail_row && cr.kc && j >= cr.ring;  // warp-uniform
    const int64_t r = crow0 + (j - cr.ring);       // its row, when coded_row
    float kv[VPL], vv[VPL];
    if (coded_row && rot) {
      load_rotated_row<VPL>(cr.kc, cr.ks, r, cr.bits, cr.uniform, lane, lv[0], lv2[0], kv);
      load_rotated_row<VPL>(cr.vc, cr.vs, r, cr.vbits, cr.uniform, lane, lv[1], lv2[1], vv);
    } else if (!coded_row) {
      const T* kr = (tail_row ? tkb + (int64_t)(j - S) * D : kb + (int64_t)j * D) + lane * VPL;
      const T* vr = (tail_row ? tvb + (int64_t)(j - S) * D : vb + (int64_t)j * D) + lane * VPL;
      for (int i = 0; i < VPL; ++i) {
        kv[i] = from_t<T>(kr[i]);
        vv[i] = from_t<T>(vr[i]);
      }
    }
    if (p < 0 || p > qp || (window > 0 && qp - p >= window)) continue;  // warp-uniform
    if (in_restored) {
      const bool recent = qp - p < rwin;
      if (recent == restored_slot) continue;  // the other region holds this query's copy
      if (restored_slot && coded_row && p < code_from) continue;  // an exact sink holds it
      if (restored_slot && keep_below >= 0 && p >= keep_below) continue;  // dropped on this layer
    }
    if (coded_row && !rot) {
      load_coded<VPL, SIX>(cr.kc + r * (D * cr.bits / 8), cr.ks + r * (D / 16), cr.bits, lane, kv);
      load_coded<VPL, SIX>(cr.vc + r * (D * cr.bits / 8), cr.vs + r * (D / 16), cr.bits, lane, vv);
    }
    // A rotated coded row is attended in the rotated frame, with the rotated queries.
    const bool rot_row = rot && coded_row;
    float sdot[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sdot[g] = 0.f;
      if (rot_row)
        for (int i = 0; i < VPL; ++i) sdot[g] += qr[g][i] * kv[i];
      else
        for (int i = 0; i < VPL; ++i) sdot[g] += qv[g][i] * kv[i];
    }
    warp_sums<G>(sdot);
    if (rot_row)
#pragma unroll
      for (int g = 0; g < G; ++g) sdot[g] += qmu[g];
    attn_update<G, VPL>(sdot, vv, rot, rot_row, softcap, m, l, lc, acc, accr);
  }
  if (rot) {  // the coded slots' value sum back from the rotated frame: s ⊙ H·accr / sqrt(D), + lc·mean_v
    const float* vm = cr.vm ? cr.vm + ((int64_t)b * Hkv + hk) * D + lane * VPL : nullptr;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      warp_fwht<VPL>(accr[g], lane);
      for (int i = 0; i < VPL; ++i) acc[g][i] += accr[g][i] * rot_sign(lane * VPL + i) + (vm ? lc[g] * vm[i] : 0.f);
    }
  }
  // Merge the warps of this block, head by head.
  __shared__ float sm[G][kAttnWarps], sl[G][kAttnWarps];
  __shared__ float sacc[G][kAttnWarps][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm[g][warp] = m[g];
      sl[g][warp] = l[g];
    }
    for (int i = 0; i < VPL; ++i) sacc[g][warp][lane * VPL + i] = acc[g][i];
  }
  __syncthreads();
  for (int g = 0; g < G; ++g) {
    float M = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sm[g][w]);
    float* out = partial + ((int64_t)(row0 + g) * nchunks + chunk) * (D + 2);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float a = 0.f;
      for (int w = 0; w < kAttnWarps; ++w) a += sm[g][w] == -INFINITY ? 0.f : sacc[g][w][d] * __expf(sm[g][w] - M);
      out[d] = a;
    }
    if (threadIdx.x == 0) {
      float L = 0.f;
      for (int w = 0; w < kAttnWarps; ++w) L += sm[g][w] == -INFINITY ? 0.f : sl[g][w] * __expf(sm[g][w] - M);
      out[D] = M;
      out[D + 1] = L;
    }
  }
}
template <typename T, int VPL, int G, bool SIX>
__global__ void decode_attn_partial_kernel(const T* q, const T* k, const T* v, const int64_t* slot_pos, int sp_bs,
                                           const int64_t* q_pos, int qstride, int qp_bs, const bool* in_restored,
                                           int rwin, int64_t code_from, int64_t keep_below, CodedRegion cr, const T* tk,
                                           const T* tv, const int64_t* tpos, int tn, float* __restrict__ partial, int Tq,
                                           int Hq, int Hkv, int S, int keys, int window, float scale, float softcap) {
  decode_attn_partial_body<T, VPL, G, SIX>(hw_blk(), q, k, v, slot_pos, sp_bs, q_pos, qstride, qp_bs, in_restored, rwin,
                                           code_from, keep_below, cr, tk, tv, tpos, tn, partial, Tq, Hq, Hkv, S, keys,
                                           window, scale, softcap);
}

// The chunks' (max, sum) pairs are read once, in parallel, and each chunk's weight
// exp(m_c - M) kept in shared memory. Block (row, slice) sums kCombineDims dimensions of one
// query row, its warps taking every kAttnWarps-th chunk (lanes read consecutive dimensions of a
// chunk), then adds the warps' sums: each thread waits on nchunks / kAttnWarps loads, not nchunks.
// (One block per row, a thread per dimension walking every chunk, took 10 us for the 64-72
// chunks of a sliding layer's step with small key blocks: H100, ncu.)
constexpr int kCombineDims = 32;
template <typename T>
__device__ __forceinline__ void decode_attn_combine_body(Blk blk, const float* partial, T* __restrict__ out, int D,
                                                         int nchunks) {
  pdl_begin();
  extern __shared__ float wgt[];  // [nchunks]: exp(m_c - M), 0 for empty chunks
  __shared__ float red[32];
  __shared__ float sums[kAttnWarps][kCombineDims];
  const int bh = blk.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int d = blk.y * kCombineDims + lane;
  const float* p = partial + (int64_t)bh * nchunks * (D + 2);
  float m = -INFINITY;
  for (int c = threadIdx.x; c < nchunks; c += blockDim.x) m = fmaxf(m, p[c * (D + 2) + D]);
  const float M = block_max(m, red);
  float l = 0.f;
  for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
    const float mc = p[c * (D + 2) + D];
    const float w = mc == -INFINITY ? 0.f : __expf(mc - M);
    wgt[c] = w;
    l += w == 0.f ? 0.f : p[c * (D + 2) + D + 1] * w;
  }
  const float L = block_sum(l, red);  // its barriers also publish wgt
  float a = 0.f;
  if (d < D) {
#pragma unroll 4
    for (int c = warp; c < nchunks; c += kAttnWarps) a += p[c * (D + 2) + d] * wgt[c];
  }
  sums[warp][lane] = a;
  __syncthreads();
  if (warp == 0 && d < D) {
    float t = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) t += sums[w][lane];
    out[(int64_t)bh * D + d] = to_t<T>(L > 0.f ? t / L : 0.f);
  }
}
template <typename T>
__global__ void decode_attn_combine_kernel(const float* partial, T* __restrict__ out, int D, int nchunks) {
  decode_attn_combine_body<T>(hw_blk(), partial, out, D, nchunks);
}

// Keys per block. A step's attention is bound by each warp's chain of dependent loads (a key's
// slot position, then its row), not by bandwidth: 64 keys keep the combine's partials few on long
// caches, but a short one with few query rows (a decode step on a sliding layer: 512-640 slots,
// 4 query heads) would fill 32 of the GPU's SMs, each warp walking 8 keys. Such a grid takes
// blocks of 32, 16 or 8 keys while the smaller blocks still fit in one wave: two blocks per SM are
// resident (the partial kernel's registers), and a grid just past that runs a second wave for a few
// blocks. A restored layer's 767 slots (window 256) or 575 (window 64, int4 region) took 8-key
// blocks in 384 / 288 blocks; 16-key blocks, one wave, made the restored decode step 0.945x ->
// 0.973x AR at 8k (window 256) and 0.962x -> 0.983x (window 64; H100, same run). `rows` counts
// blocks of query heads (one sequence's Tq·Hq / G); the bound of 2 blocks per SM was measured at
// G = 1 and kept for G = 4 (one resident block per SM): not re-tuned there.
// A prefill chunk attending over its own keys (64 query rows over ~600 slots: 640 blocks) keeps
// 64-key blocks: blocks grown until the grid filled the SMs once made the 8k restored prefill slower
// (H200, window 64: int4 regions 0.183x -> 0.163x AR, ru5 0.175x -> 0.162x).
// A decode step (Tq 1) over a long cache grows its blocks instead, until the grid fits in one wave:
// every block pays a fixed cost (the query's load; on rotated codes the query's and the value sum's
// rotations, two warp_fwht per warp, and the level tables; the merge of its warps) and then walks
// its keys in a latency-bound chain, so W waves of 8 keys per warp cost W fixed costs, one wave of
// 8·W keys per warp one; the combine reads fewer partials too. (A full-attention layer at 32k:
// 64-key blocks made 2,048 blocks, 8 waves.) H200, Gemma 3 270M bf16, one lease, `bench memory
// --speed`: AR 1,196 -> 1,266 tok/s at 32k (1,517 -> 1,530 at 8k); exact-lm5-codec-pw4:64 968 ->
// 1,037 at 32k. Fetching three keys per warp before decoding any (one memory round trip for the
// three) gained the coded rows a little more at 32k (1,047) but made exact rows slower (AR 1,432 at
// 8k): the compiler copied the kernel's row kinds per key, and the code grew six-fold.
constexpr int kAttnMaxKeys = 4096;
inline int decode_attn_chunks(int S, int keys) { return (S + keys - 1) / keys; }
// A wave is two blocks per SM at G = 1, one at G > 1 (their registers).
inline int decode_attn_keys(int S, int rows, int sms, int Tq, int G) {
  int keys = kAttnChunk;
  while (keys > kAttnWarps && (int64_t)decode_attn_chunks(S, keys / 2) * rows <= 2 * sms) keys /= 2;
  const int wave = G == 1 ? 2 * sms : sms;
  if (Tq == 1)
    while (keys < kAttnMaxKeys && (int64_t)decode_attn_chunks(S, keys) * rows > wave) keys *= 2;
  return keys;
}

// Query heads per block (decode_attn_partial_kernel's G) for Tq queries per sequence of Hq query heads
// over Hkv KV heads of D values: 1 for a decode step (Tq = 1), else the largest of 4, 2, 1 that divides
// Hq / Hkv within kAttnGroupValues; `forced` (> 0) caps it (a measurement's override).
// (H200, Gemma 3 270M bf16, window 64, one lease, `bench memory --speed`, G = 4 -> 1 in decode steps:
// AR 1,418 -> 1,516 tok/s at 8k and 1,192 -> 1,198 at 32k; int4 regions 1,377 -> 1,470 at 8k; ru5
// regions 1,292 -> 1,410 / 1,105 -> 1,132; ru5 regions with pw4 full-attention rows 1,147 -> 1,289 /
// 941 -> 965. G = 2 was the slowest of the three. With G = 1 in the prefill's 64-query chunks as well,
// the 8k restored prefill with ru5 regions fell 0.177x -> 0.160x AR.)
// A decode step over many rotated coded rows (a coded full-attention layer's history: `long_rotated`,
// kAttnGroupCodedRows or more) takes the grouped blocks too: each coded row's decode (its level
// lookups and scaling) then serves the G heads, and their dot products and softmax steps interleave.
// (H200, one lease, G = 4 against KAKEYA_ATTN_GROUP=1, exact-lm5-codec-pw4:64 / exact-int8-codec-pw4:64
// decode: 1,298 / 1,352 against 1,323 / 1,383 tok/s at 8k, 1,230 / 1,289 against 1,219 / 1,270 at 16k,
// 1,116 / 1,157 against 1,050 / 1,089 at 32k: hence the bound between 8k and 16k rows.)
constexpr int kAttnGroupCodedRows = 12288;
inline int decode_attn_group(int Hq, int Hkv, int D, int Tq, bool long_rotated, int forced = 0) {
  if (Tq == 1 && !long_rotated) return 1;
  for (int g : {4, 2, 1})
    if ((Hq / Hkv) % g == 0 && g * (D / 32) <= kAttnGroupValues && (forced <= 0 || g <= forced)) return g;
  return 1;
}

// f(std::false_type), then f(std::true_type): a kernel's bool template cases.
template <typename F>
void for_each_bool(F&& f) {
  f(std::false_type{});
  f(std::true_type{});
}

// Returns false if D is not one of the supported head dims (64, 128, 256, 512) or G is not one
// decode_attn_group gives for D. tk, tv, tpos: the tail's tn rows (tn 0: none); keys:
// decode_attn_keys of S + tn over one sequence's Tq·Hq / G block rows; G: decode_attn_group.
template <typename T>
bool launch_decode_attention(const T* q, const T* k, const T* v, const int64_t* slot_pos, int sp_bs, const int64_t* q_pos,
                             int qstride, int qp_bs, const bool* in_restored, int rwin, int64_t code_from, int64_t keep_below,
                             const CodedRegion& cr, const T* tk, const T* tv, const int64_t* tpos, int tn, float* partial,
                             T* out, int B, int Tq, int Hq, int Hkv, int S, int D, int keys, int G, int window, float scale,
                             float softcap, cudaStream_t s) {
  const int nchunks = decode_attn_chunks(S + tn, keys);
  const dim3 grid(nchunks, B * Tq * Hq / G);
  const int threads = kAttnWarps * 32;
  bool launched = false;
  const bool six = cr.kc && !cr.rotated && cr.bits == 6;
  auto launch = [&](auto vpl, auto g, auto sx) {
    constexpr int VPL = decltype(vpl)::value, GG = decltype(g)::value;
    constexpr bool SIX = decltype(sx)::value;
    if constexpr ((GG * VPL <= kAttnGroupValues || GG == 1) && (!SIX || VPL >= 4)) {
      if (D == VPL * 32 && G == GG && six == SIX) {
        launch_pdl(decode_attn_partial_kernel<T, VPL, GG, SIX>, grid, threads, 0, s, q, k, v, slot_pos, sp_bs, q_pos, qstride, qp_bs, in_restored, rwin,
                   code_from, keep_below, cr, tk, tv, tpos, tn, partial, Tq, Hq, Hkv, S, keys, window, scale, softcap);
        launched = true;
      }
    }
  };
  auto each_group = [&](auto vpl) {
    for_each_bool([&](auto sx) {
      launch(vpl, std::integral_constant<int, 1>{}, sx);
      launch(vpl, std::integral_constant<int, 2>{}, sx);
      launch(vpl, std::integral_constant<int, 4>{}, sx);
    });
  };
  each_group(std::integral_constant<int, 2>{});
  each_group(std::integral_constant<int, 4>{});
  each_group(std::integral_constant<int, 8>{});
  each_group(std::integral_constant<int, 16>{});
  if (!launched) return false;
  const dim3 cgrid(B * Tq * Hq, (D + kCombineDims - 1) / kCombineDims);
  launch_pdl(decode_attn_combine_kernel<T>, cgrid, kAttnWarps * 32, nchunks * sizeof(float), s, partial, out, D, nchunks);
  return true;
}

// ---------------------------------------------------------------------------
// L2 prefetch: the bytes of up to kPrefetchRanges ranges brought into L2 by bulk requests of
// kPrefetchChunk bytes (cp.async.bulk.prefetch, a hint: nothing waits for it), one per thread
// over a grid of single-warp blocks, so the requests start from many SMs at once. Reads no
// activations and writes nothing: it may run beside a step's kernels (ops::prefetch_l2).
constexpr int kPrefetchRanges = 8;
constexpr int64_t kPrefetchChunk = 16 << 10;
struct PrefetchRanges {
  const char* ptr[kPrefetchRanges];
  int64_t bytes[kPrefetchRanges];  // multiples of 16, ptr 16-byte aligned
  int n = 0;
};
static __global__ void prefetch_l2_kernel(PrefetchRanges r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int i = 0; i < r.n; ++i) {
    const int64_t chunks = (r.bytes[i] + kPrefetchChunk - 1) / kPrefetchChunk;
    for (; c < chunks; c += stride) {
      const int64_t off = c * kPrefetchChunk;
      const unsigned size = (unsigned)min(kPrefetchChunk, r.bytes[i] - off);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(r.ptr[i] + off), "r"(size) : "memory");
    }
    c -= chunks;  // the thread's next chunk, counted from the next range
  }
#endif
}
inline void launch_prefetch_l2(const PrefetchRanges& r, cudaStream_t s) {
  int64_t chunks = 0;
  for (int i = 0; i < r.n; ++i) chunks += (r.bytes[i] + kPrefetchChunk - 1) / kPrefetchChunk;
  const int blocks = (int)std::min<int64_t>(64, (chunks + 31) / 32);
  if (blocks > 0) prefetch_l2_kernel<<<blocks, 32, 0, s>>>(r);
}

// ---------------------------------------------------------------------------
// Gated MLP activation: out = act(gate) · up, gu = [gate | up]: [rows, 2I] -> out [rows, I].
// act(gate) is rounded to T before the product, as PyTorch materialises it.
template <typename T>
__global__ void act_mul_kernel(const T* __restrict__ gu, T* __restrict__ out, int64_t rows, int I, Act act) {
  pdl_begin();
  const int64_t n = rows * I;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / I, i = idx % I;
    const float g = from_t<T>(gu[r * 2 * I + i]), u = from_t<T>(gu[r * 2 * I + I + i]);
    out[idx] = to_t<T>(rnd<T>(apply_act(g, act)) * u);
  }
}

template <typename T>
void launch_act_mul(const T* gu, T* out, int64_t rows, int I, Act act, cudaStream_t s) {
  const int64_t n = rows * I;
  const int threads = 256;
  const int blocks = (int)std::min<int64_t>((n + threads - 1) / threads, 4096);
  launch_pdl(act_mul_kernel<T>, blocks, threads, 0, s, gu, out, rows, I, act);
}

// ---------------------------------------------------------------------------
// Matrix-vector product for a decode step: y[n] = Σ_k x[k]·W[n, k] (+ bias[n]), one row of x.
// Batch-1 decode reads every weight once per token, so this is a bandwidth
// kernel: 16-byte vector loads of W, four in flight per lane, x read next to them,
// f32 accumulation, one rounding to T (as cuBLAS). Several rows take mma_gemv_kernel (bf16) or
// cuBLAS: a version of this kernel for up to 8 rows (x staged in shared memory) grew linearly with
// the rows (H100, Gemma 3 270M, one step: 0.46 ms of GEMVs at 1 row, 0.89 at 2, 1.83 at 4; cuBLAS
// ~0.6 ms at 16).
// `wpr` warps share one output row (split K) so small N still fills the GPU.
// Gated mode (the MLP's gate/up pair): W holds [gate; up] ([2N, K]) and the
// warp group computes both rows, writing act(gate)·up rounded as PyTorch does.
//   x: [K]; W: [N or 2N, K] row-major; bias: [N or 2N] or nullptr; y: [N]. K % (16 / sizeof(T)) == 0.
constexpr int kGemvWarps = 8;
constexpr int kGemvUnroll = 4;

template <typename T> struct Vec16;
template <> struct Vec16<float> { static constexpr int n = 4; };
template <> struct Vec16<__nv_bfloat16> { static constexpr int n = 8; };

// R rows of W (w0 + r·stride, the first nrows of them real) against the M rows of x: their loads
// issued together, kGemvUnroll per row in flight per lane, the last group predicated: a row
// shorter than kGemvUnroll steps (an expert's 704 values, Gemma 3's 640) still issues its loads
// together instead of one latency after another. acc: [R, M]; the sum order per lane is k's order.
// x: staged as f32 in shared memory (xs [M, K]), or (XG, one row) read from global memory next
// to the weights (xg [K]): a decode step's block then waits for no staging and no barrier
// before its weight loads, which issue before pdl_wait and so overlap the kernel before it;
// the products are the same.
// One step of a lane's walk: its kGemvUnroll 16-byte loads of R rows at k (predicated: rows past
// nrows, loads past k1), and their products with x at the same k.
template <typename T, int R>
__device__ __forceinline__ void load_rows(uint4 (&raw)[R][kGemvUnroll], const T* __restrict__ w0, int64_t stride,
                                          int nrows, int k, int k1) {
  constexpr int STEP = 32 * Vec16<T>::n;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u)
      raw[r][u] = r < nrows && k + u * STEP < k1 ? *reinterpret_cast<const uint4*>(w0 + r * stride + k + u * STEP)
                                                 : make_uint4(0, 0, 0, 0);
}
// x from xs [M, K] (f32, shared memory), or (xraw given, one row) the loads of x at k.
template <typename T, int M, int R>
__device__ __forceinline__ void fma_rows(const uint4 (&raw)[R][kGemvUnroll], const uint4* xraw,
                                         const float* __restrict__ xs, int K, int k, int k1, float* acc) {
  constexpr int V = Vec16<T>::n;
  constexpr int STEP = 32 * V;
#pragma unroll
  for (int u = 0; u < kGemvUnroll; ++u) {
    if (k + u * STEP >= k1) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const T* e = reinterpret_cast<const T*>(&raw[r][u]);
      if (xraw) {
        const T* xe = reinterpret_cast<const T*>(&xraw[u]);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[r] += from_t<T>(e[i]) * from_t<T>(xe[i]);
      } else {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float* xm = xs + m * K + k + u * STEP;
#pragma unroll
          for (int i = 0; i < V; ++i) acc[r * M + m] += from_t<T>(e[i]) * xm[i];
        }
      }
    }
  }
}

template <typename T, int M, int R, bool XG = false>
__device__ __forceinline__ void dot_rows(const T* __restrict__ w0, int64_t stride, int nrows,
                                         const float* __restrict__ xs, const T* xg, int K, int k0,
                                         int k1, int lane, float* acc) {
  static_assert(!XG || M == 1, "x from global memory: one row");
  constexpr int STEP = 32 * Vec16<T>::n;
  for (int k = k0 + lane * Vec16<T>::n; k < k1; k += kGemvUnroll * STEP) {
    uint4 raw[R][kGemvUnroll];
    load_rows<T, R>(raw, w0, stride, nrows, k, k1);
    if constexpr (XG) {
      // x is the previous kernel's output; the weight loads above are already in flight. xg is
      // not __restrict__: a const __restrict__ pointer's loads compile to ld.global.nc, which may be
      // served or moved as if x never changed while the kernel runs (mma_tiles says where that broke).
      pdl_wait();
      uint4 xraw[kGemvUnroll];
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u)
        xraw[u] = k + u * STEP < k1 ? *reinterpret_cast<const uint4*>(xg + k + u * STEP) : make_uint4(0, 0, 0, 0);
      fma_rows<T, M, R>(raw, xraw, xs, K, k, k1, acc);
    } else {
      fma_rows<T, M, R>(raw, nullptr, xs, K, k, k1, acc);
    }
  }
}

// No prologue (gemv_rows' default): x is ready when the kernel reads it.
struct NoPrologue {
  static constexpr bool active = false;
  __device__ void operator()() const {}
};

// One block's output rows of the GEMV against the M rows of x staged in xs, written to
// out.row(m)[n]. A warp group of `wpr` warps (split K) serves RW consecutive rows n (RW > 1:
// whole rows, wpr 1, not gated), so that a warp has RW rows' loads in flight. Gated: the warp
// reads row n's gate and up rows together. Every thread of the block calls it (it synchronises
// once when wpr > 1); `part` holds the split-K partial sums.
// Pro (active): every thread calls pro() once, before any weight load: it waits for the kernel
// before and fills xs (residual_gemv_kernel). The warp's first weight loads used to issue before
// pro(), to overlap them with the wait; without them the decode step is faster (H200, Gemma 3
// 270M's shape, AR at 512, one binary: 1,902.9 against 1,839.5 tok/s), though a chain of residual
// GEMVs alone is slower (kakeya bench chain, two leases: 4.90 -> 5.21 us a link). In the step a
// residual GEMV follows a GEMV still streaming its weights; that the early loads competed with
// those is a guess, not measured apart.
// bx: the block's index in the GEMV's grid (Blk::x).
template <typename T, int M, int RW, typename Out, bool XG = false, typename Pro = NoPrologue>
__device__ __forceinline__ void gemv_rows(int bx, const float* __restrict__ xs, float* __restrict__ part,
                                          const T* __restrict__ W, const T* __restrict__ bias, int N, int K, int wpr,
                                          Act act, Out out, const T* xg = nullptr, Pro pro = {}) {
  constexpr int V = Vec16<T>::n;
  constexpr int R = RW > 2 ? RW : 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups_per_block = kGemvWarps / wpr;
  const int n = (bx * groups_per_block + warp / wpr) * RW;
  const int part_idx = warp % wpr;
  // This warp's K range, a multiple of the vector width.
  const int kv = K / V, per = (kv + wpr - 1) / wpr;
  const int k0 = min(kv, part_idx * per) * V, k1 = min(kv, (part_idx + 1) * per) * V;
  const bool gated = act != Act::None;
  const int nrows = min(RW, N - n);
  float acc[R * M];
#pragma unroll
  for (int i = 0; i < R * M; ++i) acc[i] = 0.f;
  if constexpr (Pro::active) {
    static_assert(!XG, "a prologue fills xs");
    pro();
  }
  if (n < N) {
    if (gated) dot_rows<T, M, 2, XG>(W + (int64_t)n * K, (int64_t)N * K, 2, xs, xg, K, k0, k1, lane, acc);
    else dot_rows<T, M, RW, XG>(W + (int64_t)n * K, K, nrows, xs, xg, K, k0, k1, lane, acc);
  }
#pragma unroll
  for (int i = 0; i < R * M; ++i) acc[i] = warp_sum(acc[i]);
  if (wpr > 1) {  // RW 1: acc holds [gate or plain; up] × M
    if (lane == 0)
      for (int m = 0; m < M; ++m) {
        part[(warp * 2 + 0) * M + m] = acc[m];
        part[(warp * 2 + 1) * M + m] = acc[M + m];
      }
    __syncthreads();
    for (int m = 0; m < M && part_idx == 0; ++m) {
      float a0 = 0.f, a1 = 0.f;
      for (int p = 0; p < wpr; ++p) {
        a0 += part[((warp + p) * 2 + 0) * M + m];
        a1 += part[((warp + p) * 2 + 1) * M + m];
      }
      acc[m] = a0;
      acc[M + m] = a1;
    }
  }
  if constexpr (XG) pdl_wait();  // a warp without rows or K range has not waited in dot_rows
  if (lane != 0 || n >= N || part_idx != 0) return;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (!gated) {
      for (int r = 0; r < nrows; ++r) out.row(m)[n + r] = to_t<T>(acc[r * M + m] + (bias ? from_t<T>(bias[n + r]) : 0.f));
    } else {
      // The unfused path materialises gate and up in T, then act(gate) in T, then the product.
      const float g = acc[m] + (bias ? from_t<T>(bias[n]) : 0.f);
      const float u = rnd<T>(acc[M + m] + (bias ? from_t<T>(bias[n + N]) : 0.f));
      out.row(m)[n] = to_t<T>(rnd<T>(apply_act(rnd<T>(g), act)) * u);
    }
  }
}

// Output rows of a plain GEMV: y[m, :].
template <typename T>
struct DenseRows {
  T* y;
  int N;
  __device__ T* row(int m) const { return y + (int64_t)m * N; }
};

// RW rows per warp (RW > 1: whole rows, not gated): a vocabulary's lm_head has rows of a few
// hundred values, so one row per warp keeps too few loads in flight per lane.
template <typename T, int RW>
__device__ __forceinline__ void gemv_body(Blk blk, const T* x, const T* __restrict__ W, const T* __restrict__ bias,
                                          T* __restrict__ y, int N, int K, int wpr, Act act) {
  pdl_trigger();  // its weights load before pdl_wait (dot_rows)
  extern __shared__ float xs[];  // [kGemvWarps, 2] partial sums
  gemv_rows<T, 1, RW, DenseRows<T>, true>(blk.x, nullptr, xs, W, bias, N, K, wpr, act, DenseRows<T>{y, N}, x);
}
template <typename T, int RW>
__global__ void gemv_kernel(const T* x, const T* __restrict__ W, const T* __restrict__ bias, T* __restrict__ y, int N,
                            int K, int wpr, Act act) {
  gemv_body<T, RW>(hw_blk(), x, W, bias, y, N, K, wpr, act);
}
// The same GEMV held to 64 registers, so that 4 blocks fit an SM (the plain kernel's 66 allow 3):
// launch_gemv takes it for grids the plain kernel cannot hold in one wave, where more blocks in
// flight keep more weight loads in flight. Grids that fit are faster plain. H200, random weights,
// AR at 512, one lease (tok/s; plain everywhere / capped everywhere / this rule):
//   Gemma 3 270M (every grid 320-384 blocks): 1,950.5 / 1,933 (another lease) / plain everywhere;
//   Gemma 3 1B (gate/up 864 blocks capped; q/k/v 384, o and down 288 plain): 781.4 / 792.2 / 799.0;
//   Llama 3.2 1B (every grid 512-1,024 blocks): 791.0 / 810.2 / capped everywhere.
template <typename T, int RW>
__global__ void __launch_bounds__(kGemvWarps * 32, 4)
    gemv_capped_kernel(const T* x, const T* __restrict__ W, const T* __restrict__ bias, T* __restrict__ y, int N,
                       int K, int wpr, Act act) {
  gemv_body<T, RW>(hw_blk(), x, W, bias, y, N, K, wpr, act);
}

// Blocks of Kernel (threads, smem bytes a block) resident on one SM, as the runtime counts them
// from its registers and shared memory: asked once per kernel.
template <auto Kernel>
int resident_blocks(int threads, size_t smem) {
  static const int n = [&] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, threads, smem) != cudaSuccess) {
      (void)cudaGetLastError();
      b = 1;
    }
    return std::max(b, 1);
  }();
  return n;
}

// Warps that share one output row (split K): enough warps in flight to cover memory latency
// when the rows are few.
inline int gemv_split(int N) { return N >= 4096 ? 1 : (N >= 1024 ? 2 : 4); }
// From this many output rows (a vocabulary) a warp takes kGemvWideRowsPerWarp whole rows
// (gemv_kernel's RW; the greedy lm_head's gemv_argmax_kernel too), in gemv_wide_blocks(N) blocks.
constexpr int kGemvWideRows = 16384;
constexpr int kGemvWideRowsPerWarp = 4;
inline int gemv_wide_blocks(int N) {
  return (N + kGemvWarps * kGemvWideRowsPerWarp - 1) / (kGemvWarps * kGemvWideRowsPerWarp);
}

// Returns false when the shape is not for this kernel (more than one row of x, a K or address
// the vector loads cannot take): the caller falls back to cuBLAS.
// N: output columns (for gated mode, W has 2N rows). sms: the device's multiprocessors.
template <typename T>
bool launch_gemv(const T* x, const T* W, const T* bias, T* y, int M, int N, int K, Act act, int sms, cudaStream_t s) {
  if (M != 1 || K % Vec16<T>::n != 0) return false;
  if (reinterpret_cast<uintptr_t>(W) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  const int wpr = gemv_split(N);
  if (wpr == 1 && act == Act::None && N >= kGemvWideRows) {
    launch_pdl(gemv_kernel<T, kGemvWideRowsPerWarp>, gemv_wide_blocks(N), kGemvWarps * 32,
               kGemvWarps * 2 * sizeof(float), s, x, W, bias, y, N, K, wpr, act);
    return true;
  }
  const int rows_per_block = kGemvWarps / wpr;
  const int blocks = (N + rows_per_block - 1) / rows_per_block;
  const int threads = kGemvWarps * 32;
  const size_t smem = kGemvWarps * 2 * sizeof(float);
  const bool capped = blocks > resident_blocks<gemv_kernel<T, 1>>(threads, smem) * sms;
  launch_pdl(capped ? gemv_capped_kernel<T, 1> : gemv_kernel<T, 1>, blocks, threads, smem, s, x, W, bias, y, N, K, wpr,
             act);
  return true;
}

// ---------------------------------------------------------------------------
// A few rows at once (a verify block, a drafter block, a batch of sessions): y = x · Wᵀ for 2 ..
// kMmaRows rows of x through the tensor cores (bf16 only). The CUDA-core GEMV does M multiply-adds
// per weight it loads, which made it grow linearly with the rows (see gemv_kernel); one
// mma.m16n8k16 takes 16 rows × 8 weight rows × 16 values in one instruction, so a block of 16 rows
// reads each weight once at about the one-row kernel's cost, where cuBLAS gives these shapes a
// handful of thread blocks and no early launch.
// Work: a warp takes G·8 consecutive weight rows (a tile; gated: the 8 gate rows and their 8 up
// rows) over its share of K (split K over `wpr` warps of one block, summed in warp order through
// shared memory: deterministic). K runs in chunks of 32 values: lane (g = lane / 4, t = lane % 4)
// loads 16 bytes of weight row g and of x rows g and g + 8 at k = 8t .. 8t + 7, and two mma
// instructions take them. The dot product does not care in which order k is walked, so each mma
// gets its k positions permuted the same way for x and W: the first takes k 8t .. 8t + 3 of each
// lane (as the fragment's k = 2t, 2t + 1, 2t + 8, 2t + 9), the second 8t + 4 .. 8t + 7, and every
// load stays one 16-byte vector.
//   x: [M, K] (rows past M read as zeros); W: [N or 2N, K]; bias: [N or 2N] or nullptr; y: [M, N].
//   K % 8 == 0, x and W 16-byte aligned.
constexpr int kMmaRows = 16;
constexpr int kMmaUnroll = 4;  // chunks of 32 values in flight per lane

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// G weight tiles of 8 rows (tile j: rows n + j·tile_stride + g) against x, chunks c0 .. c1 of 32
// values; acc[j]: the tile's C fragment (rows g and g + 8 of x, weight rows 2t, 2t + 1 of the tile).
// x is not __restrict__: through a const __restrict__ pointer its loads compiled to ld.global.nc,
// whose data must not change while the kernel runs, and under programmatic dependent launch the
// kernel before writes x while this one runs (to pdl_wait): on the H200 every verify block then
// went wrong while the isolated kernel, its x written long before, tested right.
template <int G>
__device__ __forceinline__ void mma_tiles(const __nv_bfloat16* x, int M, const __nv_bfloat16* __restrict__ W,
                                          int64_t tile_stride, int n, int N, int K, int c0, int c1,
                                          float (&acc)[G][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool row_ok = n + g < N;
  const __nv_bfloat16* wr[G];
#pragma unroll
  for (int j = 0; j < G; ++j) wr[j] = W + ((int64_t)j * tile_stride + n + g) * K;
  const __nv_bfloat16* xlo = x + (int64_t)g * K;
  const __nv_bfloat16* xhi = x + (int64_t)(g + 8) * K;
  bool waited = false;
  for (int c = c0; c < c1; c += kMmaUnroll) {
    uint4 b[G][kMmaUnroll], alo[kMmaUnroll], ahi[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = (c + u) * 32 + 8 * t;
      const bool ok = c + u < c1 && k < K;
#pragma unroll
      for (int j = 0; j < G; ++j)
        b[j][u] = ok && row_ok ? *reinterpret_cast<const uint4*>(wr[j] + k) : make_uint4(0, 0, 0, 0);
    }
    // x is the previous kernel's output: the first weight loads above are already in flight.
    if (!waited) {
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = (c + u) * 32 + 8 * t;
      const bool ok = c + u < c1 && k < K;
      alo[u] = ok && g < M ? *reinterpret_cast<const uint4*>(xlo + k) : make_uint4(0, 0, 0, 0);
      ahi[u] = ok && g + 8 < M ? *reinterpret_cast<const uint4*>(xhi + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u)
#pragma unroll
      for (int j = 0; j < G; ++j) {
        mma_bf16(acc[j], alo[u].x, ahi[u].x, alo[u].y, ahi[u].y, b[j][u].x, b[j][u].y);
        mma_bf16(acc[j], alo[u].z, ahi[u].z, alo[u].w, ahi[u].w, b[j][u].z, b[j][u].w);
      }
  }
  if (!waited) pdl_wait();  // a warp without a K range
}

// One block: kGemvWarps / wpr tiles, wpr warps each (split K). Gated (act != None): W = [gate; up]
// and y = act(gate)·up, rounded as the unfused path rounds (gemv_rows' epilogue).
template <bool GATED>
__global__ void __launch_bounds__(kGemvWarps * 32)
    mma_gemv_kernel(const __nv_bfloat16* x, const __nv_bfloat16* __restrict__ W,
                    const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ y, int M, int N, int K,
                    int wpr, Act act) {
  using T = __nv_bfloat16;
  pdl_trigger();  // its first weight loads issue before pdl_wait (mma_tiles)
  constexpr int G = GATED ? 2 : 1;
  __shared__ float part[kGemvWarps][G][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n = (blockIdx.x * (kGemvWarps / wpr) + warp / wpr) * 8;
  const int part_idx = warp % wpr;
  const int chunks = (K + 31) / 32, per = (chunks + wpr - 1) / wpr;
  const int c0 = min(chunks, part_idx * per), c1 = min(chunks, (part_idx + 1) * per);
  float acc[G][4] = {};
  if (n < N) mma_tiles<G>(x, M, W, N, n, N, K, c0, c1, acc);
  else pdl_wait();
  if (wpr > 1) {
#pragma unroll
    for (int j = 0; j < G; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[warp][j][i][lane] = acc[j][i];
    __syncthreads();
    if (part_idx != 0) return;
#pragma unroll
    for (int j = 0; j < G; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = 0.f;
        for (int p = 0; p < wpr; ++p) s += part[warp + p][j][i][lane];
        acc[j][i] = s;
      }
  }
  if (n >= N) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = g + (i >> 1) * 8, col = n + 2 * t + (i & 1);
    if (m >= M || col >= N) continue;
    if constexpr (!GATED) {
      y[(int64_t)m * N + col] = to_t<T>(acc[0][i] + (bias ? from_t<T>(bias[col]) : 0.f));
    } else {
      const float gv = acc[0][i] + (bias ? from_t<T>(bias[col]) : 0.f);
      const float uv = rnd<T>(acc[1][i] + (bias ? from_t<T>(bias[col + N]) : 0.f));
      y[(int64_t)m * N + col] = to_t<T>(rnd<T>(apply_act(rnd<T>(gv), act)) * uv);
    }
  }
}

// Whether M rows of x against N weight rows of K values suit the kernel: 2 .. kMmaRows rows, K a
// multiple of the 16-byte loads, N below a vocabulary (cuBLAS reads those at the copy bandwidth).
inline bool mma_gemv_fits(int64_t M, int64_t N, int64_t K) {
  return M >= 2 && M <= kMmaRows && K % 8 == 0 && N < kGemvWideRows;
}

// False when the shape (mma_gemv_fits) or an address is not for this kernel.
inline bool launch_mma_gemv(const __nv_bfloat16* x, const __nv_bfloat16* W, const __nv_bfloat16* bias,
                            __nv_bfloat16* y, int M, int N, int K, Act act, cudaStream_t s) {
  if (!mma_gemv_fits(M, N, K)) return false;
  if (reinterpret_cast<uintptr_t>(W) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  // Split K until the grid covers the GPU (~128 blocks), while every warp keeps a chunk.
  const int tiles = (N + 7) / 8, chunks = (K + 31) / 32;
  int wpr = 1;
  while (wpr < kGemvWarps && 2 * wpr <= chunks && (tiles * wpr + kGemvWarps - 1) / kGemvWarps < 128) wpr *= 2;
  const int tiles_per_block = kGemvWarps / wpr;
  const dim3 grid((tiles + tiles_per_block - 1) / tiles_per_block);
  if (act == Act::None)
    launch_pdl(mma_gemv_kernel<false>, grid, kGemvWarps * 32, 0, s, x, W, bias, y, M, N, K, wpr, act);
  else
    launch_pdl(mma_gemv_kernel<true>, grid, kGemvWarps * 32, 0, s, x, W, bias, y, M, N, K, wpr, act);
  return true;
}

// ---------------------------------------------------------------------------
// A thread's values of the row (up to kResidualPer: lane l of warp w holds w·L + l + 32u, L =
// norm_seg_len(K)), held in registers so that each of the prologue's reads is one batch of
// independent loads (a loop that stores each load before the next waited one L2 round trip per
// value a thread holds). Each norm is one barrier: a warp sums its segment, the block's 8 sums go
// through shared memory. Every warp computing the whole step alone, with no barrier, was 40% slower
// (AR 1,960 -> 1,183 tok/s: 8x the prologue's instructions in every block;
// bench/results/2026-12-04-residual-fold-h200.json).
// Rows of more than 1,024 values take the two kernels: a prologue of 8 values a thread made the
// steps of wider models slower, every block of the GEMV redoing a longer residual step (H200, random
// weights, AR at 512, one binary: Gemma 3 1B's 1,152 788.1 -> 746.0 tok/s, Llama 3.2 1B's 2,048
// 787.3 -> 727.0; kakeya bench chain's q/k/v link 5.25 -> 6.48 and 7.85 -> 12.47 us).
constexpr int kResidualPer = 4;
template <typename T>
struct ResidualPrologue {
  static constexpr bool active = true;
  const T *h, *x;  // the kernels before's outputs: plain pointers (embed_rms_norm_body says why)
  const float *w_post, *w_next;
  T* h_out;
  float *xs, *red;  // xs: [K] the pre-norm; red: [2·kNormSegs] the two norms' segment sums
  int K;
  float eps;
  bool unit_offset;
  int bx;  // the block's index in the GEMV's grid: block 0 writes h'
  bool again;  // xs already holds the pre-norm: the block's earlier task of this launch computed it
  __device__ void operator()() const {
    if (again) return;  // block-uniform, so the barriers below are skipped by every thread alike
    // Warp w holds segment w of the row (block_row_sumsq's order): lane l its values w·L + l + 32u.
    static_assert(kGemvWarps == kNormSegs, "a warp a segment");
    constexpr int P = kResidualPer;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int L = norm_seg_len(K), b = warp * L, e = min(K, b + L);
    float wp[P], wn[P], xv[P], hv[P];
#pragma unroll
    for (int u = 0; u < P; ++u) {  // weights: read before the wait
      const int i = b + lane + 32 * u;
      wp[u] = w_post && i < e ? w_post[i] : 0.f;
      wn[u] = i < e ? w_next[i] : 0.f;
    }
    pdl_wait();
#pragma unroll
    for (int u = 0; u < P; ++u) {
      const int i = b + lane + 32 * u;
      xv[u] = i < e ? from_t<T>(x[i]) : 0.f;
      hv[u] = i < e ? from_t<T>(h[i]) : 0.f;
    }
    float inv_x = 1.f;
    if (w_post) {  // block-uniform
      float ss = 0.f;
#pragma unroll
      for (int u = 0; u < P; ++u) ss = fmaf(xv[u], xv[u], ss);  // zeros past the segment add nothing
      ss = warp_sum(ss);
      if (lane == 0) red[warp] = ss;
      __syncthreads();
      inv_x = rsqrtf(segs_total(red) / K + eps);
    }
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < P; ++u) {
      const float a = w_post ? rnd<T>(norm_value<T>(xv[u], inv_x, wp[u], unit_offset)) : xv[u];
      hv[u] = rnd<T>(hv[u] + a);
      ss = fmaf(hv[u], hv[u], ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) red[kNormSegs + warp] = ss;  // its own array: red[0 ..) may still be read
    __syncthreads();
    const float inv = rsqrtf(segs_total(red + kNormSegs) / K + eps);
#pragma unroll
    for (int u = 0; u < P; ++u) {
      const int i = b + lane + 32 * u;
      if (i >= e) continue;
      if (bx == 0) h_out[i] = to_t<T>(hv[u]);
      xs[i] = rnd<T>(norm_value<T>(hv[u], inv, wn[u], unit_offset));
    }
    __syncthreads();
  }
};

// A layer's residual step (add_rms_norm_kernel's) as the prologue of the GEMV that reads its
// pre-norm: y = W · rms_norm(h + rms_norm(x)·w_post)·w_next for one row, h' = h + ... also
// written (block 0). A residual step alone is one block doing a few microseconds of latency-bound
// work between two bandwidth-bound GEMVs; here every block of the GEMV recomputes it from the two
// rows of H = K values (L2 hits; a persistent block that ran an earlier task of the same launch
// keeps that task's result: ran_before), with the residual kernel's roundings and sums
// (block_row_sumsq's order) (gemv_rows' prologue), and the GEMV reads the pre-norm from shared memory.
//   h, x, h_out: [K]; w_post (nullable), w_next: [K] f32; W: [N or 2N, K]; y: [N].
// Dynamic smem: (K + kGemvWarps·2) floats.
// At most 64 registers, so that 4 blocks fit an SM (80 without the cap: 3), and a 512-block GEMV
// is resident in one wave while the kernel before it runs (H200: AR decode 1,762 -> 1,833 tok/s).
template <typename T>
__device__ __forceinline__ void residual_gemv_body(Blk blk, const T* h, const T* x, const float* __restrict__ w_post,
                                                   const float* __restrict__ w_next, T* __restrict__ h_out,
                                                   const T* __restrict__ W, const T* __restrict__ bias,
                                                   T* __restrict__ y, int N, int K, int wpr, Act act, float eps,
                                                   bool unit_offset) {
  pdl_trigger();  // the next kernel's blocks may start as this one's finish; the prologue waits
  extern __shared__ float smem[];  // [K] the pre-norm; [kGemvWarps·2] partial sums
  __shared__ float red[2 * kNormSegs];
  const ResidualPrologue<T> pro{h, x, w_post, w_next, h_out, smem, red, K, eps, unit_offset, blk.x, ran_before(blk)};
  gemv_rows<T, 1, 1, DenseRows<T>, false, ResidualPrologue<T>>(blk.x, smem, smem + K, W, bias, N, K, wpr, act,
                                                               DenseRows<T>{y, N}, nullptr, pro);
}
template <typename T>
__global__ void __launch_bounds__(kGemvWarps * 32, 4)
    residual_gemv_kernel(const T* h, const T* x, const float* __restrict__ w_post, const float* __restrict__ w_next,
                         T* __restrict__ h_out, const T* __restrict__ W, const T* __restrict__ bias,
                         T* __restrict__ y, int N, int K, int wpr, Act act, float eps, bool unit_offset) {
  residual_gemv_body<T>(hw_blk(), h, x, w_post, w_next, h_out, W, bias, y, N, K, wpr, act, eps, unit_offset);
}

// False when the shape is not for the kernel (as launch_gemv's, or a row of more values than the
// prologue's registers hold: kResidualPer a thread).
template <typename T>
bool launch_residual_gemv(const T* h, const T* x, const float* w_post, const float* w_next, T* h_out, const T* W,
                          const T* bias, T* y, int N, int K, Act act, float eps, bool unit_offset, cudaStream_t s) {
  const size_t smem = ((size_t)K + kGemvWarps * 2) * sizeof(float);
  if (K % Vec16<T>::n != 0 || K > kResidualPer * kGemvWarps * 32 || reinterpret_cast<uintptr_t>(W) % 16 != 0)
    return false;
  const int wpr = gemv_split(N);
  const int rows_per_block = kGemvWarps / wpr;
  launch_pdl(residual_gemv_kernel<T>, dim3((N + rows_per_block - 1) / rows_per_block), kGemvWarps * 32, smem, s, h, x,
             w_post, w_next, h_out, W, bias, y, N, K, wpr, act, eps, unit_offset);
  return true;
}

// ---------------------------------------------------------------------------
// Routed experts for a few tokens (a decode step, a verify block): pair p is (token p / top_k,
// its (p % top_k)-th expert). The plan groups the pairs by expert, so that one block of the
// expert GEMV reads a selected expert's rows once for all the pairs routed to it, and nothing
// of the experts no pair selected. Built on the device from the router's indices: no host sync.
//   plan (int32, expert_plan_size(P) = 3P + 2 entries): [0] U, the distinct experts; then
//   group_expert[P] (ascending expert id), group_start[P + 1], pairs[P] (pair ids by group,
//   ascending within a group).
constexpr int kExpertPlanMaxPairs = 1024;
constexpr int kExpertPlanMaxExperts = 4096;
__host__ __device__ inline int64_t expert_plan_size(int64_t P) { return 1 + 3 * P + 1; }

// Builds the plan of the P pairs whose experts are ex (all threads of one block; visible to the
// block after its barrier). ex: the experts in shared memory (read many times: P per pair);
// sm: 2E ints of shared memory.
__device__ __forceinline__ void build_expert_plan(const int* ex, int P, int E, int* __restrict__ plan, int* sm) {
  int* count = sm;
  int* group_of = sm + E;
  int* group_expert = plan + 1;
  int* group_start = plan + 1 + P;
  int* pairs = plan + 2 + 2 * P;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&count[ex[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int U = 0, start = 0;
    for (int e = 0; e < E; ++e) {
      if (count[e] == 0) continue;
      group_of[e] = U;
      group_expert[U] = e;
      group_start[U] = start;
      start += count[e];
      ++U;
    }
    group_start[U] = start;
    plan[0] = U;
    // The group starts, kept in shared memory for the pass below (count is free again).
    for (int u = 0; u < U; ++u) count[u] = group_start[u];
  }
  __syncthreads();
  // A pair's place in its group: the pairs before it with the same expert (P is small).
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = ex[p];
    int slot = 0;
    for (int q = 0; q < p; ++q) slot += ex[q] == e;
    pairs[count[group_of[e]] + slot] = p;
  }
  __syncthreads();
}

static __global__ void expert_plan_kernel(const int64_t* __restrict__ experts, int P, int E, int* __restrict__ plan) {
  pdl_begin();
  extern __shared__ int sm[];  // count[E], group_of[E], ex[P]
  int* ex = sm + 2 * E;
  for (int p = threadIdx.x; p < P; p += blockDim.x) ex[p] = (int)experts[p];
  __syncthreads();
  build_expert_plan(ex, P, E, plan, sm);
}

inline void launch_expert_plan(const int64_t* experts, int P, int E, int* plan, cudaStream_t s) {
  launch_pdl(expert_plan_kernel, 1, 256, (2 * E + P) * sizeof(int), s, experts, P, E, plan);
}

// Output rows of the expert GEMV: y[pairs[b + m], :].
template <typename T>
struct PairRows {
  T* y;
  const int* pairs;
  int N;
  __device__ T* row(int m) const { return y + (int64_t)pairs[m] * N; }
};

// gemv_rows for a run-time row count m in 1 .. RMAX. Every instantiation is compiled into the
// caller's kernel, whose registers are the largest case's: a kernel that only ever sees one row
// (a decode step) is instantiated with RMAX 1 and keeps its occupancy.
template <typename T, int RMAX, int RW, typename Out>
__device__ __forceinline__ void gemv_rows_upto(int m, const float* __restrict__ xs, float* __restrict__ part,
                                               const T* __restrict__ W, const T* __restrict__ bias, int N, int K,
                                               int wpr, Act act, Out out) {
  if constexpr (RMAX > 1) {
    if (m < RMAX) return gemv_rows_upto<T, RMAX - 1, RW>(m, xs, part, W, bias, N, K, wpr, act, out);
  }
  gemv_rows<T, RMAX, RW>(blockIdx.x, xs, part, W, bias, N, K, wpr, act, out);
}

constexpr int kExpertRowsPerWarp = 4;

// The rows per pass a kernel is compiled for: the next of 1, 2, 4, 8 at or above `most`.
inline int rows_bucket(int most) { return most <= 1 ? 1 : most <= 2 ? 2 : most <= 4 ? 4 : 8; }

// y[p] = W[expert(p)] · x[p / x_div] for every pair p ([P, N]); gated: W[e] is [gate; up]
// ([2N, K]) and y[p] = act(gate)·up, as the GEMV. Grid (row blocks, P): block y = g serves
// the g-th distinct expert (blocks past U return), its pairs `rows` (<= RMAX) at a time. Whole
// rows per warp (no split K): the pairs' experts give the grid its width, and a warp streaming
// whole rows keeps more loads in flight than split parts; RW rows per warp when not gated (a
// gated warp reads its gate and up rows together).
//   x: [P / x_div, K]; W: [E, N or 2N, K]; y: [P, N]
template <typename T, int RMAX, int RW>
__global__ void expert_gemv_kernel(const T* __restrict__ x, const T* __restrict__ W, const int* __restrict__ plan,
                                   T* __restrict__ y, int P, int N, int K, int x_div, int rows, Act act) {
  pdl_begin();
  const int g = blockIdx.y;
  if (g >= plan[0]) return;  // uniform over the block
  extern __shared__ float xs[];  // [rows, K], then [kGemvWarps, 2, rows] partial sums
  const int e = plan[1 + g];
  const int* group_start = plan + 1 + P;
  const int* pairs = plan + 2 + 2 * P;
  const T* We = W + (int64_t)e * (act != Act::None ? 2 * N : N) * K;
  if constexpr (RMAX == 1) {  // a decode step: each pass one pair, its x row read from global memory
    for (int b = group_start[g], end = group_start[g + 1]; b < end; ++b)
      gemv_rows<T, 1, RW, PairRows<T>, true>(blockIdx.x, nullptr, xs, We, nullptr, N, K, /*wpr=*/1, act,
                                             PairRows<T>{y, pairs + b, N}, x + (int64_t)(pairs[b] / x_div) * K);
  } else {
    for (int b = group_start[g], end = group_start[g + 1]; b < end; b += rows) {
      const int m_cnt = min(rows, end - b);
      for (int i = threadIdx.x; i < m_cnt * K; i += blockDim.x)
        xs[i] = from_t<T>(x[(int64_t)(pairs[b + i / K] / x_div) * K + i % K]);
      __syncthreads();
      gemv_rows_upto<T, RMAX, RW>(m_cnt, xs, xs + m_cnt * K, We, nullptr, N, K, /*wpr=*/1, act,
                                  PairRows<T>{y, pairs + b, N});
      __syncthreads();  // xs and part are reused by the next rows of this group
    }
  }
}

// Returns false when the shape is not for this kernel (the caller gathers the experts instead).
// most_per_expert: the most pairs one expert can get (the tokens, whose experts are distinct); it
// picks the compiled rows per pass, larger groups take several passes.
template <typename T>
bool launch_expert_gemv(const T* x, const T* W, const int* plan, T* y, int P, int N, int K, int x_div,
                        int most_per_expert, Act act, cudaStream_t s) {
  if (P < 1 || P > kExpertPlanMaxPairs || K % Vec16<T>::n != 0 || reinterpret_cast<uintptr_t>(W) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(x) % 16 != 0)
    return false;
  // As many pairs per pass as fit the default 48 KiB of shared memory, up to the GEMV's 8.
  const int64_t per_row = (int64_t)K * sizeof(float) + kGemvWarps * 2 * sizeof(float);
  const int rmax = rows_bucket(most_per_expert);
  const int rows = (int)std::min<int64_t>(rmax, 48 * 1024 / per_row);
  if (rows < 1) return false;
  // Four rows per warp when not gated (an expert's down rows are short: 704 values on the 26B
  // shape), one gated row (its gate and up rows) otherwise.
  const int rw = act == Act::None ? kExpertRowsPerWarp : 1;
  const dim3 grid((N + kGemvWarps * rw - 1) / (kGemvWarps * rw), P);
  const size_t smem = rmax == 1 ? 0 : rows * per_row;  // one-row passes read x from global memory
#define KAKEYA_EXPERT_LAUNCH(R, RWC) \
  launch_pdl(expert_gemv_kernel<T, R, RWC>, grid, kGemvWarps * 32, smem, s, x, W, plan, y, P, N, K, x_div, rows, act)
#define KAKEYA_EXPERT_CASE(R)                                   \
  case R:                                                       \
    if (rw == 1) KAKEYA_EXPERT_LAUNCH(R, 1);                    \
    else KAKEYA_EXPERT_LAUNCH(R, kExpertRowsPerWarp);           \
    break;
  switch (rmax) { KAKEYA_EXPERT_CASE(1) KAKEYA_EXPERT_CASE(2) KAKEYA_EXPERT_CASE(4) KAKEYA_EXPERT_CASE(8) }
#undef KAKEYA_EXPERT_CASE
#undef KAKEYA_EXPERT_LAUNCH
  return true;
}

// ---------------------------------------------------------------------------
// Gemma 4's router for a few tokens, in two launches.
// Scores: x̂ = rnd(rnd(rnd(rms_norm(h)) · scale) · c) (the weight-free norm, then × scale and
// × c = H^-0.5, each rounded to T as the reference's ops in the model dtype), and
// logits[t, e] = x̂ · proj[e], rounded to T (what the linear returns). A warp per expert row,
// 8 per block; every block norms the token rows itself (H values each, little next to the
// rows of proj it reads), `rows` (<= RMAX) tokens per pass.
//   h: [N, H]; scale: [H]; proj: [E, H]; logits: [N, E]
template <typename T, int RMAX>
__global__ void router_logits_kernel(const T* __restrict__ h, const T* __restrict__ scale, const T* __restrict__ proj,
                                     T* __restrict__ logits, int N, int E, int H, float c, float eps, int rows) {
  pdl_begin();
  extern __shared__ float xs[];  // [rows, H], then [kGemvWarps, 2, rows] partial sums
  __shared__ float red[32];
  for (int b = 0; b < N; b += rows) {
    const int m_cnt = min(rows, N - b);
    for (int m = 0; m < m_cnt; ++m) {
      const T* hr = h + (int64_t)(b + m) * H;
      float* xr = xs + m * H;
      float ss = 0.f;
      for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = from_t<T>(hr[i]);
        xr[i] = v;
        ss += v * v;
      }
      const float inv = rsqrtf(block_sum(ss, red) / H + eps);
      for (int i = threadIdx.x; i < H; i += blockDim.x)
        xr[i] = rnd<T>(rnd<T>(rnd<T>(xr[i] * inv) * from_t<T>(scale[i])) * c);
    }
    __syncthreads();
    gemv_rows_upto<T, RMAX, 1>(m_cnt, xs, xs + m_cnt * H, proj, nullptr, E, H, /*wpr=*/1, Act::None,
                               DenseRows<T>{logits + (int64_t)b * E, E});
    __syncthreads();  // xs is reused by the next pass
  }
}

// Top-k: p = softmax(logits[t]) in f32, the top_k largest (the first of equal values), their p
// renormalised to sum 1 and × per_expert_scale[e] -> weights [N, top_k] f32, experts [N, top_k]
// int64 (descending p, as topk). A warp per token; then, with `plan`, the same block builds the
// pairs' plan (build_expert_plan), so routing a decode step is two launches and no host sync.
//   logits: [N, E]; pes: [E]; top_k <= 32
template <typename T>
__global__ void router_topk_kernel(const T* __restrict__ logits, const T* __restrict__ pes, int N, int E, int top_k,
                                   float* __restrict__ weights, int64_t* __restrict__ experts, int* __restrict__ plan) {
  pdl_begin();
  extern __shared__ float xs[];  // [warps, E] probabilities (then the plan's 2E ints), ex [N·top_k]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int* ex = reinterpret_cast<int*>(xs) + max(nwarps * E, 2 * E);  // the experts, for the plan
  float* p = xs + warp * E;
  for (int t = warp; t < N; t += nwarps) {
    const T* lr = logits + (int64_t)t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, from_t<T>(lr[e]));
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) {
      const float v = expf(from_t<T>(lr[e]) - mx);
      p[e] = v;
      sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) p[e] /= sum;
    __syncwarp();
    float top_sum = 0.f, mine = 0.f;
    int mine_e = 0;
    for (int k = 0; k < top_k; ++k) {
      float bv = -INFINITY;
      int be = E;
      for (int e = lane; e < E; e += 32)
        if (p[e] > bv) bv = p[e], be = e;  // ascending e: a lane keeps its first maximum
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
      }
      top_sum += bv;
      if (lane == k) mine = bv, mine_e = be;
      __syncwarp();
      if (lane == 0) p[be] = -INFINITY;
      __syncwarp();
    }
    if (lane < top_k) {
      weights[(int64_t)t * top_k + lane] = mine / top_sum * from_t<T>(pes[mine_e]);
      experts[(int64_t)t * top_k + lane] = mine_e;
      if (plan) ex[t * top_k + lane] = mine_e;
    }
  }
  if (!plan) return;
  __syncthreads();  // ex is complete; the probabilities' memory is free again
  build_expert_plan(ex, N * top_k, E, plan, reinterpret_cast<int*>(xs));
}

// Tokens the router kernels take: decode steps and verify blocks. A prefill's scores are a GEMM
// (the scores kernel's few blocks would take its tokens a few at a time).
constexpr int kRouterMaxTokens = 32;

// Returns false when the shape is not for these kernels (the caller takes the reference ops).
template <typename T>
bool launch_router(const T* h, const T* scale, const T* proj, const T* pes, T* logits, float* weights,
                   int64_t* experts, int* plan, int N, int E, int H, int top_k, float eps, cudaStream_t s) {
  if (N < 1 || N > kRouterMaxTokens || top_k < 1 || top_k > 32 || top_k > E || H % Vec16<T>::n != 0 ||
      reinterpret_cast<uintptr_t>(proj) % 16 != 0 || (plan && (N * top_k > kExpertPlanMaxPairs || E > kExpertPlanMaxExperts)))
    return false;
  const int64_t per_row = (int64_t)H * sizeof(float) + kGemvWarps * 2 * sizeof(float);
  const int rmax = rows_bucket(N);
  const int rows = (int)std::min<int64_t>(rmax, 48 * 1024 / per_row);
  const int warps = std::min(N, 8);
  const size_t topk_smem = (std::max<size_t>((size_t)warps * E, 2 * (size_t)E) + (size_t)N * top_k) * sizeof(int);
  if (rows < 1 || topk_smem > 48 * 1024) return false;
  const dim3 grid((E + kGemvWarps - 1) / kGemvWarps);
  const float c = (float)(1.0 / std::sqrt((double)H));
  switch (rmax) {
#define KAKEYA_ROUTER_CASE(R)                                                                                       \
  case R:                                                                                                          \
    launch_pdl(router_logits_kernel<T, R>, grid, kGemvWarps * 32, rows * per_row, s, h, scale, proj, logits, N, E, H, c, eps, \
                                                                             rows);                                \
    break;
    KAKEYA_ROUTER_CASE(1) KAKEYA_ROUTER_CASE(2) KAKEYA_ROUTER_CASE(4) KAKEYA_ROUTER_CASE(8)
#undef KAKEYA_ROUTER_CASE
  }
  launch_pdl(router_topk_kernel<T>, 1, warps * 32, topk_smem, s, logits, pes, N, E, top_k, weights, experts, plan);
  return true;
}

// ---------------------------------------------------------------------------
// Gemma 4's MoE layer end, one block per token row (the dense branch f, the experts' pair
// rows y with their route weights r, the residual h):
//   m  = rnd(Σ_k rnd(y[t·K + k] · r[t, k]))          (K = 1 with r null: m = y[t], already summed)
//   f' = rnd(rnd(norm(f)·w_dense) + rnd(norm(m)·w_moe))
//   h' = rnd(h + rnd(norm(f')·w_ffn)), then × the layer scalar s[0] rounded (s null: none)
//   x  = norm(h')·w_next                                (the next pre-norm)
// f, h, h_out, x_out: [rows, H]; y: [rows·K, H]; r: [rows, K] f32; norm weights [H] f32.
// copy as add_rms_norm_kernel's (h' rows into a ring of per-position rows). Dynamic smem: 3H floats.
template <typename T>
__global__ void moe_residual_kernel(const T* __restrict__ h, const T* __restrict__ f, const T* __restrict__ y,
                                    const float* __restrict__ r, int K, const float* __restrict__ w_dense,
                                    const float* __restrict__ w_moe, const float* __restrict__ w_ffn,
                                    const T* __restrict__ s, const float* __restrict__ w_next, T* __restrict__ h_out,
                                    T* __restrict__ x_out, int H, float eps, bool unit_offset, T* __restrict__ copy,
                                    int64_t copy_stride, const int64_t* __restrict__ copy_pos, int64_t copy_rows,
                                    int T_len) {
  pdl_begin();
  extern __shared__ float smem[];  // [3H]: f, m, h
  float* fs = smem;
  float* ms = smem + H;
  float* hs = smem + 2 * H;
  __shared__ float red[32];
  const int64_t t = blockIdx.x, base = t * H;
  T* c = copy ? copy + (copy_pos[t % T_len] % copy_rows) * copy_stride : nullptr;
  // Every input row is read up front so their memory latencies overlap.
  float ss_f = 0.f, ss_m = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float fv = from_t<T>(f[base + i]);
    float mv;
    if (r) {
      mv = 0.f;
      // Unrolled: the pairs' loads are independent and issue together (a runtime loop waited
      // for each load in turn: top 8 was 32 round trips per thread).
#pragma unroll 8
      for (int k = 0; k < K; ++k) mv += rnd<T>(from_t<T>(y[(t * K + k) * H + i]) * r[t * K + k]);
      mv = rnd<T>(mv);
    } else {
      mv = from_t<T>(y[base + i]);
    }
    fs[i] = fv;
    ms[i] = mv;
    hs[i] = from_t<T>(h[base + i]);
    ss_f += fv * fv;
    ss_m += mv * mv;
  }
  const float inv_f = rsqrtf(block_sum(ss_f, red) / H + eps);
  const float inv_m = rsqrtf(block_sum(ss_m, red) / H + eps);
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = rnd<T>(rnd<T>(norm_value<T>(fs[i], inv_f, w_dense[i], unit_offset)) +
                           rnd<T>(norm_value<T>(ms[i], inv_m, w_moe[i], unit_offset)));
    fs[i] = v;
    ss += v * v;
  }
  const float inv_2 = rsqrtf(block_sum(ss, red) / H + eps);
  const float scalar = s ? from_t<T>(s[0]) : 1.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = rnd<T>(hs[i] + rnd<T>(norm_value<T>(fs[i], inv_2, w_ffn[i], unit_offset)));
    hs[i] = s ? rnd<T>(v * scalar) : v;
  }
  store_residual<T>(hs, h_out + base, c, x_out + base, w_next, H, eps, unit_offset, red);
}

template <typename T>
void launch_moe_residual(const T* h, const T* f, const T* y, const float* r, int K, const float* w_dense,
                         const float* w_moe, const float* w_ffn, const T* s, const float* w_next, T* h_out, T* x_out,
                         int rows, int H, float eps, bool unit_offset, T* copy, int64_t copy_stride,
                         const int64_t* copy_pos, int64_t copy_rows, int T_len, cudaStream_t st) {
  launch_pdl(moe_residual_kernel<T>, rows, norm_threads(H), 3 * H * sizeof(float), st, h, f, y, r, K, w_dense, w_moe,
             w_ffn, s, w_next, h_out, x_out, H, eps, unit_offset, copy, copy_stride, copy_pos, copy_rows, T_len);
}

}  // namespace kakeya::kernels
