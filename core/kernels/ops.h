// The decoder's elementwise/normalisation ops, one declaration each. On CUDA
// tensors (KAKEYA_CUDA builds) they run the fused kernels of
// core/kernels/cuda/decode_kernels.cuh; otherwise the LibTorch reference below, which
// follows HF transformers' op order (tests/test_cuda_ops.cpp checks the kernels
// against it over odd sizes). Norm weights are f32: Gemma 3's 1+w folded, or
// Gemma 4/Llama/Qwen's w (already rounded to the model dtype).
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kakeya::ops {

struct NormSpec {
  double eps = 1e-6;
  bool unit_offset = false;  // Gemma: x̂·w in f32, one rounding (w = 1+w folded on Gemma 3); else cast x̂, ·w in dtype
};

// x: [..., H]; w: [H] f32 -> [..., H] in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, const NormSpec& ns);

// The forward's first rows: h = embedding(table, ids) · scale (a multiply in the table's dtype) and
// x = rms_norm(h, w). table: [V, H]; ids: [...] int64 (in range: the caller's token ids); scale: a
// one-value tensor in table's dtype on its device -> {h, x}: [..., H]. One kernel on CUDA.
std::pair<at::Tensor, at::Tensor> embed_rms_norm(const at::Tensor& table, const at::Tensor& ids,
                                                 const at::Tensor& scale, const at::Tensor& w, const NormSpec& ns);

// Rows of a [.., T, H] tensor of one sequence also written into a ring of per-position rows:
// dst [R, F] (rows contiguous) at row positions[t] mod R, columns col .. col + H - 1.
struct RowCopy {
  at::Tensor dst;
  int64_t col = 0;
  at::Tensor positions;  // [T] int64
};
void copy_rows(const at::Tensor& x, const RowCopy& to);  // x: [.., T, H]

// The residual step: a = w_post defined ? rms_norm(x, w_post) : x; h' = h + a; y = rms_norm(h', w_next).
// h, x: [..., H]; w_post: [H] f32 or undefined; w_next: [H] f32. Returns {h', y}; with `copy`, h'
// is also written there (copy_rows: on CUDA by the same kernel, no launch of its own).
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w_post,
                                               const at::Tensor& w_next, const NormSpec& ns,
                                               const RowCopy* copy = nullptr);

// x: [..., K]; w: [N, K]; bias: [N] or undefined -> [..., N]. On CUDA with one row (a
// decode step) a bandwidth-bound GEMV kernel, else at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias = {});

// The gated MLP's first half: act_mul(linear(x, w, bias)) with w = [gate; up]: [2I, K] -> [..., I].
// One fused GEMV kernel on CUDA for one row (a decode step).
at::Tensor linear_act_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gelu_tanh);

// A projection as the model applies it: linear(x, w, bias), or (gated, w = [gate; up]) linear_act_mul.
struct Linear {
  at::Tensor w;     // [N, K] ([2N, K] gated)
  at::Tensor bias;  // [N] ([2N] gated) or undefined
  bool gated = false, gelu_tanh = false;
};
// The residual step and the projection that reads its pre-norm: {h', lin(y)} with h', y as
// add_rms_norm's. On CUDA with one row (a decode step) one kernel: every block of the GEMV redoes
// the step from the two rows, so the step costs no launch and y is never stored; the results are
// the two ops' bits. (No RowCopy: the residual step that ends a layer stores the layer's output.)
std::pair<at::Tensor, at::Tensor> add_rms_norm_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w_post,
                                                      const at::Tensor& w_next, const NormSpec& ns, const Linear& lin);

// gu: [..., 2I] = [gate | up] -> act(gate)·up: [..., I]. gelu_tanh or silu.
at::Tensor act_mul(const at::Tensor& gu, bool gelu_tanh);

// ---- routed experts (mixture-of-experts layers) for a few tokens: decode steps, verify blocks ----
// Pair p of N tokens × top_k experts is (token p / top_k, experts[p]). A plan groups the pairs
// by expert; on CUDA it is built on the device (no host sync, capturable), and the expert
// products then read each selected expert's weights once and nothing of the others.
struct ExpertPlan {
  at::Tensor experts;  // [P] int64: the router's choice per pair
  at::Tensor groups;   // CUDA: int32 grouping of the pairs by expert (decode_kernels.cuh); CPU: undefined
  // The most pairs one expert can get: the tokens, since a token's experts are distinct. It
  // picks the kernel's rows per pass (a larger group takes several).
  int64_t most_per_expert = 1;
};
// experts: [N, top_k] int64 indices in 0 .. num_experts - 1.
ExpertPlan plan_experts(const at::Tensor& experts, int64_t num_experts);
// y[p] = w[experts[p]] · x[p / x_div] for every pair: x [P / x_div, K]; w [E, N, K] -> [P, N].
// gated: w[e] is [gate; up] ([2N, K]) and y[p] = act(gate)·up, as linear_act_mul.
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w, const ExpertPlan& plan, int64_t x_div, bool gated,
                         bool gelu_tanh);

// Gemma 4's router for the tokens h [N, H]: x̂ = rms_norm(h) (no weight) · scale · H^-0.5, each
// product in h's dtype; p = softmax(x̂ · proj^T) over the E experts in f32; its top_k largest,
// renormalised to sum 1, × per_expert_scale. scale: [H], proj: [E, H], per_expert_scale: [E],
// all in h's dtype. with_plan: also the pairs' plan (plan_experts; on CUDA built by the same
// launches, no host sync).
struct ExpertRoute {
  at::Tensor weights;  // [N, top_k] f32
  at::Tensor experts;  // [N, top_k] int64, by descending probability
  ExpertPlan plan;     // with_plan only
};
ExpertRoute route_experts(const at::Tensor& h, const at::Tensor& scale, const at::Tensor& proj,
                          const at::Tensor& per_expert_scale, int64_t top_k, const NormSpec& ns, bool with_plan);

// Gemma 4's MoE layer end, one residual step (one kernel on CUDA):
//   m = Σ_k rnd(y[t·K + k] · r[t, k]) rounded once   (r undefined: y is m, already summed)
//   f' = rms_norm(f, dense) + rms_norm(m, experts);  h' = (h + rms_norm(f', ffn)) · scalar
//   x = rms_norm(h', w_next)                         (the next pre-norm)
// h, f: [..., H]; y: [N·K, H] the experts' pair rows ([N, H] with r undefined); r: [N, K] f32.
// Returns {h', x}; copy as add_rms_norm's.
struct MoeNorms {
  at::Tensor dense, experts, ffn;  // [H] f32: the dense branch's post-norm, the expert sum's, the shared one
  at::Tensor scalar;               // [1] in h's dtype (the layer scalar), or undefined
};
std::pair<at::Tensor, at::Tensor> moe_residual(const at::Tensor& h, const at::Tensor& f, const at::Tensor& y,
                                               const at::Tensor& r, const MoeNorms& norms, const at::Tensor& w_next,
                                               const NormSpec& ns, const RowCopy* copy = nullptr);

// Work that may run beside the current stream: run(fn) issues fn's ops on a second CUDA stream
// that first waits for everything the current stream issued before; join() (or the destructor)
// makes the current stream wait for them. CUDA graphs capture the two as parallel paths, so
// latency-bound kernels (a router) hide behind bandwidth-bound ones (a dense MLP). Tensors fn
// makes are read on the current stream only after join(). Off CUDA, or while autograd records
// through `like`, fn runs in order on the current stream.
class SideBranch {
 public:
  explicit SideBranch(const at::Tensor& like);
  ~SideBranch();
  SideBranch(const SideBranch&) = delete;
  SideBranch& operator=(const SideBranch&) = delete;
  void run(const std::function<void()>& fn);
  void join();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;  // null: in order
};

// Asks the GPU to bring these tensors' bytes into L2 (at most 8 contiguous CUDA tensors; undefined
// ones skipped): one launch of bulk prefetch requests, a hint that nothing waits for. No-op off CUDA.
void prefetch_l2(const std::vector<at::Tensor>& tensors);

// A decode step's or block's kernels (a few rows) each read a few MB of weights and wait on DRAM
// latency: ahead(ts) issues prefetch_l2(ts) on a SideBranch forked at this point of the stream, so a
// layer's weights are in L2 by the time its kernels run when asked one layer ahead. The branches join
// when the object goes. Inactive (ahead does nothing) off CUDA, for more than kMaxRows rows, or with
// KAKEYA_PREFETCH=0 (a measurement's switch).
class L2Prefetch {
 public:
  static constexpr int64_t kMaxRows = 32;
  L2Prefetch(const at::Tensor& like, int64_t rows);
  bool active() const { return like_.defined(); }
  void ahead(const std::vector<at::Tensor>& tensors);

 private:
  at::Tensor like_;  // undefined: inactive
  std::vector<std::unique_ptr<SideBranch>> branches_;
};

// True when this build has the CUDA kernels (the two ops below have no CPU version:
// their reference is the unfused path of Model::forward).
bool cuda_kernels_available();

struct QKRopeArgs {
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  NormSpec norm;
  at::Tensor q_norm, k_norm;  // [D] f32, or undefined (no q/k norm)
  at::Tensor cos, sin;        // [P, rot] in the activation dtype
  int64_t ring = 0;           // slot = position mod ring (0: the whole cache, S); see KVCache::exact_slots
  // RestoreStore only (storing into a restored region, K/V only: num_heads 0): positions < sink
  // are not computed but copied from sink_k/sink_v (the layer's exact ring, the caches' strides)
  // at slot position mod sink_ring: attention sinks keep their exact K/V. sink 0: none.
  int64_t sink = 0, sink_ring = 0;
  at::Tensor sink_k, sink_v;  // [B, H_kv, >= sink_ring, D]
  // qk_norm_rope_store only (RestoreStore refuses them): Gemma 4's v_norm ([D] f32; undefined:
  // v stored as projected) and K=V layers (no v rows: V is the raw k head).
  at::Tensor v_norm;
  bool v_from_k = false;
};
// qkv: [B, T, (Hq + 2·Hkv)·D] contiguous ([B, T, (Hq + Hkv)·D] with v_from_k); positions: [T] int64.
// Writes normed+RoPE'd k and raw (v_norm: normed) v into k_cache/v_cache [B, H_kv, S, D] at slot
// = position mod ring (T <= ring <= S); returns normed+RoPE'd q: [B, T, Hq, D].
// The caches may be strided views (rows of D contiguous values), e.g. a restored region.
at::Tensor qk_norm_rope_store(const at::Tensor& qkv, const at::Tensor& positions, const QKRopeArgs& a,
                              at::Tensor& k_cache, at::Tensor& v_cache);

// ---- coded rows: K/V rows (restored regions, coded full-attention history) in a few bits ----
// Two kinds of code, each per row of D values (one position's K or V head):
//  Affine (int8, int6, int4): groups of kCodeGroup consecutive values, per group x ≈ min + scale · c
//    with c in 0 .. 2^bits - 1, scale = (max - min) / (2^bits - 1) and min kept in f16, c =
//    round_half_even((x - min) / scale) computed from the f16 values (0 where scale is 0).
//    Side values: (scale, min) per group, f16. D = 256 costs 160 bytes in 4 bits, 224 in 6 (bf16:
//    512). int6 codes are packed little-endian as the rotated ones are (value i at bits 6i ..
//    6i + 5), so rows of a multiple of 128 values (a lane's 32nd of the row in whole bytes).
//  Rotated (lm5, lm4, lm3, lm2): y = H·(s ⊙ x) / sqrt(D) (H the Sylvester Hadamard matrix, s the fixed
//    signs rotation_sign(i)), whose coordinates are close to N(0, |x|²/D) for any row; each
//    coordinate of u = y · sqrt(D) / |x| coded by the N(0,1) Lloyd-Max table of `bits` bits
//    (index of the nearest level); one f32 side value per row, the scale g = |x| / |c| (c the levels
//    of the row's indices), so the decoded row x̂ = s ⊙ H·(g · c) / sqrt(D) keeps the row's norm.
//    Attention needs no per-row rotation: q·x̂ = (H(s ⊙ q)/sqrt(D))·(g · c), and the value rows'
//    weighted sum is rotated back once. D = 256 costs 100 bytes in 3 bits. D a power of two.
//    Indices are packed little-endian: value i at bits i·b .. i·b + b - 1 of the row's bytes.
//  Uniform rotated (ru5, ru4, ru3, ru2): the rotated code with 2^bits evenly spaced levels, level i =
//    (i - (2^bits - 1)/2) · step(bits), the step that minimizes the N(0,1) error (0.188 at 5 bits): a
//    reader decodes a value with one multiply-add, where Lloyd-Max levels take a table lookup; at 5 bits
//    its error is about 1.4x lm5's (N(0,1): 0.0035 against 0.0025) and a third of int4's on cached rows.
//  Weighted rotated (pw5, pw4, pw3, pw2): the rotated code of K rows scaled per coordinate first,
//    w ⊙ x, read back as decoded / w (CodedSlots::k_weight; V rows are coded as lmB). The code's
//    error is spread evenly over the rotated coordinates, so w decides where it lands in x: a
//    score moves by q·Δk, and calibrated weights (calib/calibrate.h k_weights) put it where the
//    queries look least. Full-attention layers only (the weights are calibrated per layer).
//  Split (a rotated code + vC, e.g. pw5v3): K rows in the code's bits, V rows in C bits (lmC, or ruC
//    for a uniform code). A K error moves every score, a V error only its row's share of the output,
//    so bits serve K first: pw5v3 costs pw4's bytes.
// Both kinds: codes [..., code_bytes] uint8 and side [..., side_halves] f16 (the rotated kind's f32
// scale is stored as the two halves of its bytes: side.view(at::kFloat)).
constexpr int64_t kCodeGroup = 32;
enum class RowKind { Affine, Rotated };
struct RowCode {
  RowKind kind = RowKind::Affine;
  int bits = 0;           // 0: not coded
  bool weighted = false;  // rotated only: K rows coded as k_weight ⊙ x (pwB)
  bool uniform = false;   // rotated only: evenly spaced levels (ruB), else Lloyd-Max ones
  int v_bits = 0;         // rotated only: V rows' bits when they differ from K's (a split code); 0: bits
  bool defined() const { return bits > 0; }
  bool rotated() const { return kind == RowKind::Rotated; }
  bool split() const { return v_bits > 0; }
  // The code of K rows and of V rows (V rows are never weighted): what quantize_rows takes.
  RowCode k() const { return {kind, bits, weighted, uniform, 0}; }
  RowCode v() const { return {kind, split() ? v_bits : bits, false, uniform, 0}; }
  bool operator==(const RowCode& o) const {
    return kind == o.kind && bits == o.bits && weighted == o.weighted && uniform == o.uniform && v_bits == o.v_bits;
  }
};
// The codes' names for help texts and errors:
// "int8 | int6 | int4 | lm5 | lm4 | lm3 | lm2 | ru5 | ru4 | ru3 | ru2 | pw5 | pw4 | pw3 | pw2".
// A rotated name + "v2" .. "v5" is a split code (pw5v3).
const std::string& row_code_names();
bool is_row_code_name(const std::string& s);  // one of row_code_names(), or a split code
// "none" (undefined) or one of row_code_names(); `flag` names the option in errors.
RowCode parse_row_code(const std::string& s, const std::string& flag);
std::string row_code_name(const RowCode& c);  // "none" for an undefined code
// A code per layer over a default one: layer l takes layers[l] where that is defined, else `base`
// (a full-attention layer's own code: --full-code pw4+17=pw5v4).
inline const RowCode& layer_code(const RowCode& base, const std::vector<RowCode>& layers, int64_t l) {
  return l >= 0 && l < (int64_t)layers.size() && layers[l].defined() ? layers[l] : base;
}
// "CODE" or "CODE+L=CODE+...": the default code and the layers' own (a code name each, layers
// distinct); `flag` names the option in errors. Which layers may take a code is the caller's check.
std::pair<RowCode, std::vector<RowCode>> parse_layer_codes(const std::string& s, const std::string& flag);
std::string layer_codes_name(const RowCode& base, const std::vector<RowCode>& layers);  // the form parsed above
// Bytes of the codes / f16 halves of side values of one row of D values (a K row's for a split code:
// pass c.v() for V rows).
inline int64_t code_bytes(int64_t D, const RowCode& c) { return D * c.bits / 8; }
inline int64_t side_halves(int64_t D, const RowCode& c) { return c.rotated() ? 2 : D / kCodeGroup * 2; }
// Bytes of one position's K row and V row of D values in code c, codes and side values (a split
// code's two halves apart).
inline int64_t row_pair_bytes(int64_t D, const RowCode& c) {
  return code_bytes(D, c.k()) + code_bytes(D, c.v()) + 2 * (side_halves(D, c.k()) + side_halves(D, c.v()));
}
// Whether a rotated code fits the kernels' layout for rows of D values: the attention kernel gives
// each of a warp's 32 lanes D/32 values, whose codes are whole bytes and at most 8 (one 64-bit word),
// in K rows and (a split code) in V rows.
inline bool rotated_code_fits(int64_t D, const RowCode& c) {
  auto fits = [D](int bits) { return (D / 32) * bits % 8 == 0 && (D / 32) * bits <= 64; };
  return D >= 64 && D <= 512 && (D & (D - 1)) == 0 && fits(c.bits) && (!c.split() || fits(c.v_bits));
}
// Throws unless `c` can code rows of D values, both halves of a split code (`what` names the caller).
void check_row_code(int64_t D, const RowCode& c, const std::string& what);
// The rotation's sign of coordinate i (+1 or -1): a fixed hash of i, the same for every row.
inline float rotation_sign(int64_t i) { return ((uint32_t)i * 0x9E3779B1u) >> 31 ? -1.f : 1.f; }
// The levels of a rotated code, ascending: [2^bits] (bits 2 to 5): N(0,1) Lloyd-Max ones, or (uniform)
// evenly spaced ones, ((float)i - 0.5f·(2^bits - 1)) · uniform_step(bits) computed in float.
const std::vector<float>& rotated_levels(int bits, bool uniform = false);
float uniform_step(int bits);
// x [..., D] (any float dtype and device) -> {codes [..., code_bytes] uint8, side [..., side_halves] f16}.
// Not a split code: K rows take c.k(), V rows c.v().
std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const RowCode& c);
// codes, side as above -> [..., D] in dtype (computed in f32, then cast); not a split code.
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& side, const RowCode& c, at::ScalarType dtype);
// x [..., D] -> H·x / sqrt(D) along the last dim in f32 (butterflies of span 1, 2, 4, ... in that
// order, as the kernels compute it), D a power of two; the rotation is fwht(s ⊙ x), its inverse s ⊙ fwht(y).
at::Tensor fwht(const at::Tensor& x);

// A layer's coded region (KVCache: a restored region with RestorePolicy::region_code, or a coded
// full-attention layer's history with full_code): slot s >= ring of the layer (s - ring = row of the
// region) is read from here; the dense K/V hold the ring only.
struct CodedSlots {
  at::Tensor k_codes, v_codes;  // [B, H_kv, R, code_bytes(D, code.k() / code.v())] uint8
  at::Tensor k_side, v_side;    // [B, H_kv, R, side_halves(D, code)] f16
  RowCode code;                 // undefined: no coded region
  // [B, H_kv, D] f32, or undefined: rows are coded as x - mean and read as the decoded row + mean.
  // K rows share a large common part (most of their energy on full-attention layers), which a
  // row code would otherwise spend its bits on.
  at::Tensor k_mean, v_mean;
  // [B, H_kv, D] f32, or undefined; defined exactly when code.weighted (with the means): K rows are
  // coded as k_weight ⊙ (k - k_mean) and read as decoded / k_weight + k_mean.
  at::Tensor k_weight;
  bool defined() const { return code.defined(); }
  // Every tensor above, for what treats them alike (row views, byte counts).
  std::array<at::Tensor*, 7> tensors() { return {&k_codes, &v_codes, &k_side, &v_side, &k_mean, &v_mean, &k_weight}; }
  std::array<const at::Tensor*, 7> tensors() const {
    return {&k_codes, &v_codes, &k_side, &v_side, &k_mean, &v_mean, &k_weight};
  }
};

// Codes rows of a dense cache into coded rows: for each t, the K and V rows at slot src_slots[t]
// of k, v [B, H_kv, S, D] become row dst_rows[t] of `to` (what quantize_rows makes of them, less
// to.k_mean / v_mean when defined), in every row b — or row b's own src_slots[b, t] / dst_rows[b, t]
// when they are [B, T] (independent sequences, KVCacheOptions::rows);
// rows with dst_rows[t] < sink are also copied as they are to slot sink_slot0 + dst_rows[t] of
// k and v (a coded layer's exact attention sinks). src_slots, dst_rows: [T] int64 on the device.
// One launch on CUDA (the coded full-attention layers' store, once per forward); elsewhere the
// reference ops.
void code_rows(at::Tensor& k, at::Tensor& v, const at::Tensor& src_slots, const at::Tensor& dst_rows, CodedSlots& to,
               int64_t sink = 0, int64_t sink_slot0 = 0);

// Restoration's store for several layers in one launch (infer/restored.h): per layer, the
// K/V-only qk_norm_rope_store into its restored region (k normed + RoPE'd, v raw; positions
// < sink copied from its exact ring). Layers, buffers and tables are fixed at construction
// (their addresses go to the device once), so run() and copy() are one launch with no host work
// and CUDA graphs capture them. CUDA builds only; its reference is one qk_norm_rope_store per
// layer (copy(): the exact ring's rows, index_copy_'d or quantize_rows'd into the region).
class RestoreStore {
 public:
  struct Layer {
    int64_t k_src = 0, v_src = 0;  // column of the layer's head 0 in the raw k / v rows
    QKRopeArgs args;               // num_heads 0; k_norm, cos/sin, norm, ring, sink, sink_ring, sink_k/v
    at::Tensor k_cache, v_cache;   // [1, H_kv, S, D] the restored region (rows contiguous)
    CodedSlots codes;              // or, when defined, the region as coded rows (k_cache/v_cache unused):
                                   // each stored row is what quantize_rows makes of the dense one
  };
  // Every layer has the same H_kv, head dim, dtype, norm spec and sink.
  explicit RestoreStore(std::vector<Layer> layers);
  // k_raw: [N, Fk], v_raw: [N, Fv] raw rows, contiguous, in the caches' dtype; positions: [N] int64.
  void run(const at::Tensor& k_raw, const at::Tensor& v_raw, const at::Tensor& positions) const;
  // Every position copied from its layer's exact ring (args.sink_k/sink_v at position mod
  // sink_ring, which every layer then needs), as sinks are, through the region's code: exact
  // restoration, which keeps no raw rows. positions: [N] int64, N <= the smallest region ring.
  void copy(const at::Tensor& positions) const;

 private:
  std::vector<Layer> layers_;  // keeps alive what the descriptors point to
  at::Tensor desc_;            // per-layer descriptors on the device (bytes)
};

// Which copy of a position a query reads on a layer with restoration or coding
// (core/model/kv_cache.h): slot s sits either in the exact ring or among the older copies
// (in_restored[s]: a restored region, a coded layer's exact sinks and coded rows); the query
// at q reads a slot's copy iff the slot is in the exact ring exactly when q - p < window.
// in_restored undefined: a plain layer, every slot is read (the causal/sliding rule only).
struct CopyRule {
  at::Tensor in_restored;  // [S] bool, or undefined
  int64_t window = 0;
  int64_t code_from = 0;    // coded rows holding positions < this are hidden (a coded layer's exact sinks serve them)
  int64_t keep_below = -1;  // >= 0: restored-region slots holding positions >= this are hidden (a dropping layer)
  CodedSlots codes;         // the region stored as coded rows (undefined: as dense K/V)
};

// Attention of T queries per sequence over a cache whose slots carry absolute
// positions (split-K flash-decoding; decode steps, verify blocks, drafter blocks).
// q: [B, T, Hq, D]; k, v: [B, H_kv, S, D] ([B, H_kv, ring, D] when copies.codes holds the
// restored region's S - ring rows); slot_pos: [S] int64 (-1 empty);
// q_pos: [T] int64 on the device, or [1] shared by all T queries (a drafter block,
// whose queries all see up to the block's last position). Slot s is visible to query
// t iff 0 <= p = slot_pos[s] <= q_pos[t], (window == 0 or q_pos[t] - p < window) and
// the copy rule holds. window 0 = full attention; softcap 0 = none. Returns [B, T, Hq·D].
// tail: keys of the forward's own positions not written to the cache yet (a sliding layer's chunk
// longer than its ring lets it write first attends over [cache as it was ++ chunk]): slots S ..
// S + n - 1 after the cache's, exact (never in a restored region), the same rule otherwise.
struct AttnTail {
  at::Tensor k, v;  // [B, H_kv, n, D] dense rows, contiguous, q's dtype
  at::Tensor pos;   // [n] int64 on the device: the position row r holds
  bool defined() const { return k.defined(); }
};
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_pos,
                            const at::Tensor& q_pos, int64_t window, double scale, double softcap,
                            const CopyRule& copies = {}, const AttnTail& tail = {});

// ---- speculative blocks (infer/fused.h): a verify block's bookkeeping in one kernel each ----

// Greedy acceptance of a verify block. scores: [T, V] raw verifier scores (any monotone map of
// its logits: the argmax is the same); block: [T] int64 = [carried, d_1 .. d_{T-1}]. Writes
// report [T + 1] int64: post[i] = argmax of row i (the first of equal maxima), then
// n = 1 + the leading run of d_i == post[i - 1] (accepted drafts + the verifier's next token).
void greedy_accept(const at::Tensor& scores, const at::Tensor& block, at::Tensor& report);

// Greedy drafts: out[r] = map[argmax(scores[r])] (map undefined: the index itself), the first
// of equal maxima. scores: [..., V] (rows = the leading dims), map: [V] int64, out: [rows] int64
// contiguous (e.g. a slice of the next verify block).
void argmax_rows(const at::Tensor& scores, const at::Tensor& map, at::Tensor& out);

// A vocabulary head's int8 screen, the exact shortcut of linear_argmax on CUDA: row r's codes and
// scale (w_r ≈ scale_r·codes_r, the largest |w_r| at 127) and err_r, such that for any x the logit
// x·w_r as a kernel sums it in f32 lies within ||x||·err_r of scale_r·(x·codes_r) as the screen sums
// it (Cauchy-Schwarz on w_r - scale_r·codes_r, plus both sums' rounding over K terms). Only rows whose
// upper bound reaches the largest lower bound (~12 of Gemma 3's 262,144 a token) are summed again
// from w, so the step reads the int8 codes and a few rows instead of the whole head: the same token.
struct HeadScreen {
  at::Tensor codes;   // [V, K] int8
  at::Tensor scale;   // [V] f32
  at::Tensor err;     // [V] f32
  at::Tensor summed;  // [1] int32 on the head's device: rows summed exactly so far (a diagnostic)
  bool defined() const { return codes.defined(); }
};
// w: [V, K] in f32 or bf16 on any device; the screen lives beside it (computed in f64, 8,192 rows at a time).
HeadScreen make_head_screen(const at::Tensor& w);
// Every row's bounds on the logit x·w_r: (lower, upper), each [V] f32 (the screen kernel's, in ATen).
// x: [K].
std::pair<at::Tensor, at::Tensor> head_screen_bounds(const at::Tensor& x, const HeadScreen& screen);

// out[r] = argmax(linear(x[r], w)) with the logits in x's dtype (the first of equal maxima): a greedy
// step's lm_head. x: [..., K]; w: [V, K]; out: [rows] int64. On CUDA with one row the GEMV and its
// argmax in two kernels, no logits stored; with a screen (make_head_screen(w)) the screen, the
// exact sums of its candidates and their argmax in three, the same token.
void linear_argmax(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const HeadScreen* screen = nullptr);

// The draft block's input row of the carried token, written by advance_block: out = table[token]
// · scale in the table's dtype (Drafter::embed). table: [V, H]; out: [H] contiguous, same dtype.
struct CarriedEmbedding {
  at::Tensor table;
  double scale = 1.0;
  at::Tensor out;
};

// After a block of T tokens: with n = report[T], block[0] = report[n - 1] (the carried token),
// pos0 += n, qpos = pos0 + 0..T-1, and (emb given) emb->out = its embedding row. report: [T + 1],
// block: [1, T], pos0: [1], qpos: [T] int64.
void advance_block(const at::Tensor& report, at::Tensor& block, at::Tensor& pos0, at::Tensor& qpos,
                   const CarriedEmbedding* emb = nullptr);

// A KV cache's slot positions: dst[slot] = p for every p of positions ([T] int64, distinct slots),
// slot = p mod ring (ring > 0) or p. dst: [S] int64 contiguous. One kernel on CUDA (ATen took two,
// each ending the step's chain of early-launched kernels).
void store_positions(at::Tensor& dst, const at::Tensor& positions, int64_t ring);

// A decode step's bookkeeping once its token `next` ([1]) is chosen: out[step] = next, cur = next
// ([1, 1]), pos += 1, step += 1 (all int64 on one device; out: [capacity], step < capacity). One
// kernel on CUDA.
void advance_step(const at::Tensor& next, at::Tensor& out, at::Tensor& step, at::Tensor& cur, at::Tensor& pos);

// Rows of the concatenation of `parts` (each [..., H_i] with the same leading rows T): into
// out [.., T, ΣH] (if given) and into ring [R, ΣH] at rows pos mod R (if given; pos [T] int64).
void concat_rows(const std::vector<at::Tensor>& parts, at::Tensor* out, at::Tensor* ring, const at::Tensor& pos);

}  // namespace kakeya::ops
