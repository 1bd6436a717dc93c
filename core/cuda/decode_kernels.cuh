// Framework-free CUDA kernels for the decoder's hot path (FlashInfer layering:
// this file knows raw pointers and streams only; core/cuda/decode_ops.cu wraps
// it for at::Tensor; core/ops.h is the one declaration the model calls).
//
// Rounding follows HF transformers' op order in the activation dtype T, so a
// fused kernel returns what the unfused LibTorch ops return: every place where
// PyTorch would materialise a T tensor, we round to T (to_t(from_t(...))).
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

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
// Sum over the block; every thread gets the result. `red` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : 0.f;
  return warp_sum(v);
}

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
// out[r, :] = rms_norm(x[r, :]) · w            x, out: [rows, H]; w: [H] f32
template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const float* __restrict__ w, T* __restrict__ out, int H,
                                float eps, bool unit_offset) {
  __shared__ float red[32];
  const T* xr = x + (int64_t)blockIdx.x * H;
  T* orow = out + (int64_t)blockIdx.x * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float v = from_t<T>(xr[i]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) orow[i] = to_t<T>(norm_value<T>(from_t<T>(xr[i]), inv, w[i], unit_offset));
}

template <typename T>
void launch_rms_norm(const T* x, const float* w, T* out, int rows, int H, float eps, bool unit_offset, cudaStream_t s) {
  rms_norm_kernel<T><<<rows, 256, 0, s>>>(x, w, out, H, eps, unit_offset);
}

// ---------------------------------------------------------------------------
// The residual step of a decoder layer, fused:
//   a = w_post ? rms_norm(x)·w_post : x        (Gemma's post-attention / post-FFN norm)
//   h_out = h + a                              (the residual stream; out of place, since
//                                              tap subscribers may keep the previous h)
//   y = rms_norm(h_out)·w_next                 (the next pre-norm)
// h, x, h_out, y: [rows, H]; w_post (nullable), w_next: [H] f32. Dynamic smem: 2H floats.
template <typename T>
__global__ void add_rms_norm_kernel(const T* __restrict__ h, const T* __restrict__ x, const float* __restrict__ w_post,
                                    const float* __restrict__ w_next, T* __restrict__ h_out, T* __restrict__ y, int H,
                                    float eps, bool unit_offset) {
  extern __shared__ float smem[];  // [2H]: x, then the new residual
  float* xs = smem;
  float* hs = smem + H;
  __shared__ float red[32];
  const int64_t base = (int64_t)blockIdx.x * H;
  // Both rows are read up front so their memory latencies overlap.
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = from_t<T>(x[base + i]);
    xs[i] = v;
    hs[i] = from_t<T>(h[base + i]);
    ss += v * v;
  }
  const float inv_x = w_post ? rsqrtf(block_sum(ss, red) / H + eps) : 1.f;
  ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float a = w_post ? rnd<T>(norm_value<T>(xs[i], inv_x, w_post[i], unit_offset)) : xs[i];
    const float v = rnd<T>(hs[i] + a);
    hs[i] = v;
    h_out[base + i] = to_t<T>(v);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, red) / H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) y[base + i] = to_t<T>(norm_value<T>(hs[i], inv, w_next[i], unit_offset));
}

template <typename T>
void launch_add_rms_norm(const T* h, const T* x, const float* w_post, const float* w_next, T* h_out, T* y, int rows,
                         int H, float eps, bool unit_offset, cudaStream_t s) {
  add_rms_norm_kernel<T><<<rows, 256, 2 * H * sizeof(float), s>>>(h, x, w_post, w_next, h_out, y, H, eps, unit_offset);
}

// ---------------------------------------------------------------------------
// q/k head norm + RoPE + K/V cache store, one block per (token, head).
//   qkv:  [B·T, Hq·D + 2·Hkv·D]  (the fused projection output, row-major)
//   heads 0..Hq-1 are q heads -> q_out [B·T, Hq, D];
//   heads Hq..Hq+Hkv-1 are k heads -> k_cache[b, h, slot, :], with v copied to v_cache.
//   cos, sin: [P, rot] in T (HF casts its tables to the activation dtype).
//   positions: [T] int64; slot = position mod ring (the cache's exact ring: all S slots on
//   plain layers, the first `ring` on restored ones; a restored region when the caller passes
//   its view). k_cache/v_cache element (b, h, slot, i) sits at b·cache_bs + h·cache_hs + slot·D + i.
//   q_w/k_w: [D] f32 norm weights, nullptr when the family has no q/k norm.
//   sink_k/sink_v (K/V only, Hq == 0): positions < sink are copied from these buffers (same
//   strides) at slot position mod sink_ring instead of computed: attention sinks keep their
//   exact K/V when a restored region takes them in. nullptr/0: none.
// Threads: one per rotary pair (rot/2), plus pass-through dims past rot.
template <typename T>
__global__ void qk_norm_rope_store_kernel(const T* __restrict__ qkv, const float* __restrict__ q_w,
                                          const float* __restrict__ k_w, const T* __restrict__ cos_t,
                                          const T* __restrict__ sin_t, const int64_t* __restrict__ positions,
                                          T* __restrict__ q_out, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                          int T_len, int Hq, int Hkv, int D, int rot, int64_t cache_bs,
                                          int64_t cache_hs, int ring, const T* __restrict__ sink_k,
                                          const T* __restrict__ sink_v, int sink, int sink_ring, float eps,
                                          bool unit_offset) {
  __shared__ float red[32];
  extern __shared__ float xs[];  // [D] the normed head, rounded to T
  const int n = blockIdx.x;      // token row: b·T + t
  const int head = blockIdx.y;
  const int t = n % T_len, b = n / T_len;
  const bool is_q = head < Hq;
  const int row_w = (Hq + 2 * Hkv) * D;
  const T* src = qkv + (int64_t)n * row_w + (int64_t)head * D;
  const int64_t pos = positions[t];
  if (!is_q && pos < sink) {  // the whole block takes this branch (one position): no barrier is skipped halfway
    const int64_t base = (int64_t)b * cache_bs + (int64_t)(head - Hq) * cache_hs;
    const int64_t off = base + (pos % ring) * D, from = base + (pos % sink_ring) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      k_cache[off + i] = sink_k[from + i];
      v_cache[off + i] = sink_v[from + i];
    }
    return;
  }
  const float* w = is_q ? q_w : k_w;
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
  const T* c = cos_t + pos * rot;
  const T* s = sin_t + pos * rot;
  T* dst;
  if (is_q) {
    dst = q_out + ((int64_t)n * Hq + head) * D;
  } else {
    const int hk = head - Hq;
    const int64_t slot = pos % ring;
    const int64_t off = (int64_t)b * cache_bs + (int64_t)hk * cache_hs + slot * D;
    dst = k_cache + off;
    const T* vsrc = qkv + (int64_t)n * row_w + (int64_t)(Hq + Hkv + hk) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) v_cache[off + i] = vsrc[i];
  }
  const int half = rot / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    // HF: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1]; each product rounded to T.
    float x1 = xs[i], x2 = xs[i + half];
    dst[i] = to_t<T>(rnd<T>(x1 * from_t<T>(c[i])) + rnd<T>(-x2 * from_t<T>(s[i])));
    dst[i + half] = to_t<T>(rnd<T>(x2 * from_t<T>(c[i + half])) + rnd<T>(x1 * from_t<T>(s[i + half])));
  }
  for (int i = rot + threadIdx.x; i < D; i += blockDim.x) dst[i] = to_t<T>(xs[i]);
}

template <typename T>
void launch_qk_norm_rope_store(const T* qkv, const float* q_w, const float* k_w, const T* cos_t, const T* sin_t,
                               const int64_t* positions, T* q_out, T* k_cache, T* v_cache, int B, int T_len, int Hq,
                               int Hkv, int D, int rot, int64_t cache_bs, int64_t cache_hs, int ring, const T* sink_k,
                               const T* sink_v, int sink, int sink_ring, float eps, bool unit_offset, cudaStream_t s) {
  dim3 grid(B * T_len, Hq + Hkv);
  int threads = D >= 256 ? 128 : (D >= 128 ? 64 : 32);
  qk_norm_rope_store_kernel<T><<<grid, threads, D * sizeof(float), s>>>(
      qkv, q_w, k_w, cos_t, sin_t, positions, q_out, k_cache, v_cache, T_len, Hq, Hkv, D, rot, cache_bs, cache_hs, ring,
      sink_k, sink_v, sink, sink_ring, eps, unit_offset);
}

// ---------------------------------------------------------------------------
// Decode attention (T queries per sequence: decode steps, verify and drafter
// blocks) over a cache whose slots carry absolute positions (-1 = empty), split
// over the key axis (flash-decoding). Each (sequence, query, head) row is an
// independent one-query problem: blocks are few-token, so re-reading K/V per
// query costs less than the mask tensors and SDPA launches it replaces.
//   q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; slot_pos: [S]; q_pos: [T] (qstride 1)
//   or [1] shared by all T queries (qstride 0)
//   partial: [B·T·Hq, chunks, D + 2] f32 (acc, max, sum); out: [B, T, Hq, D]
// Visibility: 0 <= p <= q_pos[t] and (window == 0 or q_pos[t] - p < window), and
// where in_restored != nullptr (restored / coded layers, core/kv_cache.h) the slot's
// region must match whether p is recent for the query: q - p < rwin (rblock == 0),
// or p >= floor(max(q - rwin + 1, 0) / rblock) · rblock (coded layers).
constexpr int kAttnWarps = 8;
constexpr int kAttnChunk = 64;  // keys per block: 8 per warp keeps each warp's serial chain short

template <typename T, int VPL>  // VPL: values per lane = D / 32
__global__ void decode_attn_partial_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                           const int64_t* __restrict__ slot_pos, const int64_t* __restrict__ q_pos,
                                           int qstride, const bool* __restrict__ in_restored, int rwin, int rblock,
                                           float* __restrict__ partial, int Tq, int Hq, int Hkv, int S, int window,
                                           float scale, float softcap) {
  constexpr int D = VPL * 32;
  const int chunk = blockIdx.x, bh = blockIdx.y, nchunks = gridDim.x;  // bh: row (b, t, hq) of q
  const int b = bh / (Tq * Hq), t = (bh / Hq) % Tq, hq = bh % Hq, hk = hq / (Hq / Hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t qp = q_pos[t * qstride];
  // Coded layers: positions below this are read from the coded region, newer ones from the ring.
  const int64_t below = rblock > 0 ? (max(qp - rwin + 1, (int64_t)0) / rblock) * rblock : 0;
  float qv[VPL], acc[VPL];
  for (int i = 0; i < VPL; ++i) {
    qv[i] = from_t<T>(q[(int64_t)bh * D + lane * VPL + i]) * scale;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const T* kb = k + ((int64_t)b * Hkv + hk) * S * D;
  const T* vb = v + ((int64_t)b * Hkv + hk) * S * D;
  const int start = chunk * kAttnChunk, end = min(S, start + kAttnChunk);
  for (int j = start + warp; j < end; j += kAttnWarps) {
    // Both loads issue together: the restored-region flag must not add a dependent load
    // to every key's chain on restored layers.
    const int64_t p = slot_pos[j];
    const bool restored_slot = in_restored && in_restored[j];
    if (p < 0 || p > qp || (window > 0 && qp - p >= window)) continue;  // warp-uniform
    if (in_restored) {
      const bool recent = rblock > 0 ? p >= below : qp - p < rwin;
      if (recent == restored_slot) continue;  // the other region holds this query's copy
    }
    float sdot = 0.f;
    const T* kr = kb + (int64_t)j * D + lane * VPL;
    for (int i = 0; i < VPL; ++i) sdot += qv[i] * from_t<T>(kr[i]);
    sdot = warp_sum(sdot);
    if (softcap > 0.f) sdot = tanhf(sdot / softcap) * softcap;
    const float m_new = fmaxf(m, sdot);
    const float corr = __expf(m - m_new), pj = __expf(sdot - m_new);
    l = l * corr + pj;
    const T* vr = vb + (int64_t)j * D + lane * VPL;
    for (int i = 0; i < VPL; ++i) acc[i] = acc[i] * corr + pj * from_t<T>(vr[i]);
    m = m_new;
  }
  // Merge the warps of this block.
  __shared__ float sm[kAttnWarps], sl[kAttnWarps];
  __shared__ float sacc[kAttnWarps][D];
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
  for (int i = 0; i < VPL; ++i) sacc[warp][lane * VPL + i] = acc[i];
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sm[w]);
  float* out = partial + ((int64_t)bh * nchunks + chunk) * (D + 2);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) a += sm[w] == -INFINITY ? 0.f : sacc[w][d] * __expf(sm[w] - M);
    out[d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) L += sm[w] == -INFINITY ? 0.f : sl[w] * __expf(sm[w] - M);
    out[D] = M;
    out[D + 1] = L;
  }
}

template <typename T>
__global__ void decode_attn_combine_kernel(const float* __restrict__ partial, T* __restrict__ out, int D, int nchunks) {
  const int bh = blockIdx.x;
  const float* p = partial + (int64_t)bh * nchunks * (D + 2);
  float M = -INFINITY;
  for (int c = 0; c < nchunks; ++c) M = fmaxf(M, p[c * (D + 2) + D]);
  float L = 0.f;
  for (int c = 0; c < nchunks; ++c) {
    float mc = p[c * (D + 2) + D];
    if (mc != -INFINITY) L += p[c * (D + 2) + D + 1] * __expf(mc - M);
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int c = 0; c < nchunks; ++c) {
      float mc = p[c * (D + 2) + D];
      if (mc != -INFINITY) a += p[c * (D + 2) + d] * __expf(mc - M);
    }
    out[(int64_t)bh * D + d] = to_t<T>(L > 0.f ? a / L : 0.f);
  }
}

inline int decode_attn_chunks(int S) { return (S + kAttnChunk - 1) / kAttnChunk; }

// Returns false if D is not one of the supported head dims (64, 128, 256, 512).
template <typename T>
bool launch_decode_attention(const T* q, const T* k, const T* v, const int64_t* slot_pos, const int64_t* q_pos,
                             int qstride, const bool* in_restored, int rwin, int rblock, float* partial, T* out, int B,
                             int Tq, int Hq, int Hkv, int S, int D, int window, float scale, float softcap,
                             cudaStream_t s) {
  const int nchunks = decode_attn_chunks(S);
  dim3 grid(nchunks, B * Tq * Hq);
  const int threads = kAttnWarps * 32;
#define KAKEYA_ATTN_CASE(DIM, VPL)                                                                                  \
  case DIM:                                                                                                          \
    decode_attn_partial_kernel<T, VPL><<<grid, threads, 0, s>>>(q, k, v, slot_pos, q_pos, qstride, in_restored, rwin, \
                                                                 rblock, partial, Tq, Hq, Hkv, S, window, scale,      \
                                                                 softcap);                                            \
    break;
  switch (D) {
    KAKEYA_ATTN_CASE(64, 2) KAKEYA_ATTN_CASE(128, 4) KAKEYA_ATTN_CASE(256, 8) KAKEYA_ATTN_CASE(512, 16)
    default: return false;
  }
#undef KAKEYA_ATTN_CASE
  decode_attn_combine_kernel<T><<<B * Tq * Hq, D < 256 ? D : 256, 0, s>>>(partial, out, D, nchunks);
  return true;
}

// ---------------------------------------------------------------------------
// Gated MLP activation: out = act(gate) · up, gu = [gate | up]: [rows, 2I] -> out [rows, I].
// act(gate) is rounded to T before the product, as PyTorch materialises it.
template <typename T>
__global__ void act_mul_kernel(const T* __restrict__ gu, T* __restrict__ out, int64_t rows, int I, Act act) {
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
  act_mul_kernel<T><<<blocks, threads, 0, s>>>(gu, out, rows, I, act);
}

// ---------------------------------------------------------------------------
// Skinny matmul for decode: y[m, n] = Σ_k x[m, k]·W[n, k] (+ bias[n]), M <= kGemvMaxRows.
// Batch-1 decode reads every weight once per token, so this is a bandwidth
// kernel: 16-byte vector loads of W, four in flight per lane, x staged in
// shared memory as f32, f32 accumulation, one rounding to T (as cuBLAS).
// `wpr` warps share one output row (split K) so small N still fills the GPU.
// Gated mode (the MLP's gate/up pair): W holds [gate; up] ([2N, K]) and the
// warp group computes both rows, writing act(gate)·up rounded as PyTorch does.
//   x: [M, K]; W: [N or 2N, K] row-major; bias: [N or 2N] or nullptr; y: [M, N]. K % (16 / sizeof(T)) == 0.
constexpr int kGemvMaxRows = 8;
constexpr int kGemvWarps = 8;
constexpr int kGemvUnroll = 4;

template <typename T> struct Vec16;
template <> struct Vec16<float> { static constexpr int n = 4; };
template <> struct Vec16<__nv_bfloat16> { static constexpr int n = 8; };

template <typename T, int M>
__device__ __forceinline__ void dot_rows(const T* __restrict__ wr, const float* __restrict__ xs, int K, int k0, int k1,
                                         int lane, float* acc) {
  constexpr int V = Vec16<T>::n;
  constexpr int STEP = 32 * V;
  int k = k0 + lane * V;
  for (; k + (kGemvUnroll - 1) * STEP < k1; k += kGemvUnroll * STEP) {
    uint4 raw[kGemvUnroll];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) raw[u] = *reinterpret_cast<const uint4*>(wr + k + u * STEP);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float* xm = xs + m * K + k + u * STEP;
#pragma unroll
        for (int i = 0; i < V; ++i) acc[m] += from_t<T>(e[i]) * xm[i];
      }
    }
  }
  for (; k < k1; k += STEP) {
    const uint4 raw = *reinterpret_cast<const uint4*>(wr + k);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int i = 0; i < V; ++i) acc[m] += from_t<T>(e[i]) * xs[m * K + k + i];
    }
  }
}

template <typename T, int M>
__global__ void gemv_kernel(const T* __restrict__ x, const T* __restrict__ W, const T* __restrict__ bias,
                            T* __restrict__ y, int N, int K, int wpr, Act act) {
  extern __shared__ float xs[];  // [M, K], then [kGemvWarps, 2, M] partial sums
  float* part = xs + M * K;
  for (int i = threadIdx.x; i < M * K; i += blockDim.x) xs[i] = from_t<T>(x[i]);
  __syncthreads();
  constexpr int V = Vec16<T>::n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rows_per_block = kGemvWarps / wpr;
  const int n = blockIdx.x * rows_per_block + warp / wpr;
  const int part_idx = warp % wpr;
  // This warp's K range, a multiple of the vector width.
  const int kv = K / V, per = (kv + wpr - 1) / wpr;
  const int k0 = min(kv, part_idx * per) * V, k1 = min(kv, (part_idx + 1) * per) * V;
  const bool gated = act != Act::None;
  float acc[2][M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = 0.f;
  if (n < N) {
    dot_rows<T, M>(W + (int64_t)n * K, xs, K, k0, k1, lane, acc[0]);
    if (gated) dot_rows<T, M>(W + (int64_t)(n + N) * K, xs, K, k0, k1, lane, acc[1]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[0][m] = warp_sum(acc[0][m]);
    if (gated) acc[1][m] = warp_sum(acc[1][m]);
  }
  if (wpr > 1) {
    if (lane == 0)
      for (int m = 0; m < M; ++m) {
        part[(warp * 2 + 0) * M + m] = acc[0][m];
        part[(warp * 2 + 1) * M + m] = acc[1][m];
      }
    __syncthreads();
    if (part_idx != 0) return;
    for (int m = 0; m < M; ++m) {
      float a0 = 0.f, a1 = 0.f;
      for (int p = 0; p < wpr; ++p) {
        a0 += part[((warp + p) * 2 + 0) * M + m];
        a1 += part[((warp + p) * 2 + 1) * M + m];
      }
      acc[0][m] = a0;
      acc[1][m] = a1;
    }
  }
  if (lane != 0 || n >= N) return;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float g = acc[0][m] + (bias ? from_t<T>(bias[n]) : 0.f);
    if (!gated) {
      y[(int64_t)m * N + n] = to_t<T>(g);
    } else {
      // The unfused path materialises gate and up in T, then act(gate) in T, then the product.
      const float u = rnd<T>(acc[1][m] + (bias ? from_t<T>(bias[n + N]) : 0.f));
      y[(int64_t)m * N + n] = to_t<T>(rnd<T>(apply_act(rnd<T>(g), act)) * u);
    }
  }
}

// Returns false when the shape is not for this kernel (caller falls back to cuBLAS).
// N: output columns (for gated mode, W has 2N rows).
template <typename T>
bool launch_gemv(const T* x, const T* W, const T* bias, T* y, int M, int N, int K, Act act, cudaStream_t s) {
  if (M < 1 || M > kGemvMaxRows || K % Vec16<T>::n != 0) return false;
  const size_t smem = (size_t)M * K * sizeof(float) + kGemvWarps * 2 * M * sizeof(float);
  if (smem > 48 * 1024 || reinterpret_cast<uintptr_t>(W) % 16 != 0) return false;
  // Enough warps in flight to cover memory latency: split K when rows are few.
  const int wpr = N >= 4096 ? 1 : (N >= 1024 ? 2 : 4);
  const int rows_per_block = kGemvWarps / wpr;
  const dim3 grid((N + rows_per_block - 1) / rows_per_block);
  const int threads = kGemvWarps * 32;
  switch (M) {
#define KAKEYA_GEMV_CASE(R) \
  case R: gemv_kernel<T, R><<<grid, threads, smem, s>>>(x, W, bias, y, N, K, wpr, act); break;
    KAKEYA_GEMV_CASE(1) KAKEYA_GEMV_CASE(2) KAKEYA_GEMV_CASE(3) KAKEYA_GEMV_CASE(4)
    KAKEYA_GEMV_CASE(5) KAKEYA_GEMV_CASE(6) KAKEYA_GEMV_CASE(7) KAKEYA_GEMV_CASE(8)
#undef KAKEYA_GEMV_CASE
  }
  return true;
}

// ---------------------------------------------------------------------------
// Skinny tensor-core GEMM for verify and drafter blocks (bf16, 9..16 rows):
//   y[m, n] = Σ_k x[m, k]·W[n, k] (+ bias[n]); gated mode (act != None): W = [gate; up]
//   ([2N, K]) and y = act(gate)·up, rounded as gemv_kernel's gated epilogue does.
// Same contract as gemv_kernel: f32 accumulation, one rounding to bf16 at the end.
//
// Why not cuBLAS: at 9..16 rows these layers are tiny (0.2..4 MB of weights) and
// latency-bound; one kernel that issues every weight load at once, with the gated
// epilogue fused (no act_mul kernel), wins back the cuBLAS kernel(s) + act_mul launch.
// Why tensor cores: at 16 rows a CUDA-core dot product spends ~16 FMAs per loaded
// weight, which no longer hides under the load; one mma.sync does 16·8·16 of them.
//
// Fragments (PTX ISA, mma.m16n8k16 .bf16; lane = 4·g + q, g = lane / 4, q = lane % 4):
//   A (x, 16×16, row): a0 = x[g][2q, 2q+1]  a1 = x[g+8][2q, 2q+1]  a2 = x[g][2q+8, +9]  a3 = x[g+8][2q+8, +9]
//   B (Wᵀ, 16×8, col): b0 = W[g][2q, 2q+1]  b1 = W[g][2q+8, 2q+9]
//   C (16×8 f32):      c0, c1 = row g, cols 2q, 2q+1;  c2, c3 = row g+8, same cols
// A k chunk of 32 is two mma's with a permuted k order: lane (g, q) loads W[n0+g][kc+8q .. +7]
// (one 16-byte load, the 4 lanes of a row read 64 contiguous bytes) as words w0..w3 and
// passes b = {w0, w1} to the first mma and {w2, w3} to the second. So the first mma's
// logical k (2q+e, 2q+8+e) is physical kc+8q+e, kc+8q+2+e and the second's is kc+8q+4+e,
// kc+8q+6+e: a bijection onto kc..kc+31 that depends on the logical index only, so the A
// side uses it too: x[g][kc+8q .. +7] and x[g+8][same] (two 16-byte loads) split the same way.
// Σ_k is order-free, so the result is the plain product up to f32 summation order.
//
// Work split. A warp owns a unit of output columns: 16 (two 8-column n-tiles) or, gated,
// 8 (the gate tile and its up tile: the epilogue has both in registers). Two tiles per warp
// halve the x traffic per weight byte (x fragments are loaded once for both).
//  * P = 1 (many units: lm_head, draft head): persistent CTAs, each warp loops over units with
//    all of K, kSgUnroll chunks (2·kSgUnroll 16-byte weight loads) in flight per lane, and
//    writes its outputs straight from the C fragments.
//  * P > 1 (few units, N ~ 128..2048): K is split P ways so that about one wave of warps
//    has every weight load in flight at once: S = min(P, 8) CTAs of a thread-block cluster
//    (sm_90) times wk = P / S warps per CTA. Partial sums go through shared memory: the
//    CTA's wk warps are summed in place, then each CTA of the cluster finalises 1/S of the
//    outputs reading the S CTA sums over distributed shared memory. Fixed summation order
//    (warps, then ranks, in index order): deterministic, no atomics, no workspace, one
//    kernel. Splitting across the cluster first (rather than across a CTA's warps) keeps
//    the warps of a CTA on the same k slice, so they share x through L1.
// x is read straight from global memory with 16-byte loads, not staged in shared memory:
// it was just written (L2-resident), the warps of a CTA that share a k slice (all of K in
// the persistent path) read the same x through L1, and a staged copy would cost a pass over
// x per CTA plus a barrier before the first mma, where here each x element is loaded where
// a fragment needs it, in flight together with the weights. Rows M..15 of the A fragments
// are zeros (not loaded). Weights are streamed with ld.global.nc.L1::no_allocate so they do
// not evict x from L1. Shared memory holds only the split-K partial sums (8 KB per CTA).
//   x: [M, K]; W: [N or 2N, K] row-major; bias: [N or 2N] or nullptr; y: [M, N].
//   x and W 16-byte aligned, K % 32 == 0.
constexpr int kSgMinRows = kGemvMaxRows + 1;  // below: gemv_kernel (decode steps)
constexpr int kSgMaxRows = 16;                // one m16 row block
constexpr int kSgWarps = 8;
constexpr int kSgThreads = kSgWarps * 32;
constexpr int kSgUnroll = 4;      // 32-wide k chunks per load round (x 2 tiles: 8 weight loads per lane)
constexpr int kSgMaxCluster = 8;  // the portable cluster size limit
constexpr int kSgMaxSplit = kSgMaxCluster * kSgWarps;

// Weights are read once per call: bypass L1 (keeps x resident there).
__device__ __forceinline__ uint4 sg_load_stream(const __nv_bfloat16* p) {  // 8 values, 16-byte aligned
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// d += A·B for one 16x8x16 tile; a0..a3, b0..b1 as in the fragment table above.
__device__ __forceinline__ void sg_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide k chunk for one n-tile: lo = x row g, hi = x row g+8, w = W row n0+g (16 bytes each).
__device__ __forceinline__ void sg_mma_chunk(float (&d)[4], const uint4& lo, const uint4& hi, const uint4& w) {
  sg_mma(d, lo.x, hi.x, lo.y, hi.y, w.x, w.y);  // physical k 8q+0..3
  sg_mma(d, lo.z, hi.z, lo.w, hi.w, w.z, w.w);  // physical k 8q+4..7
}

// acc[t] += this lane's C fragment of tile t of `unit` over k chunks [c0, c1).
// Tile 0: W rows unit·CW + g; tile 1: the up rows N + unit·8 + g (gated) or unit·16 + 8 + g.
template <bool GATED>
__device__ __forceinline__ void sg_accumulate(const __nv_bfloat16* __restrict__ x,  // [M, K]
                                              const __nv_bfloat16* __restrict__ W,  // [N or 2N, K]
                                              int M, int N, int K, int unit, int c0, int c1, int lane,
                                              float (&acc)[2][4]) {
  constexpr int CW = GATED ? 8 : 16;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = unit * CW;
  // Rows past N (the last unit) read row N-1 instead: their columns are never stored, and a
  // clamped address keeps the loads unpredicated. A tile wholly past N loads nothing.
  const int64_t row0 = min(n0 + g, N - 1);
  const int64_t row1 = GATED ? N + row0 : min(n0 + 8 + g, N - 1);
  const bool tile1 = GATED || n0 + 8 < N;  // warp-uniform
  const __nv_bfloat16* w0 = W + row0 * K + q * 8;
  const __nv_bfloat16* w1 = W + row1 * K + q * 8;
  // A rows M..15 are zeros: the hi fragment is only loaded where row g+8 exists (g < 8 < M always does).
  const bool hi_ok = g + 8 < M;
  const __nv_bfloat16* xlo = x + (int64_t)g * K + q * 8;
  const __nv_bfloat16* xhi = x + (int64_t)(hi_ok ? g + 8 : g) * K + q * 8;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int c = c0; c < c1; c += kSgUnroll) {
    uint4 wa[kSgUnroll], wb[kSgUnroll], lo[kSgUnroll], hi[kSgUnroll];
    // Every load of the round is issued before the first mma waits on one.
#pragma unroll
    for (int j = 0; j < kSgUnroll; ++j) {
      if (c + j < c1) {
        wa[j] = sg_load_stream(w0 + (c + j) * 32);
        wb[j] = tile1 ? sg_load_stream(w1 + (c + j) * 32) : zero;
      }
    }
#pragma unroll
    for (int j = 0; j < kSgUnroll; ++j) {
      if (c + j < c1) {
        lo[j] = __ldg(reinterpret_cast<const uint4*>(xlo + (c + j) * 32));
        hi[j] = hi_ok ? __ldg(reinterpret_cast<const uint4*>(xhi + (c + j) * 32)) : zero;
      }
    }
#pragma unroll
    for (int j = 0; j < kSgUnroll; ++j) {
      if (c + j < c1) {
        sg_mma_chunk(acc[0], lo[j], hi[j], wa[j]);
        sg_mma_chunk(acc[1], lo[j], hi[j], wb[j]);
      }
    }
  }
}

// The epilogue of one output: gemv_kernel's rounding, term for term.
template <bool GATED>
__device__ __forceinline__ void sg_store(__nv_bfloat16* __restrict__ y,           // [M, N]
                                         const __nv_bfloat16* __restrict__ bias,  // [N or 2N] or nullptr
                                         int N, Act act, int m, int n, float gate, float up) {
  using T = __nv_bfloat16;
  const float g = gate + (bias ? from_t<T>(bias[n]) : 0.f);
  if (!GATED) {
    y[(int64_t)m * N + n] = to_t<T>(g);
  } else {
    // The unfused path materialises gate and up in T, then act(gate) in T, then the product.
    const float u = rnd<T>(up + (bias ? from_t<T>(bias[n + N]) : 0.f));
    y[(int64_t)m * N + n] = to_t<T>(rnd<T>(apply_act(rnd<T>(g), act)) * u);
  }
}

// S == 1: persistent (P = 1). S > 1: launched as clusters of S CTAs along x, K split S·wk ways.
template <bool GATED>
__global__ void __launch_bounds__(kSgThreads, 2)
    skinny_gemm_kernel(const __nv_bfloat16* __restrict__ x,     // [M, K]
                       const __nv_bfloat16* __restrict__ W,     // [N, K], or [2N, K] = [gate; up] (GATED)
                       const __nv_bfloat16* __restrict__ bias,  // [N or 2N] or nullptr
                       __nv_bfloat16* __restrict__ y,           // [M, N]
                       int M, int N, int K, int wk, int S, Act act) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters and this tuning are sm_90: the launcher refuses older devices
#else
  constexpr int CW = GATED ? 8 : 16;          // output columns per unit
  constexpr int OPU = kSgMaxRows * CW;        // outputs per unit (rows past M skipped)
  // Per warp: its two 16x8 tiles' partial sums, dense [tile][m][n] (256 floats).
  __shared__ __align__(16) float part[kSgWarps * 256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int units = (N + CW - 1) / CW, C = K / 32;
  float acc[2][4];

  if (S == 1) {
    for (int unit = blockIdx.x * kSgWarps + warp; unit < units; unit += gridDim.x * kSgWarps) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][i] = acc[1][i] = 0.f;
      sg_accumulate<GATED>(x, W, M, N, K, unit, 0, C, lane, acc);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // c0, c1: row g; c2, c3: row g+8
        const int m = g + 8 * h;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (GATED) {
            const int n = unit * CW + 2 * q + j;
            if (n < N) sg_store<true>(y, bias, N, act, m, n, acc[0][2 * h + j], acc[1][2 * h + j]);
          } else {
#pragma unroll
            for (int t = 0; t < 2; ++t) {
              const int n = unit * CW + 8 * t + 2 * q + j;
              if (n < N) sg_store<false>(y, bias, N, act, m, n, acc[t][2 * h + j], 0.f);
            }
          }
        }
      }
    }
    return;
  }

  // Split K: this CTA is rank `rank` of a cluster of S working on units_cta units; warp
  // (tl, ks) takes unit tl and K part p = rank·wk + ks of P = S·wk.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int units_cta = kSgWarps / wk;
  const int group = blockIdx.x / S;  // clusters tile the grid along x: blocks group·S .. group·S + S-1
  const int tl = warp / wk, ks = warp % wk;
  const int unit = group * units_cta + tl;
  const int P = S * wk, p = rank * wk + ks;
  const int c0 = (int)((int64_t)C * p / P), c1 = (int)((int64_t)C * (p + 1) / P);  // P <= C: never empty
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[0][i] = acc[1][i] = 0.f;
  if (unit < units) sg_accumulate<GATED>(x, W, M, N, K, unit, c0, c1, lane, acc);  // warp-uniform
  float* mine = part + warp * 256;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    *reinterpret_cast<float2*>(mine + t * 128 + g * 8 + 2 * q) = make_float2(acc[t][0], acc[t][1]);
    *reinterpret_cast<float2*>(mine + t * 128 + (g + 8) * 8 + 2 * q) = make_float2(acc[t][2], acc[t][3]);
  }
  if (wk > 1) {
    // The CTA's sum of each unit, in place into its first warp's slot: element i of unit tl is
    // read and written by one thread only.
    __syncthreads();
    for (int e = threadIdx.x; e < units_cta * 256; e += kSgThreads) {
      float* s = part + (e / 256) * wk * 256 + e % 256;
      float v = s[0];
      for (int j = 1; j < wk; ++j) v += s[j * 256];
      s[0] = v;
    }
  }
  cluster.sync();  // every CTA's sums are written and visible across the cluster
  // This rank finalises outputs [rank·per, (rank+1)·per) of the group's units_cta·OPU, at most
  // kOut per thread: all their DSMEM reads are issued together, then the thread arrives on the
  // cluster barrier (its reads of the other CTAs' shared memory are done) before it stores, so
  // the barrier's release fence does not wait for the y stores.
  constexpr int kOut = kSgWarps * 256 / 2 / kSgThreads;  // per <= 8 units·256 / (S >= 2)
  const int per = units_cta * OPU / S;                    // OPU = 128 or 256, S | 8: exact
  float v0[kOut], v1[kOut];
  int om[kOut], on[kOut];
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    v0[k] = v1[k] = 0.f;
    om[k] = -1;
    on[k] = 0;
    const int e = rank * per + threadIdx.x + k * kSgThreads;
    if (e >= (rank + 1) * per) continue;
    const int u = e / OPU, o = e % OPU;
    const int m = o / CW, c = o % CW;
    const int n = (group * units_cta + u) * CW + c;
    if (m >= M || n >= N) continue;
    om[k] = m;
    on[k] = n;
    // Index in a slot: tile 0/1 (gated: gate/up, same column; else column c / 8), row m, column c % 8.
    const int i0 = u * wk * 256 + (GATED ? 0 : (c / 8) * 128) + m * 8 + c % 8;
#pragma unroll
    for (int r = 0; r < kSgMaxCluster; ++r) {
      if (r < S) {
        const float* rp = cluster.map_shared_rank(part, r);
        v0[k] += rp[i0];
        if (GATED) v1[k] += rp[i0 + 128];
      }
    }
  }
  cluster.barrier_arrive();
#pragma unroll
  for (int k = 0; k < kOut; ++k)
    if (om[k] >= 0) sg_store<GATED>(y, bias, N, act, om[k], on[k], v0[k], v1[k]);
  cluster.barrier_wait();  // no CTA may exit while another still reads its shared memory
#endif
}

// The launch config of a cluster of S CTAs along x (also what the occupancy query takes).
inline cudaLaunchConfig_t sg_config(unsigned grid, int S, cudaStream_t s, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kSgThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)S;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Returns false when the shape is not for this kernel (caller falls back to cuBLAS):
// not bf16, M outside [kSgMinRows, kSgMaxRows], K % 32 != 0, x or W not 16-byte aligned,
// a device older than sm_90, or a cluster launch the device refuses.
template <bool GATED>
bool launch_skinny_gemm_bf16(const __nv_bfloat16* x,     // [M, K]
                             const __nv_bfloat16* W,     // [N, K], or [2N, K] = [gate; up] (GATED)
                             const __nv_bfloat16* bias,  // [N or 2N] or nullptr
                             __nv_bfloat16* y,           // [M, N]
                             int M, int N, int K, Act act, cudaStream_t s) {
  // How many CTAs (plain) and clusters of 2, 4, 8 CTAs of this kernel are resident at once:
  // registers bound a CTA to 2 per SM (__launch_bounds__), and a cluster must fit one GPC, so
  // the device's own count is asked rather than derived. Devices are assumed alike: asked once.
  static const std::array<int, 4> resident = [] {
    std::array<int, 4> n{};  // [0]: CTAs per SM; [i]: clusters of 1 << i CTAs on the device
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n[0], skinny_gemm_kernel<GATED>, kSgThreads, 0) != cudaSuccess)
      (void)cudaGetLastError();
    for (int i = 1; i < 4; ++i) {
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = sg_config(1u << i, 1 << i, nullptr, attr);
      if (cudaOccupancyMaxActiveClusters(&n[i], reinterpret_cast<const void*>(skinny_gemm_kernel<GATED>), &cfg) !=
          cudaSuccess) {
        (void)cudaGetLastError();
        n[i] = 0;
      }
    }
    return n;
  }();
  int dev = 0, sms = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (major < 9) return false;
  constexpr int CW = GATED ? 8 : 16;
  const int64_t units = (N + CW - 1) / CW, ctas = (int64_t)sms * std::max(resident[0], 1);
  const int C = K / 32;
  // K split P (a power of two <= 64, <= C: every warp has a k chunk): the largest whose
  // clusters all fit on the device at once, so that every weight load of the call is in
  // flight in the first (only) wave. P = 1 when even P = 2 would not fit: many units, and
  // persistent CTAs then keep the loads in flight instead.
  int P = 1;
  for (int cand = 2; cand <= kSgMaxSplit && cand <= C; cand *= 2) {
    const int S = std::min(cand, kSgMaxCluster), wk = cand / S, log2S = S == 2 ? 1 : (S == 4 ? 2 : 3);
    const int64_t units_cta = kSgWarps / wk, clusters = (units + units_cta - 1) / units_cta;
    const int64_t fit = resident[log2S] > 0 ? resident[log2S] : ctas / S;
    if (clusters > fit) break;
    P = cand;
  }
  if (P == 1) {
    const int grid = (int)std::min<int64_t>((units + kSgWarps - 1) / kSgWarps, ctas);
    skinny_gemm_kernel<GATED><<<grid, kSgThreads, 0, s>>>(x, W, bias, y, M, N, K, 1, 1, act);
    return true;
  }
  const int S = std::min(P, kSgMaxCluster), wk = P / S;
  const int64_t units_cta = kSgWarps / wk, groups = (units + units_cta - 1) / units_cta;
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = sg_config((unsigned)(groups * S), S, s, attr);
  if (cudaLaunchKernelEx(&cfg, skinny_gemm_kernel<GATED>, x, W, bias, y, M, N, K, wk, S, act) != cudaSuccess) {
    (void)cudaGetLastError();  // a refused launch is not sticky: clear it, the caller falls back to cuBLAS
    return false;
  }
  return true;
}

// Only bf16 has a tensor-core path here (f32 returns false: cuBLAS/TF32 settings decide).
// N: output columns (for gated mode, W has 2N rows). Returns false (nothing launched) for
// shapes the kernel does not take: see launch_skinny_gemm_bf16.
template <typename T>
bool launch_skinny_gemm(const T* x,     // [M, K]
                        const T* W,     // [N, K], or [2N, K] = [gate; up] when act != None
                        const T* bias,  // [N] or [2N], or nullptr
                        T* y,           // [M, N]
                        int M, int N, int K, Act act, cudaStream_t s) {
  if constexpr (!std::is_same_v<T, __nv_bfloat16>) {
    return false;
  } else {
    if (M < kSgMinRows || M > kSgMaxRows || N < 1 || K < 32 || K % 32 != 0) return false;
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(W) % 16 != 0) return false;
    return act == Act::None ? launch_skinny_gemm_bf16<false>(x, W, bias, y, M, N, K, act, s)
                            : launch_skinny_gemm_bf16<true>(x, W, bias, y, M, N, K, act, s);
  }
}

}  // namespace kakeya::kernels
