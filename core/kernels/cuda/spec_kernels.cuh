// Framework-free CUDA kernels for speculative blocks (infer/fused.h): greedy acceptance of
// a verify block, greedy drafts, the block's advance, and the gathering of target features
// into their buffers. Small, latency-bound work that would otherwise be a dozen tiny ATen launches
// per block. core/kernels/cuda/spec_ops.cu wraps them for at::Tensor; core/kernels/ops.h declares them
// with the LibTorch reference used on CPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/kernels/cuda/decode_kernels.cuh"

namespace kakeya::kernels {

// ---------------------------------------------------------------------------
// Greedy acceptance. scores: [T, V] raw scores (any monotone map of the logits: the
// argmax is the same); block: [T] int64 = [carried, d_1 .. d_{T-1}].
// report: [T + 1] int64 = post[0..T-1] (argmax of each row: the verifier's token after
// each position; the first of equal maxima, NaN counting as the largest, as torch.argmax),
// then n = 1 + the length of the leading run of d_i == post[i-1].
// Pass 1: grid (chunks, T), each block reduces one slice of a row to (max, index).
// Pass 2: one block: each warp reduces rows' partials, then thread 0 counts the run.

// a beats b: larger, NaN first, the lower index among equals.
__device__ __forceinline__ bool argmax_beats(float a, int ia, float b, int ib) {
  const bool na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (argmax_beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// The block's (max, first index) of every thread's candidate: true in thread 0, which holds it.
__device__ __forceinline__ bool block_argmax(float& best, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  warp_argmax(best, bi);
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp != 0) return false;
  best = lane < warps ? sv[lane] : -INFINITY;
  bi = lane < warps ? si[lane] : 0x7fffffff;
  warp_argmax(best, bi);
  return lane == 0;
}

constexpr int kArgmaxThreads = 256;

template <typename T>
__global__ void argmax_partial_kernel(const T* __restrict__ scores, int V, int chunk, float* __restrict__ pval,
                                      int* __restrict__ pidx) {
  pdl_begin();
  const int c = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
  const T* r = scores + (int64_t)row * V;
  const int start = c * chunk, end = min(V, start + chunk);
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int j = start + threadIdx.x; j < end; j += blockDim.x) {
    const float v = from_t<T>(r[j]);
    if (argmax_beats(v, j, best, bi)) {
      best = v;
      bi = j;
    }
  }
  if (block_argmax(best, bi)) {
    pval[row * chunks + c] = best;
    pidx[row * chunks + c] = bi;
  }
}

// Row `row`'s argmax from its chunks' partials (every lane of the warp gets it).
__device__ __forceinline__ int row_argmax(const float* __restrict__ pval, const int* __restrict__ pidx, int chunks,
                                          int row, int lane) {
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int c = lane; c < chunks; c += 32) {
    const float v = pval[row * chunks + c];
    const int i = pidx[row * chunks + c];
    if (argmax_beats(v, i, best, bi)) {
      best = v;
      bi = i;
    }
  }
  warp_argmax(best, bi);
  return bi;
}

static __global__ void greedy_accept_kernel(const float* __restrict__ pval, const int* __restrict__ pidx, int chunks,
                                     const int64_t* __restrict__ block, int64_t* __restrict__ report, int Tn) {
  pdl_begin();
  extern __shared__ int64_t post[];  // [Tn]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int row = warp; row < Tn; row += warps) {
    const int bi = row_argmax(pval, pidx, chunks, row, lane);
    if (lane == 0) {
      post[row] = bi;
      report[row] = bi;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t n = 1;
    while (n < Tn && block[n] == post[n - 1]) ++n;
    report[Tn] = n;
  }
}

// Rows' argmax through an optional id map: out[row] = map ? map[argmax] : argmax (the
// drafter's greedy drafts over its draft vocabulary). out: [rows] int64.
static __global__ void argmax_final_kernel(const float* __restrict__ pval, const int* __restrict__ pidx, int chunks,
                                    const int64_t* __restrict__ map, int64_t* __restrict__ out, int rows) {
  pdl_begin();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int row = warp; row < rows; row += warps) {
    const int bi = row_argmax(pval, pidx, chunks, row, lane);
    if (lane == 0) out[row] = map ? map[bi] : bi;
  }
}

inline int argmax_chunks(int V) { return V >= 64 * 2048 ? 64 : (V + 2047) / 2048; }

// scratch: argmax_chunks(V) · T floats and as many ints.
template <typename T>
void launch_greedy_accept(const T* scores, const int64_t* block, int64_t* report, float* pval, int* pidx, int Tn,
                          int V, cudaStream_t s) {
  const int chunks = argmax_chunks(V), chunk = (V + chunks - 1) / chunks;
  launch_pdl(argmax_partial_kernel<T>, dim3(chunks, Tn), kArgmaxThreads, 0, s, scores, V, chunk, pval, pidx);
  launch_pdl(greedy_accept_kernel, 1, 256, Tn * sizeof(int64_t), s, pval, pidx, chunks, block, report, Tn);
}

// scratch: argmax_chunks(V) · rows floats and as many ints.
template <typename T>
void launch_argmax_rows(const T* scores, const int64_t* map, int64_t* out, float* pval, int* pidx, int rows, int V,
                        cudaStream_t s) {
  const int chunks = argmax_chunks(V), chunk = (V + chunks - 1) / chunks;
  launch_pdl(argmax_partial_kernel<T>, dim3(chunks, rows), kArgmaxThreads, 0, s, scores, V, chunk, pval, pidx);
  launch_pdl(argmax_final_kernel, 1, 256, 0, s, pval, pidx, chunks, map, out, rows);
}

// ---------------------------------------------------------------------------
// The block's advance after acceptance: with n = report[T], the next block starts n
// positions later and carries the verifier's token after the accepted drafts:
//   block[0] = report[n - 1]; pos0 += n; qpos[i] = pos0 + i (i < T);
// and, when `table` is given, the draft block's input row of that token (Drafter::embed:
// the table row times `scale`, rounded to T as PyTorch's scalar multiply does):
//   emb[i] = table[report[n - 1], i] · scale (i < H).
// One block of threads; pos0 is read by all before thread 0 moves it.
template <typename T>
__global__ void advance_block_kernel(const int64_t* __restrict__ report, int Tn, int64_t* __restrict__ block,
                                     int64_t* __restrict__ pos0, int64_t* __restrict__ qpos,
                                     const T* __restrict__ table, float scale, T* __restrict__ emb, int H) {
  pdl_begin();
  const int64_t n = report[Tn];
  const int64_t p = pos0[0] + n;
  const int64_t tok = report[n - 1];
  __syncthreads();
  for (int i = threadIdx.x; i < Tn; i += blockDim.x) qpos[i] = p + i;
  if (table)
    for (int i = threadIdx.x; i < H; i += blockDim.x) emb[i] = to_t<T>(from_t<T>(table[tok * H + i]) * scale);
  if (threadIdx.x == 0) {
    block[0] = tok;
    pos0[0] = p;
  }
}

template <typename T>
void launch_advance_block(const int64_t* report, int Tn, int64_t* block, int64_t* pos0, int64_t* qpos, const T* table,
                          float scale, T* emb, int H, cudaStream_t s) {
  launch_pdl(advance_block_kernel<T>, 1, 256, 0, s, report, Tn, block, pos0, qpos, table, scale, emb, H);
}

// ---------------------------------------------------------------------------
// The lm_head of a greedy decode step with its argmax fused: gemv_kernel's wide rows
// (kGemvWideRowsPerWarp a warp, kGemvWarps warps a block) rounded to T as the logits are, each
// block's (max, first index) into pval/pidx[block] and no logits written; argmax_blocks_kernel then
// reduces the blocks. The unfused step wrote 2·V bytes of logits, cast them to f32 and read them
// back in two kernels.
//   x: [K]; W: [N, K]; pval, pidx: [gridDim.x] = [gemv_wide_blocks(N)].
template <typename T>
__device__ __forceinline__ void gemv_argmax_body(Blk blk, const T* x, const T* __restrict__ W, int N, int K,
                                                 float* __restrict__ pval, int* __restrict__ pidx) {
  pdl_trigger();  // its weights load before pdl_wait (dot_rows)
  constexpr int RW = kGemvWideRowsPerWarp;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = (blk.x * kGemvWarps + warp) * RW;
  const int nrows = min(RW, N - n);
  float acc[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) acc[r] = 0.f;
  if (n < N) dot_rows<T, 1, RW, true>(W + (int64_t)n * K, K, nrows, nullptr, x, K, 0, K, lane, acc);
  pdl_wait();  // a warp without rows has not waited in dot_rows
  float best = -INFINITY;
  int bi = 0x7fffffff;
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const float v = rnd<T>(warp_sum(acc[r]));
    if (r < nrows && argmax_beats(v, n + r, best, bi)) {
      best = v;
      bi = n + r;
    }
  }
  if (block_argmax(best, bi)) {
    pval[blk.x] = best;
    pidx[blk.x] = bi;
  }
}
template <typename T>
__global__ void gemv_argmax_kernel(const T* x, const T* __restrict__ W, int N, int K, float* __restrict__ pval,
                                   int* __restrict__ pidx) {
  gemv_argmax_body<T>(hw_blk(), x, W, N, K, pval, pidx);
}

// One row's argmax from many blocks' partials (all threads of one block; any number of them).
// out: [1] int64. pval, pidx: plain pointers (embed_rms_norm_body says why).
__device__ __forceinline__ void argmax_blocks_body(Blk, const float* pval, const int* pidx, int blocks,
                                                   int64_t* __restrict__ out) {
  pdl_begin();
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int c = threadIdx.x; c < blocks; c += blockDim.x)
    if (argmax_beats(pval[c], pidx[c], best, bi)) {
      best = pval[c];
      bi = pidx[c];
    }
  if (block_argmax(best, bi)) out[0] = bi;
}
template <int = 0>  // one definition in every translation unit (store_positions_kernel says why)
__global__ void argmax_blocks_kernel(const float* pval, const int* pidx, int blocks, int64_t* __restrict__ out) {
  argmax_blocks_body(hw_blk(), pval, pidx, blocks, out);
}

// scratch: gemv_wide_blocks(N) floats and as many ints. False when the shape is not for the kernel.
template <typename T>
bool launch_gemv_argmax(const T* x, const T* W, int N, int K, float* pval, int* pidx, int64_t* out, cudaStream_t s) {
  if (K % Vec16<T>::n != 0 || reinterpret_cast<uintptr_t>(W) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)
    return false;
  const int blocks = gemv_wide_blocks(N);
  launch_pdl(gemv_argmax_kernel<T>, blocks, kGemvWarps * 32, 0, s, x, W, N, K, pval, pidx);
  launch_pdl(argmax_blocks_kernel<>, 1, 1024, 0, s, pval, pidx, blocks, out);
  return true;
}

// ---------------------------------------------------------------------------
// The greedy lm_head through an int8 screen (ops::HeadScreen): the same token as gemv_argmax_body,
// reading about half the bytes. Row r of the head has int8 codes q_r and an f32 scale s_r, and
// err_r (ops::make_head_screen) bounds, for any x, the distance between the logit as
// gemv_argmax_body sums it and s_r·(x·q_r) as the screen sums it by ||x||·err_r: Cauchy-Schwarz
// on W_r - s_r·q_r plus both sums' rounding. So
//   pass 1 (screen_head_kernel): a_r = s_r·(x·q_r), u_r = a_r + ||x||·err_r (every row) and each
//     block's largest a_r - ||x||·err_r;
//   pass 2 (screen_pick_kernel): L = the largest of those lower bounds <= the largest logit. A row
//     whose logit ties the largest after rounding to T has rnd(u_r) >= rnd(L) (rounding is monotone),
//     so only rows with rnd(u_r) >= rnd(L) can be the argmax: they are summed again exactly as
//     gemv_argmax_body sums them (dot_rows, warp_sum, rnd) and reduced with its tie rule; the last
//     block to finish reduces every block's (max, first index) to the token, so the screened head
//     is two launches, as gemv_argmax_body's is. A NaN or infinity in x makes every row a candidate
//     (u_r is then NaN or infinite), which is slow but still the full head's answer.
// On Gemma 3 270M's head (262,144 × 640) over 3,571 positions of text: 12.5 candidate rows a position
// on average, 111 at the 99th percentile, 784 at most (tools/head_screen_census.py,
// bench/results/2026-12-03-head-screen-census-cpu.json).
constexpr int kScreenWarps = 8;
// Pass 1's geometry. G lanes share a row (8, 16 or 32: the fewest for which a lane's share of the
// row's 16-byte chunks, C, is at most 8), so a warp reads 32 / G rows at once with every lane busy
// (K = 640: 8 lanes of 5 chunks, 4 rows a load); a warp takes P such row sets, holding P·C loads in
// flight. One row's chunks spread over lanes that way lets Gemma 3 270M's screen read at 65% of DRAM
// peak (54.4 us) against 46% (79.7 us) with a warp a row and 24 of 32 lanes idle in its second load (H200,
// ncu; bench/results/2026-12-03-head-screen-geometry-h200.json).
// Row sets a warp takes for C chunks a lane: the geometry's block count and the kernel's instance
// (launch_screened_argmax) both come from here, so they cannot disagree.
constexpr int screen_row_sets(int C) { return C <= 2 ? 4 : 2; }
struct ScreenGeometry {
  int G = 0, C = 0;  // 0: K is not for the screen (not a multiple of 16, or over 4,096)
  static ScreenGeometry of(int K) {
    ScreenGeometry g;
    const int kc = K / 16;
    if (K % 16 != 0 || K <= 0) return g;
    for (int lanes : {8, 16, 32})
      if ((kc + lanes - 1) / lanes <= 8) {
        g.G = lanes;
        g.C = (kc + lanes - 1) / lanes;
        return g;
      }
    return g;
  }
  int P() const { return screen_row_sets(C); }
  int rows_per_block() const { return kScreenWarps * (32 / G) * P(); }
  int blocks(int N) const { return (N + rows_per_block() - 1) / rows_per_block(); }
};
// 16 int8 codes (one 16-byte load) as floats: each byte b in offset binary (b ^ 0x80) becomes the
// float 2^23 + b by a byte permute, and 2^23 + 128 less gives the code: no conversion instruction.
__device__ __forceinline__ void codes_to_float(uint4 raw, float* q) {
  const unsigned w[4] = {raw.x ^ 0x80808080u, raw.y ^ 0x80808080u, raw.z ^ 0x80808080u, raw.w ^ 0x80808080u};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) q[i * 4 + j] = __int_as_float(__byte_perm(w[i], 0x4B000000u, 0x7540u | j)) - 8388736.f;
}
// x: [K]; codes: [N, K] int8; scale, err: [N] f32; up: [N] (each row's upper bound); plow: [gridDim.x]
// (each block's largest lower bound); done: pass 2's count of finished blocks, zeroed here (pass 2
// starts after this grid has finished). C, P, G: ScreenGeometry::of(K). Up to 10 loads a lane the
// kernel is held to 64 registers, 4 blocks an SM (it takes 68 uncapped: 3 an SM; only the capped
// build was timed).
template <typename T, int C, int P>
__global__ void __launch_bounds__(kScreenWarps * 32, C * P <= 10 ? 4 : 1)
    screen_head_kernel(const T* x, const int8_t* __restrict__ codes, const float* __restrict__ scale,
                       const float* __restrict__ err, int N, int K, int G, float* __restrict__ up,
                       float* __restrict__ plow, unsigned* __restrict__ done) {
  pdl_trigger();  // the codes load before pdl_wait
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int RS = 32 / G, sub = lane / G, gl = lane % G, kc = K / 16;  // rows a set, this lane's row and place
  const int n0 = (blockIdx.x * kScreenWarps + warp) * RS * P;
  uint4 raw[P][C];
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int ch = gl + G * c, n = n0 + p * RS + sub;
      raw[p][c] = n < N && ch < kc ? *reinterpret_cast<const uint4*>(codes + (int64_t)n * K + ch * 16)
                                   : make_uint4(0, 0, 0, 0);  // unused
    }
  pdl_wait();
  // After the wait: the kernel before may be another head's pass 2 on the same scratch.
  if (blockIdx.x == 0 && threadIdx.x == 0) *done = 0;
  float acc[P], ss = 0.f;
#pragma unroll
  for (int p = 0; p < P; ++p) acc[p] = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int ch = gl + G * c;
    if (ch >= kc) break;
    float xv[16];
    uint4 xr[16 / Vec16<T>::n];
#pragma unroll
    for (int u = 0; u < 16 / Vec16<T>::n; ++u) xr[u] = reinterpret_cast<const uint4*>(x + ch * 16)[u];
    const T* xe = reinterpret_cast<const T*>(xr);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      xv[i] = from_t<T>(xe[i]);
      ss += xv[i] * xv[i];
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float q[16];
      codes_to_float(raw[p][c], q);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[p] = fmaf(q[i], xv[i], acc[p]);
    }
  }
  // Each row's sum over its G lanes, and ||x||² over the same lanes (each row's lanes hold all of
  // x): the same value in every row's lanes. Any order of the K terms is within err_r's rounding room.
  for (int o = G / 2; o > 0; o >>= 1) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
#pragma unroll
    for (int p = 0; p < P; ++p) acc[p] += __shfl_xor_sync(0xffffffffu, acc[p], o);
  }
  // ||x||, grown by its sum's rounding.
  const float xn = sqrtf(ss) * (1.f + (float)(K + 4) * 1.2e-7f);
  float low = -INFINITY;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int n = n0 + p * RS + sub;
    if (n >= N) continue;
    const float a = acc[p] * scale[n], e = xn * err[n];
    // The two additions' own rounding: a little more room than u_r's error.
    const float slack = fabsf(a) * 2.5e-7f + e * 1e-6f;
    if (gl == 0) up[n] = a + e + slack;
    low = fmaxf(low, a - e - slack);
  }
  __shared__ float red[32];
  low = block_max(low, red);
  if (threadIdx.x == 0) plow[blockIdx.x] = low;
}
// Rows a pass-2 block scans.
constexpr int kScreenPickRows = 2048;
// Pass 1's lower bounds a pass-2 thread loads at once (Gemma 3 270M's 4,096 blocks in one round).
constexpr int kScreenLowPerThread = 16;
// x, W: the head as gemv_argmax_body reads them; up, plow: pass 1's (nlow blocks); pval, pidx:
// [gridDim.x]; count (nullable): += the candidate rows summed exactly; done: zeroed by pass 1;
// out: [1] int64, the token, written by the last block to finish.
template <typename T>
__global__ void __launch_bounds__(kScreenWarps * 32) screen_pick_kernel(const T* x, const T* __restrict__ W, int N,
                                                                        int K, const float* up, const float* plow,
                                                                        int nlow, float* pval, int* pidx,
                                                                        unsigned* count, unsigned* done,
                                                                        int64_t* __restrict__ out) {
  pdl_begin();
  constexpr int kPer = kScreenPickRows / (kScreenWarps * 32);  // rows a lane tests
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r1 = min(N, (blockIdx.x + 1) * kScreenPickRows);
  auto row_of = [&](int i) { return blockIdx.x * kScreenPickRows + (i * kScreenWarps + warp) * 32 + lane; };
  // The upper bounds and the lower maxima load together: one memory round trip.
  float uv[kPer], lv[kScreenLowPerThread];
#pragma unroll
  for (int i = 0; i < kPer; ++i) uv[i] = row_of(i) < r1 ? up[row_of(i)] : 0.f;
#pragma unroll
  for (int i = 0; i < kScreenLowPerThread; ++i) {
    const int j = threadIdx.x + i * blockDim.x;
    lv[i] = j < nlow ? plow[j] : -INFINITY;
  }
  __shared__ float red[32];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kScreenLowPerThread; ++i) m = fmaxf(m, lv[i]);
  for (int j = threadIdx.x + kScreenLowPerThread * blockDim.x; j < nlow; j += blockDim.x) m = fmaxf(m, plow[j]);
  const float L = rnd<T>(block_max(m, red));
  float best = -INFINITY;
  int bi = 0x7fffffff;
  unsigned found = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r0 = row_of(i) - lane;
    unsigned cand = __ballot_sync(0xffffffffu, r0 + lane < r1 && !(rnd<T>(uv[i]) < L));
    found += __popc(cand);
    while (cand) {  // warp-uniform
      const int n = r0 + __ffs(cand) - 1;
      cand &= cand - 1;
      float acc[1] = {0.f};
      dot_rows<T, 1, 1, true>(W + (int64_t)n * K, K, 1, nullptr, x, K, 0, K, lane, acc);
      const float v = rnd<T>(warp_sum(acc[0]));
      if (argmax_beats(v, n, best, bi)) {
        best = v;
        bi = n;
      }
    }
  }
  if (count && lane == 0 && found) atomicAdd(count, found);
  // Thread 0 publishes the block's pair, then counts the block done; the last block reads all pairs
  // (through L2: other blocks wrote them) and writes the token.
  __shared__ bool last;
  if (block_argmax(best, bi)) {
    pval[blockIdx.x] = best;
    pidx[blockIdx.x] = bi;
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  best = -INFINITY;
  bi = 0x7fffffff;
  for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) {
    const float v = __ldcg(pval + c);
    const int i = __ldcg(pidx + c);
    if (argmax_beats(v, i, best, bi)) {
      best = v;
      bi = i;
    }
  }
  if (block_argmax(best, bi)) out[0] = bi;
}
inline int screen_pick_blocks(int N) { return (N + kScreenPickRows - 1) / kScreenPickRows; }

// scratch: up [N] f32, plow [ScreenGeometry::of(K).blocks(N)] f32, pval / pidx / done
// [screen_pick_blocks(N)] / [1]. False when the shape is not for the kernels (K not a multiple of 16
// or over 4,096, unaligned rows).
template <typename T>
bool launch_screened_argmax(const T* x, const T* W, const int8_t* codes, const float* scale, const float* err, int N,
                            int K, float* up, float* plow, float* pval, int* pidx, unsigned* count, unsigned* done,
                            int64_t* out, cudaStream_t s) {
  const ScreenGeometry g = ScreenGeometry::of(K);
  if (g.G == 0 || K % Vec16<T>::n != 0 ||
      reinterpret_cast<uintptr_t>(W) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(codes) % 16 != 0)
    return false;
  const int b1 = g.blocks(N), b2 = screen_pick_blocks(N), threads = kScreenWarps * 32;
  auto pass1 = [&](auto kernel) {
    launch_pdl(kernel, b1, threads, 0, s, x, codes, scale, err, N, K, g.G, up, plow, done);
  };
  switch (g.C) {
    case 1: pass1(screen_head_kernel<T, 1, screen_row_sets(1)>); break;
    case 2: pass1(screen_head_kernel<T, 2, screen_row_sets(2)>); break;
    case 3: pass1(screen_head_kernel<T, 3, screen_row_sets(3)>); break;
    case 4: pass1(screen_head_kernel<T, 4, screen_row_sets(4)>); break;
    case 5: pass1(screen_head_kernel<T, 5, screen_row_sets(5)>); break;
    case 6: pass1(screen_head_kernel<T, 6, screen_row_sets(6)>); break;
    case 7: pass1(screen_head_kernel<T, 7, screen_row_sets(7)>); break;
    default: pass1(screen_head_kernel<T, 8, screen_row_sets(8)>); break;
  }
  launch_pdl(screen_pick_kernel<T>, b2, threads, 0, s, x, W, N, K, up, plow, b1, pval, pidx, count, done, out);
  return true;
}

// ---------------------------------------------------------------------------
// A decode step's bookkeeping once its token is chosen (ATen took four launches, each a full stop
// of the step's launch chain): out[step] = next (when step < cap), cur = next, pos += 1, step += 1.
// One thread does it (the persistent kernel runs it in a block of many: the others return).
__device__ __forceinline__ void advance_step_body(Blk, const int64_t* next, int64_t* __restrict__ out, int64_t cap,
                                                  int64_t* __restrict__ step, int64_t* __restrict__ cur,
                                                  int64_t* __restrict__ pos) {
  pdl_begin();
  if (threadIdx.x != 0) return;
  const int64_t t = next[0], s = step[0];
  if (s < cap) out[s] = t;
  cur[0] = t;
  pos[0] += 1;
  step[0] = s + 1;
}
template <int = 0>  // one definition in every translation unit (store_positions_kernel says why)
__global__ void advance_step_kernel(const int64_t* next, int64_t* __restrict__ out, int64_t cap,
                                    int64_t* __restrict__ step, int64_t* __restrict__ cur, int64_t* __restrict__ pos) {
  advance_step_body(hw_blk(), next, out, cap, step, cur, pos);
}

inline void launch_advance_step(const int64_t* next, int64_t* out, int64_t cap, int64_t* step, int64_t* cur,
                                int64_t* pos, cudaStream_t s) {
  launch_pdl(advance_step_kernel<>, 1, 1, 0, s, next, out, cap, step, cur, pos);
}

// ---------------------------------------------------------------------------
// Concatenated rows: row t of `out` and ring row pos[t] mod R are
// [src_0[t, :] | src_1[t, :] | ...] (each src_i: [T, H_i] contiguous), i.e. the drafter's
// target features from the verifier's tapped hidden states, written where the fused block
// and the Restorer read them. out, ring: [*, F] contiguous, F = Σ H_i; either may be null.
constexpr int kMaxRowSources = 8;
template <typename T>
struct RowSources {
  const T* src[kMaxRowSources];
  int width[kMaxRowSources];   // H_i
  int offset[kMaxRowSources];  // Σ_{j<i} H_j: the part's first column
  int n = 0;
};

// One block per (row, part): the copies of a row run side by side instead of one after
// another. VEC: every width, offset and row start is a multiple of 16 bytes (the caller checks),
// so each thread moves 16 bytes at a time.
template <typename T, bool VEC>
__global__ void concat_rows_kernel(RowSources<T> parts, const int64_t* __restrict__ pos, int F, T* __restrict__ out,
                                   T* __restrict__ ring, int64_t ring_rows) {
  pdl_begin();
  const int t = blockIdx.x, i = blockIdx.y;
  const int w = parts.width[i], off = parts.offset[i];
  const T* sr = parts.src[i] + (int64_t)t * w;
  T* o = out ? out + (int64_t)t * F + off : nullptr;
  T* g = ring ? ring + (pos[t] % ring_rows) * F + off : nullptr;
  if (VEC) {
    constexpr int V = 16 / sizeof(T);
    for (int j = threadIdx.x; j < w / V; j += blockDim.x) {
      const uint4 v = reinterpret_cast<const uint4*>(sr)[j];
      if (o) reinterpret_cast<uint4*>(o)[j] = v;
      if (g) reinterpret_cast<uint4*>(g)[j] = v;
    }
  } else {
    for (int j = threadIdx.x; j < w; j += blockDim.x) {
      const T v = sr[j];
      if (o) o[j] = v;
      if (g) g[j] = v;
    }
  }
}

template <typename T>
void launch_concat_rows(const RowSources<T>& parts, const int64_t* pos, int rows, int F, T* out, T* ring,
                        int64_t ring_rows, bool vec, cudaStream_t s) {
  const dim3 grid(rows, parts.n);
  if (vec) launch_pdl(concat_rows_kernel<T, true>, grid, 128, 0, s, parts, pos, F, out, ring, ring_rows);
  else launch_pdl(concat_rows_kernel<T, false>, grid, 128, 0, s, parts, pos, F, out, ring, ring_rows);
}

}  // namespace kakeya::kernels
