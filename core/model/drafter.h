// DFlash block drafter (z-lab, arXiv 2602.06036; reference: the PyPI package
// `dflash`, dflash/model.py). A few Qwen3-style layers that draft a whole block
// of B-1 tokens in one forward, conditioned on the target's hidden states:
//
//   target layer outputs at ids L_1..L_n  ->  concat  ->  fc  ->  hidden_norm  =: c   [*, H]
//   per drafter layer: K_ctx = RoPE(k_norm(k_proj(c))), V_ctx = v_proj(c)  (kept in DrafterCache)
//   block [last token, MASK × (B-1)] -> target embedding × input_embedding_scale
//   -> layers (q/k/v of the block itself, attention over [K_ctx ++ K_block])
//   -> norm -> target lm_head × output_multiplier -> softcap  ->  B-1 draft logits
//
// The drafter owns no embedding or lm_head: it reads the target Model's
// (Model::embedding(), Model::lm_head()), so it is bound to one target at load
// time and every dimension is checked against it there.
//
// Attention inside the block is bidirectional on full-attention layers and
// causal (with window) on sliding layers, unless config.json's is_causal says
// otherwise; the context is always strictly before the block.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json_fwd.hpp>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/model/config.h"
#include "core/model/model.h"
#include "core/kernels/ops.h"
#include "core/model/rope.h"
#include "core/model/taps.h"

namespace kakeya {

// DFlash's default target layers for a drafter of `num_draft_layers` layers
// (dflash.model.build_target_layer_ids; Python's round-half-to-even included).
std::vector<int64_t> dflash_target_layer_ids(int64_t num_target_layers, int64_t num_draft_layers);

struct DrafterConfig {
  // The Qwen3-style decoder (config.json's top level, HF Qwen3Config fields).
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  RopeParams rope;
  int64_t max_position_embeddings = 32768;
  int64_t vocab_size = 0;                // 0 when absent; must equal the target's otherwise
  std::vector<LayerType> layer_types;    // [num_layers]
  // HF semantics: Qwen3Config keeps sliding_window only when use_sliding_window
  // is true; otherwise sliding layers are causal without a window (0).
  int64_t sliding_window = 0;
  std::optional<bool> is_causal;         // config.json "is_causal": overrides every layer's default
  // DFlash fields (dflash_config.* first, then the top level, as dflash's _draft_value).
  int64_t block_size = 16;
  int64_t num_target_layers = 0;         // 0 when absent
  std::vector<int64_t> target_layer_ids; // decoder-layer *outputs* of the target (HF hidden_states[id + 1])
  bool target_layer_ids_derived = false; // true: not in the file, derived by dflash_target_layer_ids
  int64_t mask_token_id = -1;
  double input_embedding_scale = 1.0;    // Gemma targets: sqrt(hidden), what published drafters were trained with
  double output_multiplier = 1.0;
  std::optional<double> final_logit_softcap;  // applied to draft logits (Gemma: the target's 30.0 when it has one)
  std::string origin;                    // file the config came from, for error messages

  static DrafterConfig from_json(const nlohmann::json& j, const std::string& origin);
  static DrafterConfig from_file(const std::string& path);  // <dir>/config.json
  // z-lab layout: HF Qwen3Config fields + block_size + num_target_layers + dflash_config{...},
  // architectures ["DFlashDraftModel"], so dflash's DFlashDraftModel.from_pretrained reads it.
  nlohmann::json to_json() const;

  // A new drafter for `target` (what train-drafter starts from): hidden size,
  // vocab, RoPE of the target's full-attention layers; derived target layers;
  // Gemma targets get input_embedding_scale = sqrt(hidden) and the target's softcap.
  static DrafterConfig for_target(const ModelConfig& target, int64_t num_layers, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                                  int64_t block_size, int64_t mask_token_id);

  bool is_sliding(int64_t layer) const { return layer_types[layer] == LayerType::Sliding; }
  bool causal(int64_t layer) const { return is_causal.value_or(is_sliding(layer)); }
  int64_t window(int64_t layer) const { return is_sliding(layer) ? sliding_window : 0; }  // 0 = unbounded
  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  int64_t num_features() const { return (int64_t)target_layer_ids.size(); }
  // Load-time checks against the target: hidden size (the drafter reads the
  // target's embedding and lm_head), vocab, mask token, layer ids, num_target_layers.
  // Errors name origin and the field.
  void check_target(const ModelConfig& target) const;
};

// One drafter layer (z-lab names in comments). Norm weights are plain w
// (Qwen3RMSNorm: w · x̂ in the compute dtype).
// The projections that read the same input are stored concatenated (qkv, gate_up)
// so the CUDA block path runs one GEMM each; the z-lab tensors are row views into
// them (no extra bytes; the trainer's in-place updates reach both). Every layer's
// qkv is itself a slice of one tensor (Drafter::context_raw_kv_rows: all layers in one GEMM).
struct DrafterLayer {
  at::Tensor qkv;         // [(Hq + 2·Hkv)·D, H]  q_proj; k_proj; v_proj (slice l of Drafter::qkv_all_)
  at::Tensor kv;          // [2·Hkv·D, H]   k_proj; v_proj: rows of qkv (context K/V in one GEMM)
  at::Tensor gate_up;     // [2·I, H]       gate_proj; up_proj
  at::Tensor q_proj;      // [Hq·D, H]      self_attn.q_proj.weight (view of qkv)
  at::Tensor k_proj;      // [Hkv·D, H]     self_attn.k_proj.weight (view of qkv)
  at::Tensor v_proj;      // [Hkv·D, H]     self_attn.v_proj.weight (view of qkv)
  at::Tensor o_proj;      // [H, Hq·D]      self_attn.o_proj.weight
  at::Tensor q_norm;      // [D]            self_attn.q_norm.weight
  at::Tensor k_norm;      // [D]            self_attn.k_norm.weight
  at::Tensor input_norm;  // [H]            input_layernorm.weight
  at::Tensor post_norm;   // [H]            post_attention_layernorm.weight
  at::Tensor gate_proj;   // [I, H]         mlp.gate_proj.weight (view of gate_up)
  at::Tensor up_proj;     // [I, H]         mlp.up_proj.weight (view of gate_up)
  at::Tensor down_proj;   // [H, I]         mlp.down_proj.weight
  // The norm weights in f32, as core/kernels/ops.h's kernels take them (ops::NormSpec
  // unit_offset=false: cast x̂, ×w in the dtype, which is Qwen3RMSNorm exactly).
  // The same tensors as above on an f32 drafter (the one dtype the trainer
  // updates); copies taken at load otherwise.
  at::Tensor q_norm32, k_norm32, input_norm32, post_norm32;  // [D], [D], [H], [H] f32
};

struct DrafterOptions {
  // Parameter dtype/device; default (nullopt): the target's. Training uses f32.
  std::optional<at::ScalarType> dtype;
  std::optional<at::Device> device;
  int64_t max_positions = 0;  // RoPE table length; 0: the target's
  bool draft_vocab = true;    // load <dir>/draft_vocab.safetensors when present (false: the whole vocabulary)
};

// Per-layer K/V of the committed context (post-k_norm, RoPE'd K and raw V, as
// the attention reads them). Linear buffers: slot i holds position i. Only
// committed positions are ever written (the block's own K/V are never stored),
// so "crop after each block" is implicit; truncate() exists for callers that
// roll committed tokens back.
class DrafterCache {
 public:
  DrafterCache() = default;
  DrafterCache(const DrafterConfig& cfg, int64_t batch, int64_t capacity, at::ScalarType dtype, at::Device device);
  int64_t length() const { return length_; }
  int64_t capacity() const { return k_.empty() ? 0 : k_[0].size(2); }
  void truncate(int64_t n);
  const at::Tensor& keys(int64_t layer) const { return k_[layer]; }    // [B, H_kv, capacity, D]
  const at::Tensor& values(int64_t layer) const { return v_[layer]; }  // [B, H_kv, capacity, D]
  int64_t bytes() const;

 private:
  friend class Drafter;
  std::vector<at::Tensor> k_, v_;  // per layer [B, H_kv, capacity, D]
  int64_t length_ = 0;
};

// Collects the target's hidden states at the drafter's layer ids during any
// target forward (Tap::LayerOut), so the verify forward itself yields the
// drafter's context features: no second target pass.
class TargetFeatureCapture : public TapSubscriber {
 public:
  TargetFeatureCapture(const Model& target, std::vector<int64_t> layer_ids);
  TargetFeatureCapture(const TargetFeatureCapture&) = delete;  // taps_ holds `this`
  TargetFeatureCapture& operator=(const TargetFeatureCapture&) = delete;
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override;
  bool reads(Tap tap) const override { return tap == Tap::LayerOut; }
  // [B, T, n·H] in the target dtype, ids in config order. HF's hidden_states
  // puts the final-normed output at the last layer; an id naming the last layer
  // gets the same. Clears what was captured.
  at::Tensor take();
  // The same rows written where they are read, without an intermediate tensor (one kernel on
  // CUDA, core/kernels/ops.h concat_rows): into out [B, T, n·H] if given, and into ring [R, n·H] at
  // rows positions [T] mod R if given. Clears what was captured.
  void take_into(at::Tensor* out, at::Tensor* ring, const at::Tensor& positions);
  void clear();  // drops what was captured (a new session)
  // Store mode: the forward writes each captured layer's rows straight into ring [R, n·H] (row
  // position mod R, core/model/taps.h TapSubscriber::store), except a last-layer id (its feature is final-normed
  // afterwards). stores_all(): every id is written that way (nothing left for take_into).
  // ring_rows [N] int64 (device), when given: the ring row of each of the forward's N = B·T rows
  // instead (several sequences sharing one ring, each in its own rows: a batch of sessions).
  void store_into(at::Tensor ring, at::Tensor ring_rows = {});
  bool stores_all() const;
  bool store(Tap tap, int64_t layer, ops::RowCopy* out) const override;
  const Taps& taps() const { return taps_; }

 private:
  std::vector<at::Tensor> parts();  // per id [B, T, H] in config order (final-normed at the last layer); clears

  const Model& target_;
  std::vector<int64_t> ids_;
  std::vector<at::Tensor> got_;  // per id: [B, T, H]
  at::Tensor ring_;              // store mode: [R, n·H], or undefined
  at::Tensor ring_rows_;         // store mode: [N] ring rows of the forward's rows, or undefined (positions mod R)
  Taps taps_;
};

class Drafter {
 public:
  // Loads <dir>/config.json + safetensors (z-lab names; an optional "model."
  // prefix is accepted) and binds the drafter to `target`. Every mismatch is an
  // error naming the file and the field or tensor.
  static Drafter load(const std::string& dir, const Model& target, const DrafterOptions& opt = {});
  // Fresh weights (HF Qwen3 init: linear ~ N(0, 0.02), norms 1), seeded.
  static Drafter random(const DrafterConfig& cfg, const Model& target, uint64_t seed, const DrafterOptions& opt = {});
  // <dir>/config.json + <dir>/model.safetensors (z-lab names) in `dtype`, atomically per file
  // (and <dir>/draft_vocab.safetensors when the drafter has a draft vocabulary).
  void save(const std::string& dir, at::ScalarType dtype = at::kBFloat16,
            const std::map<std::string, std::string>& metadata = {}) const;

  const DrafterConfig& config() const { return cfg_; }
  at::ScalarType dtype() const { return dtype_; }
  at::Device device() const { return device_; }
  const Model& target() const { return *target_; }
  int64_t num_parameters() const;
  // Bytes the drafter's weights occupy on its device: the parameters (the concatenated
  // qkv/gate_up share their storage), the f32 norm copies of a non-f32 drafter and the
  // draft vocabulary's head rows.
  int64_t weight_bytes() const;
  // z-lab name -> tensor (handles share storage with the drafter: the trainer
  // sets requires_grad and updates them in place).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  // ---- pieces (shared by decoding and training, so nothing forks the math) ----
  // target_hidden: [B, T, n·H] -> context c: [B, T, H] (fc, hidden_norm), in the drafter dtype.
  at::Tensor project_context(const at::Tensor& target_hidden) const;
  // c: [B, T, H] at positions [T] -> per layer {K [B, H_kv, T, D] (k_norm, RoPE), V [B, H_kv, T, D]}.
  // Taps (if any) see KProj/KNorm/VProj/VNorm [B, T, H_kv, D] at these positions: f_θ trains on them.
  std::vector<std::pair<at::Tensor, at::Tensor>> context_kv(const at::Tensor& c, const at::Tensor& positions,
                                                            const Taps* taps = nullptr) const;
  // Only the raw part of context_kv, what f_θ reads: per layer {k_proj(c), v_proj(c)} [B, T, H_kv, D]
  // (after the KProj/VProj taps, which see them as context_kv's do). Restoration projects
  // the drafter context with it: k_norm and RoPE would be computed for nobody.
  std::vector<std::pair<at::Tensor, at::Tensor>> context_raw_kv(const at::Tensor& c, const at::Tensor& positions,
                                                                const Taps* taps = nullptr) const;
  // The same raw K/V of every layer from ONE GEMM over all layers' qkv rows (the q rows are
  // computed and dropped: one launch instead of 2·layers, which is what restoration batches
  // pay for). c: [B, T, H] -> {K, V}: [B, T, L_d, H_kv, D] strided views of the GEMM output.
  // No taps, no autograd through the z-lab tensors: inference only (training uses the above).
  std::pair<at::Tensor, at::Tensor> context_raw_kv_rows(const at::Tensor& c) const;
  // The same K/V written into a context cache at slot = position: k_cache/v_cache per
  // layer [B, H_kv, S, D]; positions [T] < S. On CUDA (batch 1, no subscriber reading
  // KNorm/VNorm) one k|v GEMM and the fused norm + RoPE + store kernel per layer; taps
  // still see KProj/VProj (a replaced tensor is what gets stored).
  void store_context(const at::Tensor& c, const at::Tensor& positions, std::vector<at::Tensor>& k_cache,
                     std::vector<at::Tensor>& v_cache, const Taps* taps = nullptr) const;
  // ids: [B, T] -> target embedding × input_embedding_scale: [B, T, H] in the drafter dtype.
  at::Tensor embed(const at::Tensor& ids) const;
  // Block forward. x: [B, T, H] embedded block; q_pos: [T] or [B, T] absolute positions;
  // ctx_k/ctx_v: per layer [B, H_kv, C, D]; masks: [T, C+T] or [B, T, C+T] bool
  // (true = visible) per layer, or undefined for "all visible".
  // Returns final-normed hidden [B, T, H].
  at::Tensor forward_block(const at::Tensor& x, const at::Tensor& q_pos, const std::vector<at::Tensor>& ctx_k,
                           const std::vector<at::Tensor>& ctx_v, const std::vector<at::Tensor>& masks) const;
  // The same block forward on CUDA with the fused kernels of core/kernels/ops.h, O(block) per
  // layer: the block's K/V are stored into the context cache itself (slot = position)
  // and one attention kernel reads the cache, every slot at position <= last_pos
  // visible to every query (no masks, no concatenation of the context). So it needs
  // every layer full-attention and non-causal (block_in_cache_supported()), and the
  // caller guarantees slots [0, q_pos[0]) hold the committed context's K/V; slots
  // past last_pos may hold anything. x: [1, T, H] embedded block; q_pos: [T] int64
  // consecutive positions; last_pos: [1] int64 = q_pos[T-1] (device tensors, so a
  // CUDA graph can replay it at moving positions); ctx_k/ctx_v: per layer
  // [1, H_kv, S, D], written at the block's T slots; slot_pos: [S] int64 = 0..S-1.
  // Returns final-normed hidden [1, T, H].
  at::Tensor forward_block_in_cache(const at::Tensor& x, const at::Tensor& q_pos, const at::Tensor& last_pos,
                                    std::vector<at::Tensor>& ctx_k, std::vector<at::Tensor>& ctx_v,
                                    const at::Tensor& slot_pos) const;
  // True when forward_block_in_cache can run: a CUDA build, a CUDA drafter in f32 or
  // bf16, a head dim the attention kernel has (64/128/256/512), and every layer
  // full-attention and non-causal (the shipped DFlash drafters).
  bool block_in_cache_supported() const;
  // hidden [B, T, H] -> draft logits [B, T, V] f32 (target lm_head, × output_multiplier, softcap).
  at::Tensor logits(const at::Tensor& hidden) const;
  // hidden [B, T, H] -> greedy draft tokens [B, T] int64: logits().argmax(-1) up to rounding
  // ties, from the head's raw scores (multiplier and softcap are monotone); with a draft
  // vocabulary, the argmax over its tokens only.
  at::Tensor draft_tokens(const at::Tensor& hidden) const;
  // The same written into out ([B·T] int64 contiguous, e.g. a slice of a verify block): the
  // head's scores, then one argmax through the draft vocabulary (core/kernels/ops.h argmax_rows).
  void draft_tokens_into(const at::Tensor& hidden, at::Tensor& out) const;
  // FR-Spec (arXiv 2502.14856): greedy drafts from a frequency-ranked subset of the
  // vocabulary. The head then reads K of the target's V lm_head rows — on Gemma 3 (V = 262k)
  // the head is most of a draft's memory traffic. A token outside the subset is never
  // drafted; the verifier still picks from the whole vocabulary, so output is unchanged and
  // only τ can drop. Sampling (Drafter::logits) keeps the whole vocabulary.
  // ids: [K] int64, distinct, in [0, V); origin names the source in errors. Undefined: none.
  void set_draft_vocab(const at::Tensor& ids, const std::string& origin);
  const at::Tensor& draft_vocab() const { return vocab_ids_; }  // [K] int64 on the device, or undefined
  static constexpr const char* kDraftVocabFile = "draft_vocab.safetensors";  // tensor "ids" [K] int64
  // Visibility of keys at k_pos [S] (or [B, S]) to queries at q_pos [T] (or [B, T]) on one layer,
  // DFlash's rule on absolute positions: [T, S] (or [B, T, S]) bool.
  at::Tensor layer_mask(int64_t layer, const at::Tensor& q_pos, const at::Tensor& k_pos) const;

  // ---- decoding with a context cache ----
  DrafterCache make_cache(int64_t capacity, int64_t batch = 1) const;
  // Appends committed positions [cache.length(), +T): target_hidden [B, T, n·H] from TargetFeatureCapture.
  void extend(DrafterCache& cache, const at::Tensor& target_hidden, const Taps* taps = nullptr) const;
  // One draft step. block_ids: [B, T] = [last committed token, MASK × (T-1)] at
  // positions cache.length() .. + T. Returns draft logits [B, T-1, V] f32 for positions 1..T-1.
  at::Tensor draft(const DrafterCache& cache, const at::Tensor& block_ids) const;

 private:
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const;
  // rms_norm through ops::rms_norm (the fused kernel) when kernels(), the reference above
  // otherwise. w: [N] in the drafter dtype; w32: the same in f32.
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w32) const;
  // A CUDA drafter in a build with the kernels, in a dtype they take (f32, bf16), and not
  // in training (the kernels have no autograd).
  bool kernels() const;
  // The fused q/k-norm + RoPE + store kernel's arguments for this drafter (q/k norm
  // weights set per layer by the caller); num_heads 0 stores K/V only.
  ops::QKRopeArgs rope_args(int64_t num_heads) const;
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) const;
  void check_shapes(const std::string& origin) const;
  // Moves `w` (z-lab names -> tensors) to the drafter's device/dtype and binds it to `target`.
  static Drafter assemble(const DrafterConfig& cfg, const Model& target, const DrafterOptions& opt,
                          std::map<std::string, at::Tensor>& w);

  DrafterConfig cfg_;
  const Model* target_ = nullptr;
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  at::Tensor fc_;           // [H, n·H]
  at::Tensor hidden_norm_;  // [H]
  at::Tensor norm_;         // [H]
  at::Tensor hidden_norm32_, norm32_;  // [H] f32 (see DrafterLayer::q_norm32)
  std::vector<DrafterLayer> layers_;
  at::Tensor qkv_all_;  // [L_d, (Hq + 2·Hkv)·D, H]: every layer's qkv (DrafterLayer::qkv = qkv_all_[l])
  RopeTable rope_;
  at::Tensor vocab_ids_;  // [K] int64: the draft vocabulary (undefined: the whole vocabulary)
  at::Tensor head_sub_;   // [K, H] the target lm_head's rows of vocab_ids_, in the head's dtype
};

}  // namespace kakeya
