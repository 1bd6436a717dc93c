#include "train/ftheta_loss.h"

#include "core/error.h"
#include "core/kernels/ops.h"
#include "infer/restorer.h"

namespace kakeya::train {

namespace {

const char* kLossNames[] = {"mse", "cos_mag", "combined", "attn_distill", "attn_distill_hybrid"};
const char* kStatNames[] = {"attn", "attn_ratio", "k_dir", "v_dir", "k_mag", "v_mag",
                            "k_cos", "v_cos", "k_mse", "v_mse", "k_rel_mse", "v_rel_mse"};
static_assert(sizeof(kStatNames) / sizeof(kStatNames[0]) == kNumStats, "one name per stat");

// Per-vector cosine over the last axis: [..., D] x [..., D] -> [...].
at::Tensor cosine(const at::Tensor& a, const at::Tensor& b) {
  return (a * b).sum(-1) * at::rsqrt(at::clamp_min((a * a).sum(-1) * (b * b).sum(-1), 1e-16));
}

bool attention_loss(FThetaLoss t) { return t == FThetaLoss::AttnDistill || t == FThetaLoss::AttnDistillHybrid; }

}  // namespace

FThetaLoss parse_ftheta_loss(const std::string& s) {
  for (int i = 0; i < 5; ++i)
    if (s == kLossNames[i]) return (FThetaLoss)i;
  KAKEYA_FAIL("--loss: '" << s << "' is not a loss (mse, cos_mag, combined, attn_distill, attn_distill_hybrid)");
}

const char* ftheta_loss_name(FThetaLoss l) { return kLossNames[(int)l]; }

const char* ftheta_stat_name(int64_t s) { return kStatNames[s]; }

std::vector<int64_t> parse_ftheta_loss_layers(const std::string& spec, const ModelConfig& cfg) {
  std::vector<int64_t> out;
  if (spec == "all") return out;  // empty = all
  KAKEYA_CHECK(spec == "sliding" || spec == "full" || spec == "restored",
               "--layers '" << spec << "' (expected all, sliding, full or restored)");
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (spec == "full" ? !cfg.is_sliding(l) : cfg.is_sliding(l) && !(spec == "restored" && token_layer(l)))
      out.push_back(l);
  KAKEYA_CHECK(!out.empty(), "--layers " << spec << ": the verifier has no such layers");
  return out;
}

FThetaLossResult ftheta_kv_loss(const Model& verifier, const std::vector<std::pair<at::Tensor, at::Tensor>>& pred,
                                const FThetaBatch& b, const FThetaLossOptions& opt) {
  const ModelConfig& mc = verifier.config();
  const int64_t L = mc.num_layers, T = b.positions.size(0);
  KAKEYA_CHECK((int64_t)pred.size() == L && (int64_t)b.k.size() == L && (int64_t)b.v.size() == L,
               "f_theta loss: expected " << L << " verifier layers of predictions and targets, got " << pred.size()
                                         << " and " << b.k.size());
  const bool attn = attention_loss(opt.type);
  KAKEYA_CHECK(!attn || ((int64_t)b.q.size() == L && (int64_t)b.o.size() == L),
               "f_theta loss " << ftheta_loss_name(opt.type) << " needs the captured query and attention output of every layer");
  KAKEYA_CHECK(opt.layout.sink >= 0 && opt.layout.window >= 0,
               "f_theta loss: sink and window must be >= 0, got " << opt.layout.sink << " and " << opt.layout.window);
  std::vector<int64_t> layers = opt.layers;
  if (layers.empty())
    for (int64_t l = 0; l < L; ++l) layers.push_back(l);

  const at::Tensor& pos = b.positions;
  // P: positions f_θ ever stands in for. [1, T, 1] f32 weights over [B, T, H] per-vector terms.
  at::Tensor in_p = pos.ge(opt.layout.sink);                          // [T] bool
  at::Tensor wp = in_p.to(at::kFloat).view({1, T, 1});
  // |P| stays on the device (no host sync: a training step can be graph-captured);
  // an empty P gives numerators of 0, so every mean over P below is 0 / max(n, 1) = 0.
  at::Tensor n_p = in_p.sum().to(at::kFloat);                          // [] f32
  // The restored layout: key j is exact for query t when j < sink or t - j < window.
  const bool all_predicted = opt.layout.sink == 0 && opt.layout.window == 0;
  at::Tensor exact = pos.lt(opt.layout.sink).unsqueeze(0).logical_or(
      (pos.unsqueeze(1) - pos.unsqueeze(0)).lt(opt.layout.window));  // [T(query), T(key)] bool

  at::Tensor stats = at::zeros({L, kNumStats}, at::TensorOptions().dtype(at::kFloat).device(pos.device()));
  at::Tensor total;
  auto add = [&](const at::Tensor& term, double w) {
    if (w == 0) return;
    at::Tensor t = term.to(at::kFloat) * w;
    total = total.defined() ? total + t : t;
  };

  for (int64_t l : layers) {
    KAKEYA_CHECK(l >= 0 && l < L, "f_theta loss: layer " << l << " out of range [0, " << L << ")");
    // Loss terms in f32 whatever f_θ's dtype (bf16 autocast rounds only inside the GEMMs).
    at::Tensor kp = pred[l].first.to(at::kFloat);   // [B, T, H_kv, D]
    at::Tensor vp = pred[l].second.to(at::kFloat);  // [B, T, H_kv, D]
    KAKEYA_CHECK(kp.sizes() == b.k[l].sizes() && vp.sizes() == b.v[l].sizes(),
                 "f_theta loss: layer " << l << " prediction " << kp.sizes() << "/" << vp.sizes() << " vs captured K/V "
                                        << b.k[l].sizes() << "/" << b.v[l].sizes());
    at::Tensor kt = b.k[l].to(at::kFloat), vt = b.v[l].to(at::kFloat);
    const int64_t B = kp.size(0), H = kp.size(2), D = kp.size(3);
    at::Tensor n_vec = at::clamp_min(n_p * (double)(B * H), 1.0);  // [] vectors in P (>= 1, see n_p)
    auto st = stats[l];

    // Raw-space terms.
    auto mse = [&](const at::Tensor& p, const at::Tensor& t) {
      return ((p - t).pow(2).sum(-1) * wp).sum() / (n_vec * (double)D);
    };
    auto rel_mse = [&](const at::Tensor& p, const at::Tensor& t) {
      return ((p - t).pow(2).sum(-1) * wp).sum() / at::clamp_min((t.pow(2).sum(-1) * wp).sum(), 1e-30);
    };
    auto mean_cos = [&](const at::Tensor& p, const at::Tensor& t) { return (cosine(p, t) * wp).sum() / n_vec; };
    auto mag = [&](const at::Tensor& p, const at::Tensor& t) {
      at::Tensor np = at::linalg_vector_norm(p, 2, {-1}), nt = at::linalg_vector_norm(t, 2, {-1});
      return ((np - nt).pow(2) * wp).sum() / at::clamp_min((nt.pow(2) * wp).sum(), 1e-30);
    };
    at::Tensor k_mse = mse(kp, kt), v_mse = mse(vp, vt);
    at::Tensor k_cos = mean_cos(kp, kt), v_cos = mean_cos(vp, vt);
    at::Tensor k_mag = mag(kp, kt), v_mag = mag(vp, vt);
    st[kStatKMse] = k_mse.detach();
    st[kStatVMse] = v_mse.detach();
    st[kStatKCos] = k_cos.detach();
    st[kStatVCos] = v_cos.detach();
    st[kStatKMag] = k_mag.detach();
    st[kStatVMag] = v_mag.detach();
    st[kStatKRelMse] = rel_mse(kp.detach(), kt);
    st[kStatVRelMse] = rel_mse(vp.detach(), vt);

    // Post-norm (and post-RoPE, which leaves cosines alone) K/V as the cache holds them: [B, H_kv, T, D].
    auto [kn_p, vn_p] = verifier.finish_kv(l, kp, vp, pos);
    auto [kn_t, vn_t] = verifier.finish_kv(l, kt, vt, pos);
    at::Tensor k_dir = ((1 - cosine(kn_p, kn_t)).transpose(1, 2) * wp).sum() / n_vec;
    at::Tensor v_dir = ((1 - cosine(vn_p, vn_t)).transpose(1, 2) * wp).sum() / n_vec;
    st[kStatKDir] = k_dir.detach().to(at::kFloat);
    st[kStatVDir] = v_dir.detach().to(at::kFloat);

    at::Tensor a_l = at::zeros({}, stats.options());
    if (attn) {
      at::Tensor vis = verifier.layer_mask(l, pos, pos);  // [T, T] causal (+ window)
      at::Tensor k_all, v_all, mask, pred_vis;
      if (all_predicted) {
        k_all = kn_p, v_all = vn_p, mask = vis, pred_vis = vis;
      } else {
        pred_vis = vis.logical_and(exact.logical_not());
        k_all = at::cat({kn_t.to(kn_p.scalar_type()), kn_p}, 2);  // [B, H_kv, 2T, D]
        v_all = at::cat({vn_t.to(vn_p.scalar_type()), vn_p}, 2);
        mask = at::cat({vis.logical_and(exact), pred_vis}, 1);       // [T, 2T]
      }
      // Q_l as weights (no host sync: an empty Q_l gives 0 / 1).
      at::Tensor wq = pred_vis.any(1).to(at::kFloat).view({1, T, 1});
      at::Tensor q = verifier.finish_q(l, b.q[l].to(kp.scalar_type()), pos);  // [B, T, H_q, D]
      const auto& w = verifier.layer(l);
      at::Tensor o = ops::linear(verifier.attention(l, q, k_all, v_all, mask), w.o, w.o_bias);  // [B, T, hidden]
      at::Tensor ot = b.o[l].to(at::kFloat);
      at::Tensor n_q = at::clamp_min(wq.sum() * (double)(B * o.size(-1)), 1.0);
      a_l = ((o.to(at::kFloat) - ot).pow(2).sum(-1, true) * wq).sum() / n_q;
      at::Tensor o_energy = (ot.pow(2).sum(-1, true) * wq).sum() / n_q;
      st[kStatAttn] = a_l.detach();
      st[kStatAttnRatio] = a_l.detach() / at::clamp_min(o_energy, 1e-30);
    }

    switch (opt.type) {
      case FThetaLoss::Mse:
        add(k_mse + v_mse, 1.0);
        break;
      case FThetaLoss::CosMag:
      case FThetaLoss::Combined:
        add((1 - k_cos) + k_mag + (1 - v_cos) + v_mag, 1.0);
        if (opt.type == FThetaLoss::Combined) add(k_mse + v_mse, opt.combined_mse_weight);
        break;
      case FThetaLoss::AttnDistill:
        add(a_l, 1.0);
        break;
      case FThetaLoss::AttnDistillHybrid:
        add(a_l, 1.0);
        add(k_dir, opt.lambda_k_dir);
        add(v_dir, opt.lambda_v_dir);
        add(k_mag, opt.lambda_k_mag);
        add(v_mag, opt.lambda_v_mag);
        break;
    }
  }
  KAKEYA_CHECK(!layers.empty(), "f_theta loss: no layers selected");
  if (!total.defined()) total = at::zeros({}, stats.options());
  return {total / (double)layers.size(), stats};
}

FThetaLossResult ftheta_loss(const Model& verifier, const FTheta& f, const FThetaBatch& b, const FThetaLossOptions& opt) {
  return ftheta_kv_loss(verifier, f.config().reads_features() ? f.predict(b.feats, b.feats) : f.predict(b.dk, b.dv), b,
                        opt);
}

}  // namespace kakeya::train
