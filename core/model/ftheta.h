// f_θ: what the drafter knows of a position -> the verifier's raw K/V there
// (seeds: inference_engine/v04/f_theta.py, FThetaProjection). Two independent
// paths, one for K and one for V ("different downstream roles"), each
//
//   x = the path's input row                                [N, in]
//   z = x · E^T + e                                        [N, r]   shared low-rank encoder
//   y_l = z · W_l^T + b_l  for every verifier layer l      [N, H_kv(l)·D(l)]   one decoder per layer
//
// With FThetaConfig::mlp_hidden = h > 0 each path also has a nonlinear branch beside the code:
//
//   y += gelu(x · F1^T + f1) · F2^T                         [N, h] -> [N, k_out | v_out]
//
// The low-rank code is near the best LINEAR map of its input already; the branch is what a
// nonlinear f_θ adds. F2 starts at zero (add_mlp), so a linear f_θ given a branch predicts what it
// did before, and training starts from it.
//
// Two inputs (FThetaConfig::input):
//   drafter_kv       the seeds' input: the drafter's raw context K (K path), resp. V (V path),
//                    concatenated over drafter layers, [N, L_d·H_d·D_d]. Each drafter layer's
//                    raw K/V is a 64-wide projection of one 640-wide context row, itself a
//                    projection of the verifier's hidden states: the K path never sees what
//                    the V projections kept, and most of the verifier's state is gone.
//   target_features  what the drafter itself reads per position: the verifier's hidden states
//                    at the drafter's target layers, [N, n·H], each layer's row RMS-normalised
//                    (no weight) so that every verifier layer whose input is a tapped layer's
//                    output has its raw K and V exactly linear in x (Gemma's input norm is a
//                    per-position scale times a fixed weight). Both paths read the same x.
// tools/ftheta_capacity.py measures the best linear error of each input on held-out text.
//
// Exact layers (target_features only; FTheta::add_exact_layers): a verifier layer whose input
// is a tapped layer's output has its raw K and V exactly linear in that tapped row, so f_θ
// computes them in closed form instead of through the shared low-rank code:
//   y_l = x_i · A_l^T + c_l    A_l = the layer's K (resp. V) projection rows · its input norm's
//                              weight [H_kv(l)·D(l), H],   x_i = the RMS-normalised row of
//                              feature i (feature_layers[i] = l - 1)
// A_l and c_l are the verifier's own weights, stored beside the learned tensors and never
// trained (named_parameters() leaves them out); they replace the learned decoder's rows of
// layer l. The learned code ignored this structure: on the shipped f_θ these layers had
// relative K errors of 0.34-1.19, as large as on the layers no closed form reaches.
//
// The per-layer decoders are stored as one fused matrix (rows of layer l at
// offset Σ_{j<l} H_kv(j)·D(j)) so a prediction is two GEMMs whatever the layer
// count; head dims and KV heads may differ per layer (Gemma 4's global layers).
// Biases everywhere (the prototype used nn.Linear, whose default has them), and
// nn.Linear's init: U(-1/√fan_in, 1/√fan_in) for weights and biases.
//
// Outputs are RAW verifier K/V: before k_norm/v_norm and before RoPE, i.e. what
// Tap::KProj / Tap::VProj see; Model::finish_kv turns them into cache entries.
// On K=V layers (Gemma 4 full layers without v_proj: V is the raw K projection)
// there is no V decoder: V is the K path's prediction, as in the verifier.
//
// Checkpoint directory: f_theta_config.json (FThetaConfig::to_json) +
// f_theta.safetensors with tensors
//   k.encoder.weight [r, in]  k.encoder.bias [r]
//   k.decoder.weight [Σ_l H_kv(l)·D(l), r]  k.decoder.bias [Σ_l H_kv(l)·D(l)]
//   v.* the same, the V decoder without the rows of K=V layers.
//   with a nonlinear branch also k.mlp.fc1.weight [h, in]  k.mlp.fc1.bias [h]  k.mlp.fc2.weight [k_out, h]
//   (v.mlp.* the same with v_out);
//   with exact layers also k.exact.weight [Σ_e H_kv(e)·D(e), H]  k.exact.bias [Σ_e H_kv(e)·D(e)]
//   (e over exact_layers, in order) and v.exact.* the same over exact layers with a V decoder.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/model/config.h"
#include "core/model/drafter.h"
#include "core/model/model.h"

namespace kakeya {

constexpr const char* kFThetaFormat = "kakeya-ftheta/1";

enum class FThetaInput { DrafterKV, TargetFeatures };
const char* ftheta_input_name(FThetaInput i);             // "drafter_kv" | "target_features"
FThetaInput parse_ftheta_input(const std::string& name);  // throws naming the choices

struct FThetaConfig {
  int64_t rank = 256;                       // shared low-rank encoder width r
  // Width h of the nonlinear branch (0: none). JSON "mlp_hidden", absent in configs written before it (0).
  int64_t mlp_hidden = 0;
  FThetaInput input = FThetaInput::DrafterKV;
  // Drafter side (DrafterKV input): the input is [N, drafter_layers, drafter_kv_heads, drafter_head_dim].
  int64_t drafter_layers = 0, drafter_kv_heads = 0, drafter_head_dim = 0;
  // TargetFeatures input: [N, feature_layers.size() · hidden], the verifier's hidden states at
  // these layers (the drafter's target_layer_ids, in its order).
  std::vector<int64_t> feature_layers;
  int64_t hidden = 0;
  // Verifier layers where restoring measured better than dropping the restored positions
  // (train/ftheta_select.h; RestoreOptions::layers "auto" reads it: every covered layer while
  // nothing was measured). JSON: null when not measured.
  std::vector<int64_t> restore_layers;
  bool restore_layers_measured = false;
  // Verifier layers whose raw K/V f_θ computes exactly from one feature (ascending; see above).
  // JSON: "exact_layers", absent in configs written before they existed (none).
  std::vector<int64_t> exact_layers;
  // Verifier side, per verifier layer.
  std::vector<int64_t> kv_heads;            // [L]
  std::vector<int64_t> head_dim;            // [L]
  std::vector<LayerType> layer_types;       // [L] (reports split by type)
  std::vector<bool> v_from_k;               // [L] K=V layer: no V decoder, V = predicted K
  // Structural identity of the pair this f_θ was made for (config_fingerprint below):
  // load-time checks refuse another verifier/drafter.
  std::string verifier_fingerprint, drafter_fingerprint;
  // Free-form record of where it came from (capture manifest identities, training
  // options); carried through save/load, never interpreted.
  nlohmann::json provenance = nlohmann::json::object();

  int64_t num_layers() const { return (int64_t)kv_heads.size(); }
  int64_t in_features() const {
    return input == FThetaInput::TargetFeatures ? (int64_t)feature_layers.size() * hidden
                                                : drafter_layers * drafter_kv_heads * drafter_head_dim;
  }
  bool reads_features() const { return input == FThetaInput::TargetFeatures; }
  int64_t kv_dim(int64_t l) const { return kv_heads[l] * head_dim[l]; }
  int64_t k_out() const;                    // Σ_l kv_dim(l)
  int64_t v_out() const;                    // Σ over layers with a V decoder
  int64_t k_offset(int64_t l) const;        // row offset of layer l in the K decoder
  int64_t v_offset(int64_t l) const;        // row offset of layer l in the V decoder (-1 on K=V layers)
  int64_t exact_feature(int64_t l) const;   // i with feature_layers[i] == l - 1, or -1 (no closed form)
  int64_t exact_rows(bool v_path) const;    // rows of k.exact (v.exact): Σ over exact layers (with a V decoder)

  // Validating reader of f_theta_config.json; errors name `file` and the field.
  static FThetaConfig from_json(const nlohmann::json& j, const std::string& file);
  static FThetaConfig from_file(const std::string& path);
  nlohmann::json to_json() const;
  // The config for this verifier/drafter pair.
  static FThetaConfig for_pair(const ModelConfig& verifier, const DrafterConfig& drafter, int64_t rank,
                               FThetaInput input = FThetaInput::DrafterKV);
  // Throws (naming `file`, the field, expected vs found) unless this f_θ was made
  // for exactly this verifier and drafter: fingerprints and every dimension.
  void check(const ModelConfig& verifier, const DrafterConfig& drafter, const std::string& file) const;
};

// Structural fingerprints ("fnv1a64:<hex>" of the canonical JSON of the config:
// ModelConfig::summary() / DrafterConfig::to_json()). They change with any
// dimension, layer layout, norm or RoPE setting; not with the weights (the
// capture manifest records weight identities; see FThetaConfig::provenance).
std::string config_fingerprint(const ModelConfig& verifier);
std::string config_fingerprint(const DrafterConfig& drafter);

class FTheta {
 public:
  FTheta() = default;
  // nn.Linear init from one seeded CPU generator: a seed means the same f_θ on every device.
  // No exact layers (cfg's are dropped: add_exact_layers computes them from the verifier).
  static FTheta random(const FThetaConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device);
  // <dir>/f_theta_config.json + <dir>/f_theta.safetensors, converted to dtype/device.
  // Every missing, extra or mis-shaped tensor is an error naming the file.
  static FTheta load(const std::string& dir, at::ScalarType dtype, at::Device device);
  // Weights (f32 unless `dtype` says otherwise) then config, each atomically: a
  // directory with a config always has its weights.
  void save(const std::string& dir, at::ScalarType dtype = at::kFloat) const;

  const FThetaConfig& config() const { return cfg_; }
  FThetaConfig& mutable_config() { return cfg_; }  // provenance is filled in by the trainer
  at::ScalarType dtype() const { return enc_w_[0].scalar_type(); }
  at::Device device() const { return enc_w_[0].device(); }
  int64_t num_parameters() const;

  // xk, xv: the K and V paths' inputs at N positions (any leading shape works: outputs keep it):
  //   drafter_kv       [N, L_d, H_d, D_d] drafter RAW context K, resp. V (Tap::KProj / Tap::VProj
  //                    of Drafter::context_kv)
  //   target_features  [N, n·H] target features (TargetFeatureCapture's rows), the same for both
  // -> per verifier layer {K [N, H_kv(l), D(l)], V [N, H_kv(l), D(l)]}: RAW verifier K/V (pre
  // k_norm/v_norm, pre-RoPE). Inputs are cast to the f_θ dtype; differentiable (training calls it).
  std::vector<std::pair<at::Tensor, at::Tensor>> predict(const at::Tensor& xk, const at::Tensor& xv) const;
  // One path: x (as above) -> fused decoder output [..., k_out()] (K) or [..., v_out()] (V).
  at::Tensor predict_fused(const at::Tensor& x, bool v_path) const;
  // The encoder's input rows [..., in] of x (shape-checked; target features RMS-normalised per layer).
  at::Tensor input_rows(const at::Tensor& x, bool v_path) const;

  // The learned tensors: name -> tensor, sharing storage with the model (the trainer sets
  // requires_grad and updates them in place). Names as in f_theta.safetensors: both paths'
  // encoder and decoder first, then the nonlinear branch's.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  // A nonlinear branch of width `hidden` on both paths, F1 and f1 drawn as nn.Linear's from `seed`,
  // F2 zero: predictions are unchanged until it is trained (train-ftheta --mlp-hidden). Throws if
  // there is one already.
  void add_mlp(int64_t hidden, uint64_t seed);

  // Every layer whose input is a tapped feature row (and that computes its own K/V) becomes an
  // exact layer: its K/V rows of `verifier` (the pair's verifier, checked by fingerprint), folded
  // with the layer's input-norm weight, in this f_θ's dtype and device. Replaces earlier ones.
  // Throws unless the input is target_features.
  void add_exact_layers(const Model& verifier);

 private:
  void check_shapes(const std::string& origin) const;
  // named_parameters() and the exact layers' fixed tensors: what the file holds.
  std::vector<std::pair<std::string, at::Tensor>> named_tensors() const;
  // y [..., k_out|v_out] with the exact layers' rows computed from rows [..., n·H] (input_rows).
  at::Tensor with_exact(const at::Tensor& y, const at::Tensor& rows, int p) const;
  FThetaConfig cfg_;
  at::Tensor enc_w_[2], enc_b_[2];  // [0] = K, [1] = V: [r, in], [r]
  at::Tensor dec_w_[2], dec_b_[2];  // [k_out|v_out, r], [k_out|v_out]
  at::Tensor mlp1_w_[2], mlp1_b_[2], mlp2_w_[2];  // [h, in], [h], [k_out|v_out, h]; undefined without the branch
  at::Tensor ex_w_[2], ex_b_[2];    // [exact_rows, H], [exact_rows]; undefined without exact rows on that path
};

}  // namespace kakeya
