// The five f_θ training losses (seeds: scripts/research/k3_f_theta_train.py
// --loss-type; digest §1.3). Notation, per verifier layer l:
//   Kp, Vp = f_θ(dk, dv)[l]   predicted RAW K/V  [B, T, H_kv, D]  (pre k_norm/v_norm, pre-RoPE)
//   Kt, Vt                    captured RAW K/V   [B, T, H_kv, D]
//   n_k(x) = k_norm(x), n_v(x) = v_norm(x): the verifier's own norms (identity where it has none)
//   per-vector = per (sequence, position, KV head) vector of D values
//   P = positions f_θ ever stands in for: absolute position >= layout.sink (sink tokens are never evicted)
//   cos(a, b) = <a, b> / sqrt(max(|a|²·|b|², 1e-16))
//   mag(p, t) = mean_P (|p| - |t|)² / mean_P |t|²        (per-vector norms; relative, so scale-free across layers)
//
//   mse          (1/L) Σ_l [ mean_P (Kp-Kt)² + mean_P (Vp-Vt)² ]                       (elementwise means)
//   cos_mag      (1/L) Σ_l [ mean_P (1-cos(Kp,Kt)) + mag(Kp,Kt) + mean_P (1-cos(Vp,Vt)) + mag(Vp,Vt) ]   (raw space)
//   combined     cos_mag + 0.1 · mse                                                  (seeds: 0.1 × MSE "for stability")
//   attn_distill (1/L) Σ_l A_l,   A_l = mean over Q_l × hidden of (O_pred - O_t)²
//   attn_distill_hybrid
//                (1/L) Σ_l [ A_l + λkd·mean_P(1-cos(n_k(Kp),n_k(Kt))) + λvd·mean_P(1-cos(n_v(Vp),n_v(Vt)))
//                                + λkm·mag(Kp,Kt) + λvm·mag(Vp,Vt) ]                  (defaults 1, 1, 0.1, 0.1)
//
// O_pred is the verifier layer's attention output after o_proj, recomputed from
// the captured raw query with the model's own pieces (Model::finish_q: q_norm +
// RoPE; Model::finish_kv: k_norm + RoPE, v_norm; Model::attention: GQA, scale,
// softcap; o_proj), over keys laid out as the restored decoder serves them: for
// the query at position t, the key at position j <= t (and inside the sliding
// window on sliding layers) is the EXACT captured K/V when j < sink or
// t - j < window, and f_θ's prediction otherwise. Q_l = the queries that see at
// least one predicted key on layer l (others would only add a constant 0 and
// dilute the mean); A_l = 0 when Q_l is empty. O_t is the captured output.
//
// Choices where the seeds are silent (documented here, tested against a Python
// reference written from this text): the per-vector unit (one KV head), the
// position set P, the relative normalisation of the magnitude term in cos_mag
// (the same as the hybrid's |K_tgt|² normaliser, averaged over P), the 1e-16
// cosine floor, and mean-over-layers (not sum). The direction terms are taken
// after RoPE as well as after the norm, which leaves the cosine unchanged (RoPE
// rotates both vectors alike) and lets them reuse finish_kv's output.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/ftheta.h"
#include "core/model/model.h"

namespace kakeya::train {

enum class FThetaLoss { Mse, CosMag, Combined, AttnDistill, AttnDistillHybrid };
FThetaLoss parse_ftheta_loss(const std::string& s);  // "mse" ... "attn_distill_hybrid"; error lists the choices
const char* ftheta_loss_name(FThetaLoss l);
// FThetaLossOptions::layers of a --layers spec: all (empty: every layer) | sliding | full | restored
// (what a restored decode takes from f_θ by default: the sliding layers but the token layers,
// infer/restorer.h token_layer, whose rows f_θ computes and nothing reads). Errors name --layers.
std::vector<int64_t> parse_ftheta_loss_layers(const std::string& spec, const ModelConfig& cfg);

// Which cached positions are exact for a query (the restored decoder's layout).
struct KVLayout {
  int64_t sink = 4;    // positions [0, sink) stay exact forever
  int64_t window = 64; // the last `window` positions before and including the query stay exact
};

struct FThetaLossOptions {
  FThetaLoss type = FThetaLoss::AttnDistillHybrid;
  KVLayout layout;
  double lambda_k_dir = 1.0, lambda_v_dir = 1.0, lambda_k_mag = 0.1, lambda_v_mag = 0.1;
  double combined_mse_weight = 0.1;
  std::vector<int64_t> layers;  // verifier layers in the loss; empty: all
};

// B sequences sharing positions [T] (the trainer crops them to one length).
// Tensors on the model's device; float tensors in any float dtype.
struct FThetaBatch {
  at::Tensor positions;          // [T] int64 absolute positions
  at::Tensor dk, dv;             // [B, T, L_d, H_d, D_d] drafter raw context K/V (f_θ input drafter_kv)
  at::Tensor feats;              // [B, T, n·H] target features (f_θ input target_features)
  std::vector<at::Tensor> q;     // per verifier layer [B, T, H_q, D_l] raw query (attention losses only)
  std::vector<at::Tensor> k, v;  // per verifier layer [B, T, H_kv_l, D_l] raw K/V
  std::vector<at::Tensor> o;     // per verifier layer [B, T, hidden] attention output after o_proj (attention losses only)
};

// Per-layer diagnostics [L, kNumStats] (0 for layers outside the loss; the two
// attention stats are computed by the attention losses only): the terms above
// and the report metrics, all over P.
enum FThetaStat : int64_t {
  kStatAttn = 0,   // A_l
  kStatAttnRatio,  // A_l / mean over Q_l of O_t² (the seeds' "ratio")
  kStatKDir,       // mean_P (1 - cos) after the norm
  kStatVDir,
  kStatKMag,       // mag() on raw K
  kStatVMag,
  kStatKCos,       // mean_P cos on raw K (the cos_mag term is 1 - this)
  kStatVCos,
  kStatKMse,       // mean_P (Kp-Kt)²
  kStatVMse,
  kStatKRelMse,    // Σ_P (Kp-Kt)² / Σ_P Kt²
  kStatVRelMse,
  kNumStats
};
const char* ftheta_stat_name(int64_t s);  // "attn", "attn_ratio", "k_dir", ...

struct FThetaLossResult {
  at::Tensor loss;   // [] f32, with graph when grad is enabled
  at::Tensor stats;  // [L, kNumStats] f32, detached (on the model's device; .cpu() when logging)
};

// The loss of the predicted raw K/V `pred` (per verifier layer {K, V} [B, T, H_kv, D]).
FThetaLossResult ftheta_kv_loss(const Model& verifier, const std::vector<std::pair<at::Tensor, at::Tensor>>& pred,
                                const FThetaBatch& b, const FThetaLossOptions& opt);
// f_θ's prediction from the batch's drafter K/V, then ftheta_kv_loss.
FThetaLossResult ftheta_loss(const Model& verifier, const FTheta& f, const FThetaBatch& b,
                             const FThetaLossOptions& opt);

}  // namespace kakeya::train
