// The decoder stack for every supported family (Gemma 3, Gemma 4 dense, MoE and
// E2B/E4B style, Qwen 3, Llama): one flat forward loop, family differences carried by
// ModelConfig flags and per-layer vectors. Matches HF transformers op for op
// (tests/test_model_parity.cpp), so f32 logits agree to ~1e-5.
#pragma once
#include <functional>
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/model/config.h"
#include "core/model/kv_cache.h"
#include "core/kernels/ops.h"
#include "core/model/moe.h"
#include "core/model/rope.h"
#include "core/io/safetensors.h"
#include "core/model/taps.h"

namespace kakeya {

struct ModelOptions {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // f32 or bf16 (CUDA: bf16)
  int64_t max_positions = 8192;       // RoPE table length; sessions need capacity <= this
  // CUDA: keep an int8 screen of the lm_head (ops::HeadScreen, about half the head's bytes again) so
  // a greedy step reads the codes and a few exact rows instead of the whole head: the same tokens.
  // Not for models with a final softcap (their argmax is of the capped logits). Opt-in: on the H200 it
  // made AR decode only 1.0% faster for 170 MB more (bench/results/README.md, stop 66).
  bool head_screen = false;
};

struct ForwardOptions {
  bool last_logits_only = false;  // logits of the last position only: [B, 1, V]
  bool skip_logits = false;       // no lm_head (prefill whose logits nobody reads)
  // The lm_head's scores as they come, in the model dtype: no softcap, no f32 cast. Any
  // monotone map of the logits, so they serve an argmax (greedy verification) unchanged.
  bool raw_logits = false;
  // The greedy tokens instead of logits: [B, T] ([B, 1] with last_logits_only) int64, the argmax
  // of the logits (the first of equal maxima); on CUDA for one row the lm_head's fused argmax
  // (ops::linear_argmax: no logits stored).
  bool argmax = false;
  bool full_head = false;  // the argmax reads the whole head even when the model has a screen (a baseline)
  const Taps* taps = nullptr;
  bool advance_cache = true;      // false: caller commits (CUDA-graph capture runs the host code once)
};

struct LayerWeights {
  // kvd = kv_heads(l)·D. K=V layers (Gemma 4 full layers with attention_k_eq_v) have no v_proj:
  // their qkv (and bias) holds only the q and k rows, and V is the raw k projection. KV-shared
  // layers (Gemma 4 num_kv_shared_layers) have only q rows and no k_norm.
  at::Tensor qkv;        // [q_dim + 2·kvd, hidden] fused q/k/v projections ([q_dim + kvd, hidden] for K=V layers)
  at::Tensor qkv_bias;   // [q_dim + 2·kvd] ([q_dim + kvd] for K=V) or undefined
  at::Tensor o;          // [hidden, q_dim]
  at::Tensor o_bias;     // [hidden] or undefined
  // Norm weights are f32 (ops.h): Gemma 3's 1+w folded in, or Gemma 4/Llama/Qwen's w rounded to the model dtype.
  at::Tensor q_norm, k_norm;  // [D]
  at::Tensor v_norm;          // [D] f32 ones (Gemma 4: RMSNorm without weight) or undefined
  at::Tensor attn_norm;       // [hidden] input_layernorm
  at::Tensor post_attn_norm;  // [hidden] Gemma sandwich only
  at::Tensor ffn_norm;        // [hidden] pre-FFN norm
  at::Tensor post_ffn_norm;   // [hidden] Gemma sandwich only
  at::Tensor gate_up;         // [2·intermediate, hidden] fused gate/up
  at::Tensor down;            // [hidden, intermediate]
  at::Tensor gate_up_bias, down_bias;
  at::Tensor layer_scalar;    // [1] model dtype (Gemma 4: residual stream ×= it after the layer), undefined if 1
  MoeWeights moe;             // Gemma 4 MoE: the expert branch beside the dense MLP (undefined without)
  // Gemma 4 per-layer inputs (undefined without): h += norm(proj(act(gate(h)) · per-layer input)).
  at::Tensor ple_gate;        // [P, hidden] per_layer_input_gate
  at::Tensor ple_proj;        // [hidden, P] per_layer_projection
  at::Tensor ple_norm;        // [hidden] f32 post_per_layer_input_norm
};

// Where a model's tensors come from, by checkpoint name: a checkpoint's TensorStore (Model::load)
// or generated weights (core/model/random_weights.h). get() checks or produces the shape.
struct WeightSource {
  std::string origin;  // for errors: the directory, or the generator
  std::function<bool(const std::string&)> has;
  std::function<at::Tensor(const std::string&, at::IntArrayRef)> get;  // on any device, any float dtype
};

class Model {
 public:
  // Loads config.json + safetensors from an HF model directory. Every missing or
  // mis-shaped tensor is an error naming the file and tensor.
  static Model load(const std::string& dir, const ModelOptions& opt = {});
  // Random weights of the config's shape, drawn on opt.device (core/model/random_weights.h).
  static Model random(const ModelConfig& cfg, uint64_t seed, const ModelOptions& opt = {});
  static Model from_weights(const ModelConfig& cfg, const WeightSource& src, const ModelOptions& opt);

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opt_; }
  at::Device device() const { return opt_.device; }
  at::ScalarType dtype() const { return opt_.dtype; }
  // A cache for this model's forwards: `capacity` positions (a row), `batch` rows, `rollback`
  // tokens truncate() may take back (0: none), in the model's dtype and on its device.
  KVCacheOptions cache_options(int64_t capacity, int64_t batch = 1, int64_t rollback = 0) const {
    KVCacheOptions co;
    co.batch = batch;
    co.capacity = capacity;
    co.rollback = rollback;
    co.dtype = dtype();
    co.device = device();
    return co;
  }
  int64_t weight_bytes() const;
  // The weight bytes one decode step reads: weight_bytes() less the experts a token does not
  // select (top_k of num_experts per MoE layer); = weight_bytes() for dense models.
  int64_t active_weight_bytes() const;

  // ids: [B, T] int64; positions: [T] int64 (absolute, on the model device),
  // consecutive from cache.length(). Writes K/V into `cache` and advances it.
  // Returns logits [B, T, V] f32 (or [B, 1, V] / raw scores / undefined per options).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, KVCache& cache,
                     const ForwardOptions& fo = {}) const;
  // Same with positions = cache.length() .. + T.
  at::Tensor forward(const at::Tensor& ids, KVCache& cache, const ForwardOptions& fo = {}) const;

  // Pieces of the layer that restoration and training reuse, so nothing forks the forward:
  // k, v raw [B, T, H_kv, D] -> post-norm k (RoPE'd) and v (v-normed) as the cache stores them,
  // [B, H_kv, T, D]. On K=V layers pass v_raw = k_raw.
  std::pair<at::Tensor, at::Tensor> finish_kv(int64_t layer, const at::Tensor& k_raw, const at::Tensor& v_raw,
                                              const at::Tensor& positions) const;
  // Gemma 4 per-layer inputs of ids [B, T] with embeds = the scaled embeddings of ids ([B, T, hidden]): [B, T, num_layers, P].
  at::Tensor per_layer_inputs(const at::Tensor& ids, const at::Tensor& embeds) const;
  at::Tensor logits(const at::Tensor& hidden) const;    // [B, T, hidden] final-normed -> [B, T, V] f32
  at::Tensor final_norm(const at::Tensor& h) const;     // [B, T, hidden]
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const { return ops::rms_norm(x, w, norm_spec_); }
  const LayerWeights& layer(int64_t l) const { return layers_[l]; }
  const at::Tensor& embedding() const { return embed_; }  // [V, hidden]
  const at::Tensor& lm_head() const { return lm_head_; }  // [V, hidden] raw output head (no softcap; = embedding() when tied)
  const ops::HeadScreen& head_screen() const { return head_screen_; }  // undefined without (ModelOptions::head_screen)
  int64_t head_screen_bytes() const;  // its device bytes (not in weight_bytes: the bound's bytes are the model's)
  const RopeTable& rope(int64_t layer) const { return cfg_.is_sliding(layer) ? rope_sliding_ : rope_full_; }
  // The fused q/k-norm + RoPE + store kernel's arguments for layer l (core/kernels/ops.h): its
  // norms and RoPE table, `num_heads` query heads (0: K/V only), slot = position mod ring.
  // The forward stores through it; restoration writes restored K/V with it.
  ops::QKRopeArgs rope_args(int64_t layer, int64_t num_heads, int64_t ring) const;
  // q raw [B, T, H_q, D] -> q_norm'd and RoPE'd [B, T, H_q, D], as the forward feeds attention().
  at::Tensor finish_q(int64_t layer, const at::Tensor& q_raw, const at::Tensor& positions) const;
  // Causal (+ window on sliding layers) visibility of keys at k_pos [S] to queries at q_pos [T]: [T, S] bool.
  at::Tensor layer_mask(int64_t layer, const at::Tensor& k_pos, const at::Tensor& q_pos) const;
  // The layer's attention (GQA, scale, softcap): q [B, T, H_q, D]; k, v [B, H_kv, S, D];
  // mask [T, S] bool (true = visible) -> [B, T, H_q·D], before o_proj. Differentiable.
  at::Tensor attention(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& mask) const;

 private:
  ModelConfig cfg_;
  ModelOptions opt_;
  ops::NormSpec norm_spec_;
  at::Tensor embed_;     // [V, hidden]
  at::Tensor lm_head_;   // [V, hidden] (= embed_ when tied)
  ops::HeadScreen head_screen_;  // of lm_head_, CUDA greedy steps (ModelOptions::head_screen)
  at::Tensor norm_;      // [hidden]
  at::Tensor embed_scale_;  // scalar in dtype
  // Gemma 4 per-layer inputs (undefined without):
  at::Tensor ple_embed_;        // [V_ple, num_layers·P] embed_tokens_per_layer
  at::Tensor ple_embed_scale_;  // scalar in dtype: sqrt(P)
  at::Tensor ple_model_proj_;   // [num_layers·P, hidden] per_layer_model_projection
  at::Tensor ple_proj_norm_;    // [P] f32 per_layer_projection_norm
  std::vector<LayerWeights> layers_;
  RopeTable rope_full_, rope_sliding_;
};

}  // namespace kakeya
