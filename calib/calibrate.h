// Calibration jobs for the KV codec: Σ_q (query second moments per layer and KV
// head), PCA bases and Lloyd-Max codebooks fitted to the codec's own residuals.
// Everything is captured through forward taps (core/model/taps.h), never a forked
// forward: Tap::QNorm gives pre-RoPE queries after q_norm, Tap::KNorm and
// Tap::VNorm the pre-RoPE K (after k_norm) and V, i.e. exactly what the codec
// sees in codec-eval (which captures K/V through the same taps and re-applies
// the model's own RoPE after decoding).
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "calib/codec/calib_bundle.h"
#include "calib/codec/codec.h"
#include "core/model/model.h"
#include "core/model/taps.h"

namespace kakeya::calib {

// Runs the model over `ids` in windows of `context` tokens (each window starts
// with BOS when bos >= 0 and the text token is not BOS), at most `max_tokens`
// tokens in all, with `taps` subscribed and no logits. Returns the tokens run.
int64_t run_windows(const Model& model, const std::vector<int64_t>& ids, int64_t context, int64_t max_tokens,
                    int64_t bos, const Taps& taps, const std::function<void(int64_t, int64_t)>& progress = nullptr);

// Tap::QNorm subscriber: Σ (q qᵀ) per layer and KV head, pooling the G = H_q/H_kv
// query heads of each GQA group (they all contract with the same K).
class SigmaQAccumulator : public TapSubscriber {
 public:
  SigmaQAccumulator(const ModelConfig& cfg, at::Device device);
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override;
  const at::Tensor& sum(int64_t layer) const { return sum_[layer]; }  // [H_kv, D, D] f64
  int64_t count(int64_t layer) const { return count_[layer]; }       // query vectors pooled per KV head

 private:
  const ModelConfig& cfg_;
  std::vector<at::Tensor> sum_;  // per layer [H_kv, D, D] f64 on the device
  std::vector<int64_t> count_;
};

struct SigmaQOptions {
  // Ridge added to Σ before the Cholesky factorisation, relative to its mean
  // eigenvalue: Σ_r = Σ + ridge · tr(Σ)/D · I. Query second moments are close
  // to singular (cond 1e7..1e11 on Gemma 3 270M), so without it L⁻¹ amplifies
  // codec error without bound; 1e-3 caps cond(Σ_r) near D/ridge.
  double ridge = 1e-3;
  // RoPE-aware metric: a pre-RoPE key error e at position s meets the query of
  // position t as (R_{t-s} q)ᵀ e, so the metric that weighs it is
  // E_Δ[R_Δ Σ_q R_Δᵀ], not Σ_q. With rope_offsets = N > 0 the factor is taken
  // of that average over Δ = 0..N-1 (capped at the sliding window on sliding
  // layers); 0 whitens with the plain pre-RoPE Σ_q. Saved as layer_{l}_sigma_eff.
  int64_t rope_offsets = 0;
};

// E_Δ[R_Δ Σ R_Δᵀ] over Δ = 0..offsets-1 for one layer's RoPE (HF rotate_half
// layout); sigma: [H, D, D] f64 -> same. Elementwise in O(offsets·D²) via the
// cos/sin moment matrices, no D×D rotation per offset.
at::Tensor rope_average(const at::Tensor& sigma, const RopeParams& rope, int64_t offsets);

struct SigmaQResult {
  std::vector<at::Tensor> sigma, chol, inv_chol;  // per layer [H_kv, D, D] f32 (sigma: without ridge)
  std::vector<at::Tensor> sigma_eff;              // per layer [H_kv, D, D] f32 when rope_offsets > 0: what was factored
  nlohmann::json diagnostics;                     // per layer/head: cond, cond_ridged, anisotropy, eff. rank
};

// Σ = sum / count, ridge, Cholesky (lower: Σ_r = L·Lᵀ) and L⁻¹. Throws naming the
// layer and head on non-finite data or a failed factorisation.
SigmaQResult finish_sigma_q(const SigmaQAccumulator& acc, const ModelConfig& cfg, const SigmaQOptions& opt);
// Writes q_calib.safetensors + q_calib_diagnostics.json and the manifest entry "sigma_q".
void save_sigma_q(const std::string& dir, const ModelConfig& cfg, const SigmaQResult& r, nlohmann::json entry);

// Tap::KNorm / Tap::VNorm subscriber keeping pre-RoPE K and V of every window:
// per layer, a list of [H_kv, T, D] tensors (model dtype, on the device).
class KVCapture : public TapSubscriber {
 public:
  explicit KVCapture(const ModelConfig& cfg);
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override;
  const std::vector<at::Tensor>& k(int64_t layer) const { return k_[layer]; }
  const std::vector<at::Tensor>& v(int64_t layer) const { return v_[layer]; }
  void clear();

 private:
  std::vector<std::vector<at::Tensor>> k_, v_;
};

// Tap::QNorm + Tap::KNorm subscriber for the weights of weighted row codes (core/kernels/ops.h
// pwB) on full-attention layers: per KV head and coordinate, the energy of the queries (the G
// heads of the group pooled) and of the post-RoPE keys about each window's mean (positions
// >= sink), which is what the decoder's coded rows hold (k - the session's mean).
class KWeightAccumulator : public TapSubscriber {
 public:
  KWeightAccumulator(const Model& model, int64_t sink);
  void on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) override;
  bool reads(Tap tap) const override { return tap == Tap::QNorm || tap == Tap::KNorm; }
  const at::Tensor& q_energy(int64_t layer) const { return q_[layer]; }  // [H_kv, D] f64 sums (undefined: sliding)
  const at::Tensor& k_energy(int64_t layer) const { return k_[layer]; }  // [H_kv, D] f64 sums
  int64_t q_count(int64_t layer) const { return qn_[layer]; }
  int64_t k_count(int64_t layer) const { return kn_[layer]; }

 private:
  const Model& model_;
  int64_t sink_;
  std::vector<at::Tensor> q_, k_;
  std::vector<int64_t> qn_, kn_;
};

// Per full-attention layer [H_kv, D] f32 weights w: over each RoPE pair (i, i + rot/2) — whose
// energy a position's rotation leaves unchanged, so the weights hold at any distance — w² =
// (E|q|² / E|k - mean|²)^(power/2) on both coordinates, normalised to mean w² = 1 (a row code
// ignores the scale). power 1 minimises the mean squared score error of a rotated code
// (Σ w²σ²)(Σ e/w²); 0.75 did better in perplexity (bench/results, 2026-11-27).
struct KWeightsResult {
  std::vector<at::Tensor> weight;  // per layer, undefined on sliding layers
  nlohmann::json diagnostics;      // per layer/head: the predicted distortion gain over the unweighted code
};
KWeightsResult finish_k_weights(const KWeightAccumulator& acc, const ModelConfig& cfg, double power);
// Writes k_weights.safetensors (layer_{l}_k_weight) and the manifest entry "k_weights".
void save_k_weights(const std::string& dir, const ModelConfig& cfg, const KWeightsResult& r, nlohmann::json entry);

struct BasisOptions {
  int64_t block = 512;  // the codec's block: bases are fitted to block-centred data, as the codec codes it
};
// PCA bases of block-centred K, whitened K (when the bundle has Σ_q) and V per
// layer and KV head; writes pca_basis.safetensors and the manifest entry "basis".
nlohmann::json fit_bases(const std::string& dir, const ModelConfig& cfg, const KVCapture& cap,
                         const CalibBundle& bundle, const BasisOptions& opt, nlohmann::json entry);

struct CodebookOptions {
  std::vector<int> bits = {1, 2, 3, 4};
  bool per_layer = true;              // false: one table per stream pooled over layers (stored per row)
  int64_t max_samples = int64_t(1) << 21;  // residual samples kept per layer and stream (strided)
};
// Runs `codec`'s transforms on the captured K/V and fits Lloyd-Max tables to the
// unit-variance residual coordinates it would quantize; writes codebook_{k,v}_b*.f32,
// codebook_summary.json and the manifest entry "codebook". Returns the summary.
nlohmann::json fit_codebooks(const std::string& dir, const ModelConfig& cfg, const KVCapture& cap, const KVCodec& codec,
                             const CodebookOptions& opt, nlohmann::json entry);

}  // namespace kakeya::calib
