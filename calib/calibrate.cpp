#include "calib/calibrate.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/io/fs.h"
#include "calib/codec/lloyd_max.h"
#include "core/model/rope.h"
#include "core/io/safetensors.h"

namespace kakeya::calib {

using json = nlohmann::json;

int64_t run_windows(const Model& model, const std::vector<int64_t>& ids, int64_t context, int64_t max_tokens,
                    int64_t bos, const Taps& taps, const std::function<void(int64_t, int64_t)>& progress) {
  KAKEYA_CHECK(context >= 2, "calibration: --context must be >= 2, got " << context);
  KAKEYA_CHECK(!ids.empty(), "calibration: the calibration text is empty");
  KVCache cache(model.config(), model.cache_options(context));
  ForwardOptions fo;
  fo.skip_logits = true;
  fo.taps = &taps;
  const int64_t total = std::min<int64_t>(max_tokens, ids.size());
  int64_t done = 0;
  size_t pos = 0;
  while (done < total && pos < ids.size()) {
    std::vector<int64_t> win;
    if (bos >= 0 && ids[pos] != bos) win.push_back(bos);
    const int64_t take = std::min<int64_t>({context - (int64_t)win.size(), total - done, (int64_t)(ids.size() - pos)});
    win.insert(win.end(), ids.begin() + pos, ids.begin() + pos + take);
    pos += take;
    done += take;
    if (win.size() < 2) break;
    cache.clear();
    auto t = at::tensor(win, at::kLong).to(model.device()).view({1, (int64_t)win.size()});
    model.forward(t, cache, fo);
    if (progress) progress(done, total);
  }
  return done;
}

// ---------------------------------------------------------------- Σ_q

SigmaQAccumulator::SigmaQAccumulator(const ModelConfig& cfg, at::Device device) : cfg_(cfg) {
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const int64_t D = cfg.layer_head_dim[l];
    sum_.push_back(at::zeros({cfg.kv_heads(l), D, D}, at::TensorOptions().dtype(at::kDouble).device(device)));
    count_.push_back(0);
  }
}

void SigmaQAccumulator::on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) {
  if (tap != Tap::QNorm) return;
  // x: [B, T, H_q, D]. Query head h reads KV head h / G (HF's repeat_kv), so the
  // G heads of a group are contiguous: [B·T, H_kv, G, D] -> [H_kv, B·T·G, D]. H_kv is per layer
  // (Gemma 4 full layers have fewer KV heads, so a larger G).
  const int64_t B = x.size(0), T = x.size(1), Hq = x.size(2), D = x.size(3), Hkv = cfg_.kv_heads(ctx.layer),
                G = Hq / Hkv;
  auto q = x.to(at::kFloat).reshape({B * T, Hkv, G, D}).permute({1, 0, 2, 3}).reshape({Hkv, B * T * G, D});
  sum_[ctx.layer] += at::bmm(q.transpose(1, 2), q).to(at::kDouble);  // f32 products, f64 running sum
  count_[ctx.layer] += B * T * G;
}

at::Tensor rope_average(const at::Tensor& sigma, const RopeParams& rope, int64_t offsets) {
  KAKEYA_CHECK(offsets >= 1, "rope_average: offsets must be >= 1");
  const int64_t D = sigma.size(-1);
  auto inv = rope_inv_freq(rope, D).to(at::kDouble);  // [rot/2]
  const int64_t h = inv.size(0), rot = 2 * h;
  // Per-dimension frequency: dims a and a + rot/2 rotate together; pass-through dims don't.
  auto f = at::zeros({D}, at::kDouble);
  f.slice(0, 0, h).copy_(inv);
  f.slice(0, h, rot).copy_(inv);
  auto ang = at::arange(offsets, at::kDouble).unsqueeze(1) * f.unsqueeze(0);  // [M, D]
  auto C = ang.cos(), S = ang.sin();
  S.slice(1, rot).zero_();
  // R x = c∘x + s∘P x with P x = rotate_half(x) = [-x2, x1] on the rotary part.
  auto P = at::zeros({D, D}, at::kDouble);
  for (int64_t a = 0; a < h; ++a) {
    P[a][a + h] = -1.0;
    P[a + h][a] = 1.0;
  }
  const double M = (double)offsets;
  auto Ecc = at::matmul(C.t(), C) / M, Ecs = at::matmul(C.t(), S) / M, Esc = at::matmul(S.t(), C) / M,
       Ess = at::matmul(S.t(), S) / M;  // [D, D] moments E[c_a c_b] etc.
  auto Sg = sigma.to(at::kDouble).cpu();
  auto SPt = at::matmul(Sg, P.t()), PS = at::matmul(P, Sg), PSPt = at::matmul(PS, P.t());
  return Ecc * Sg + Ecs * SPt + Esc * PS + Ess * PSPt;
}

SigmaQResult finish_sigma_q(const SigmaQAccumulator& acc, const ModelConfig& cfg, const SigmaQOptions& opt) {
  KAKEYA_CHECK(opt.ridge >= 0 && std::isfinite(opt.ridge), "sigma-q: --ridge must be >= 0, got " << opt.ridge);
  SigmaQResult r;
  json layers = json::array();
  std::vector<double> conds;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const int64_t D = cfg.layer_head_dim[l], H = cfg.kv_heads(l);
    KAKEYA_CHECK(acc.count(l) > 0, "sigma-q: no queries were captured for layer " << l);
    auto S_raw = (acc.sum(l) / (double)acc.count(l)).cpu();  // [H, D, D] f64
    S_raw = 0.5 * (S_raw + S_raw.transpose(1, 2));           // exact symmetry for the factorisation
    for (int64_t h = 0; h < H; ++h)
      KAKEYA_CHECK(at::isfinite(S_raw[h]).all().item<bool>(),
                   "sigma-q: layer " << l << " KV head " << h
                                     << ": query statistics contain NaN or Inf (non-finite activations in the calibration "
                                        "forward; try --dtype f32)");
    at::Tensor S = S_raw;
    if (opt.rope_offsets > 0) {
      const int64_t n = cfg.is_sliding(l) && cfg.sliding_window > 0 ? std::min(opt.rope_offsets, cfg.sliding_window)
                                                                    : opt.rope_offsets;
      S = rope_average(S_raw, cfg.rope(l), n);
      S = 0.5 * (S + S.transpose(1, 2));
    }
    std::vector<at::Tensor> Ls, Li;
    json heads = json::array();
    for (int64_t h = 0; h < H; ++h) {
      auto Sh = S[h];
      auto ev = at::linalg_eigvalsh(Sh);  // ascending [D]
      const double lmax = ev[D - 1].item<double>(), lmin = ev[0].item<double>(), tr = ev.sum().item<double>();
      KAKEYA_CHECK(tr > 0, "sigma-q: layer " << l << " KV head " << h << ": all queries are zero");
      const double mu = tr / D;
      auto Sr = Sh + at::eye(D, Sh.options()) * (opt.ridge * mu);
      at::Tensor L;
      try {
        L = at::linalg_cholesky(Sr);
      } catch (const c10::Error& e) {
        KAKEYA_FAIL("sigma-q: layer " << l << " KV head " << h << ": Cholesky failed (Σ_q not positive definite; raise --ridge, now "
                                      << opt.ridge << ")");
      }
      auto Linv = at::linalg_solve_triangular(L, at::eye(D, L.options()), /*upper=*/false);
      KAKEYA_CHECK(at::isfinite(Linv).all().item<bool>(), "sigma-q: layer " << l << " KV head " << h << ": L⁻¹ is not finite");
      Ls.push_back(L);
      Li.push_back(Linv);
      auto evc = ev.clamp_min(0);
      const double cond_r = (lmax + opt.ridge * mu) / (std::max(lmin, 0.0) + opt.ridge * mu);
      const double pr = std::pow(evc.sum().item<double>(), 2) / evc.pow(2).sum().item<double>();
      auto cum = evc.flip(0).cumsum(0) / evc.sum();
      const int64_t r90 = cum.lt(0.9).sum().item<int64_t>() + 1, r99 = cum.lt(0.99).sum().item<int64_t>() + 1;
      auto off = Sh - at::diag_embed(at::diagonal(Sh));
      json hj = {{"head", h},
                 {"cond", lmin > 0 ? json(lmax / lmin) : json(nullptr)},
                 {"lambda_min", lmin},
                 {"lambda_max", lmax},
                 {"cond_ridged", cond_r},
                 {"cond_L", std::sqrt(cond_r)},
                 {"anisotropy", lmax / mu},
                 {"effective_rank", pr},
                 {"rank_90", r90},
                 {"rank_99", r99},
                 {"offdiag_max_over_diag_mean", off.abs().max().item<double>() / mu},
                 {"trace", tr}};
      heads.push_back(hj);
      conds.push_back(cond_r);
    }
    r.sigma.push_back(S_raw.to(at::kFloat));
    if (opt.rope_offsets > 0) r.sigma_eff.push_back(S.to(at::kFloat));
    r.chol.push_back(at::stack(Ls).to(at::kFloat));
    r.inv_chol.push_back(at::stack(Li).to(at::kFloat));
    layers.push_back({{"layer", l}, {"layer_type", layer_type_name(cfg.layer_types[l])}, {"queries", acc.count(l)}, {"heads", heads}});
  }
  std::sort(conds.begin(), conds.end());
  r.diagnostics = {{"ridge", opt.ridge},
                   {"rope_offsets", opt.rope_offsets},
                   {"ridge_rule", "Σ + ridge · tr(Σ)/D · I"},
                   {"cond_ridged_median", conds[conds.size() / 2]},
                   {"cond_ridged_max", conds.back()},
                   {"layers", layers}};
  return r;
}

void save_sigma_q(const std::string& dir, const ModelConfig& cfg, const SigmaQResult& r, json entry) {
  CalibBundle::prepare_dir(dir, cfg);
  std::map<std::string, at::Tensor> t;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "layer_" + std::to_string(l) + "_";
    t[p + "chol"] = r.chol[l].contiguous();
    t[p + "inv_chol"] = r.inv_chol[l].contiguous();
    t[p + "sigma"] = r.sigma[l].contiguous();
    if (!r.sigma_eff.empty()) t[p + "sigma_eff"] = r.sigma_eff[l].contiguous();
  }
  save_safetensors(dir + "/q_calib.safetensors", t, {{"format", kCalibFormat}, {"config_hash", config_hash(cfg)}});
  fs::write_atomic(dir + "/q_calib_diagnostics.json", r.diagnostics.dump(2) + "\n");
  entry["file"] = "q_calib.safetensors";
  entry["diagnostics"] = "q_calib_diagnostics.json";
  entry["ridge"] = r.diagnostics["ridge"];
  entry["rope_offsets"] = r.diagnostics["rope_offsets"];
  entry["cond_ridged_median"] = r.diagnostics["cond_ridged_median"];
  entry["cond_ridged_max"] = r.diagnostics["cond_ridged_max"];
  CalibBundle::update_manifest(dir, cfg, "sigma_q", entry);
}

// ---------------------------------------------------------------- K weights

KWeightAccumulator::KWeightAccumulator(const Model& model, int64_t sink) : model_(model), sink_(sink) {
  const ModelConfig& cfg = model.config();
  KAKEYA_CHECK(cfg.num_kv_shared() == 0, "k-weights: not supported with KV sharing (config field "
                                             << "'num_kv_shared_layers' = " << cfg.num_kv_shared() << ")");
  auto opt = at::TensorOptions().dtype(at::kDouble).device(model.device());
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const bool full = !cfg.is_sliding(l);
    q_.push_back(full ? at::zeros({cfg.kv_heads(l), cfg.layer_head_dim[l]}, opt) : at::Tensor());
    k_.push_back(full ? at::zeros({cfg.kv_heads(l), cfg.layer_head_dim[l]}, opt) : at::Tensor());
    qn_.push_back(0);
    kn_.push_back(0);
  }
}

void KWeightAccumulator::on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) {
  const int64_t l = ctx.layer;
  if (!q_[l].defined()) return;
  if (tap == Tap::QNorm) {  // x: [B, T, H_q, D]; head h reads KV head h / G
    const int64_t B = x.size(0), T = x.size(1), Hkv = q_[l].size(0), G = x.size(2) / Hkv, D = x.size(3);
    q_[l] += x.to(at::kFloat).reshape({B * T, Hkv, G, D}).pow(2).sum(at::IntArrayRef{0, 2}).to(at::kDouble);
    qn_[l] += B * T * G;
  } else if (tap == Tap::KNorm) {  // x: [B, T, H_kv, D] before RoPE
    auto k = model_.rope(l).apply(x, ctx.positions).to(at::kFloat);  // as the cache holds it
    auto keep = ctx.positions.ge(sink_).to(at::kFloat).view({1, -1, 1, 1});  // [1, T, 1, 1]
    const double n = keep.sum().item<double>() * x.size(0);
    if (n < 2) return;
    auto mean = (k * keep).sum(at::IntArrayRef{0, 1}, true) / n;  // [1, 1, H_kv, D]: the window's mean
    k_[l] += ((k - mean).pow(2) * keep).sum(at::IntArrayRef{0, 1}).to(at::kDouble);
    kn_[l] += (int64_t)n;
  }
}

KWeightsResult finish_k_weights(const KWeightAccumulator& acc, const ModelConfig& cfg, double power) {
  KAKEYA_CHECK(power > 0 && power <= 4, "k-weights: --power expected in (0, 4], got " << power);
  KWeightsResult r;
  r.diagnostics = {{"power", power}, {"layers", json::array()}};
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (!acc.q_energy(l).defined()) {
      r.weight.emplace_back();
      continue;
    }
    KAKEYA_CHECK(acc.q_count(l) > 0 && acc.k_count(l) > 1,
                 "k-weights: layer " << l << " saw no queries or keys (calibration text too short for --sink?)");
    const int64_t D = cfg.layer_head_dim[l];
    auto q = acc.q_energy(l).cpu() / (double)acc.q_count(l), k = acc.k_energy(l).cpu() / (double)acc.k_count(l);  // [H, D]
    KAKEYA_CHECK(at::isfinite(q).all().item<bool>() && at::isfinite(k).all().item<bool>(),
                 "k-weights: layer " << l << ": non-finite query or key energy");
    // Pair energies: coordinates i and i + rot/2 rotate together; the rest pass through alone.
    const int64_t h = rope_inv_freq(cfg.rope(l), D).size(0);
    auto pair = [&](const at::Tensor& e) {
      auto s = e.slice(1, 0, h) + e.slice(1, h, 2 * h);
      return at::cat({s, s, e.slice(1, 2 * h)}, 1);
    };
    auto qp = pair(q), kp = pair(k);
    qp = at::maximum(qp, qp.amax(1, true) * 1e-9);  // a coordinate no query reads still gets a (tiny) weight
    kp = at::maximum(kp, kp.amax(1, true) * 1e-9);
    auto w = (qp / kp).pow(power / 4.0);
    w = w / w.pow(2).mean(1, true).sqrt();
    // The distortion gain over the unweighted code, at power 1's optimum: (Σσ²)(Σe)/(Σσ·sqrt(e))².
    auto gain = (k.sum(1) * q.sum(1) / (k.sqrt() * q.sqrt()).sum(1).pow(2));
    r.diagnostics["layers"].push_back({{"layer", l}, {"optimal_gain", std::vector<double>(gain.data_ptr<double>(), gain.data_ptr<double>() + gain.numel())}});
    r.weight.push_back(w.to(at::kFloat).cpu().contiguous());
  }
  return r;
}

void save_k_weights(const std::string& dir, const ModelConfig& cfg, const KWeightsResult& r, json entry) {
  CalibBundle::prepare_dir(dir, cfg);
  std::map<std::string, at::Tensor> t;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (r.weight[l].defined()) t["layer_" + std::to_string(l) + "_k_weight"] = r.weight[l];
  KAKEYA_CHECK(!t.empty(), "k-weights: the model has no full-attention layers");
  save_safetensors(dir + "/k_weights.safetensors", t, {{"format", kCalibFormat}, {"config_hash", config_hash(cfg)}});
  entry["file"] = "k_weights.safetensors";
  entry["power"] = r.diagnostics["power"];
  entry["layers"] = r.diagnostics["layers"];
  CalibBundle::update_manifest(dir, cfg, "k_weights", entry);
}

// ---------------------------------------------------------------- K/V capture

KVCapture::KVCapture(const ModelConfig& cfg) : k_(cfg.num_layers), v_(cfg.num_layers) {
  // Per-layer codecs are fitted to each layer's own K/V; KV-shared layers have none.
  KAKEYA_CHECK(cfg.num_kv_shared() == 0, "K/V calibration: not supported with KV sharing (config field "
                                             << "'num_kv_shared_layers' = " << cfg.num_kv_shared() << ")");
}

void KVCapture::on_tap(Tap tap, const TapContext& ctx, at::Tensor& x) {
  if (tap != Tap::KNorm && tap != Tap::VNorm) return;
  // x: [B, T, H_kv, D] -> [H_kv, B·T, D], copied (the forward's buffers are reused).
  auto y = x.permute({2, 0, 1, 3}).reshape({x.size(2), x.size(0) * x.size(1), x.size(3)}).clone();
  (tap == Tap::KNorm ? k_ : v_)[ctx.layer].push_back(y);
}

void KVCapture::clear() {
  for (auto& l : k_) l.clear();
  for (auto& l : v_) l.clear();
}

// ---------------------------------------------------------------- PCA bases

namespace {
// Σ_q normalised to unit mean eigenvalue, exactly as KVCodec whitens: [H, D, D].
at::Tensor whitening(const CalibBundle& b, int64_t l, int64_t D, at::Device dev) {
  auto s = (at::diagonal(b.sigma(l), 0, -2, -1).sum(-1) / D).sqrt().view({-1, 1, 1});
  return (b.chol(l) / s).to(dev);
}
}  // namespace

json fit_bases(const std::string& dir, const ModelConfig& cfg, const KVCapture& cap, const CalibBundle& bundle,
               const BasisOptions& opt, json entry) {
  KAKEYA_CHECK(opt.block >= 0, "basis: block must be >= 0");
  std::map<std::string, at::Tensor> out;
  json stats = json::array();
  std::vector<std::string> kinds = {"k", "v"};
  if (bundle.has_sigma_q()) kinds.push_back("kw");
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const int64_t D = cfg.layer_head_dim[l];
    KAKEYA_CHECK(!cap.k(l).empty(), "basis: nothing was captured for layer " << l);
    const auto dev = cap.k(l)[0].device();
    json lj = {{"layer", l}};
    for (const auto& kind : kinds) {
      const auto& src = kind == "v" ? cap.v(l) : cap.k(l);
      at::Tensor W = kind == "kw" ? whitening(bundle, l, D, dev) : at::Tensor();
      at::Tensor cov;  // [H, D, D] f64
      int64_t n_all = 0;
      for (const auto& xw : src) {
        auto x = xw.to(at::kFloat);  // [H, T, D]
        KAKEYA_CHECK(at::isfinite(x).all().item<bool>(), "basis: layer " << l << " captured " << kind << " holds NaN or Inf");
        if (W.defined()) x = at::bmm(x, W);
        const int64_t T = x.size(1), blk = opt.block > 0 ? opt.block : T;
        for (int64_t s = 0; s < T; s += blk) {
          auto xb = x.slice(1, s, std::min(T, s + blk));
          xb = xb - xb.mean(1, true);  // the codec centres each block
          auto c = at::bmm(xb.transpose(1, 2), xb).to(at::kDouble);
          cov = cov.defined() ? cov + c : c;
          n_all += xb.size(1);
        }
      }
      cov = cov / (double)std::max<int64_t>(n_all, 1);
      auto eh = at::linalg_eigh(cov);  // ascending per head
      auto eig = std::get<0>(eh).flip({-1}).clamp_min(0);  // [H, D] descending
      auto vec = std::get<1>(eh).flip({-1});               // [H, D, D] columns match eig
      const std::string p = "layer_" + std::to_string(l) + "_" + kind;
      out[p + "_basis"] = vec.to(at::kFloat).cpu().contiguous();
      out[p + "_eig"] = eig.to(at::kFloat).cpu().contiguous();
      auto cum = eig.cumsum(-1) / eig.sum(-1, true);  // [H, D]
      lj[kind] = {{"rank_90", (cum.lt(0.9).sum(-1) + 1).cpu().to(at::kLong).mean(at::kDouble).item<double>()},
                  {"rank_99", (cum.lt(0.99).sum(-1) + 1).cpu().to(at::kLong).mean(at::kDouble).item<double>()},
                  {"rank_999", (cum.lt(0.999).sum(-1) + 1).cpu().to(at::kLong).mean(at::kDouble).item<double>()}};
    }
    stats.push_back(lj);
  }
  save_safetensors(dir + "/pca_basis.safetensors", out, {{"format", kCalibFormat}, {"config_hash", config_hash(cfg)}});
  entry["file"] = "pca_basis.safetensors";
  entry["block"] = opt.block;
  entry["kinds"] = kinds;
  entry["explained_variance"] = stats;
  CalibBundle::update_manifest(dir, cfg, "basis", entry);
  return stats;
}

// ---------------------------------------------------------------- Lloyd-Max codebooks

json fit_codebooks(const std::string& dir, const ModelConfig& cfg, const KVCapture& cap, const KVCodec& codec,
                   const CodebookOptions& opt, json entry) {
  for (int b : opt.bits) KAKEYA_CHECK(b >= 1 && b <= 4, "codebook: bits must be in 1..4, got " << b);
  const int64_t L = cfg.num_layers;
  std::vector<Stream> streams;
  for (Stream s : {Stream::K, Stream::V})
    if (codec.options().stream(s).coded) streams.push_back(s);
  KAKEYA_CHECK(!streams.empty(), "codebook: the codec codes neither K nor V");
  // samples[stream][layer]: unit-variance residual coordinates (flattened, strided subsample).
  std::vector<std::vector<std::vector<at::Tensor>>> samples(2, std::vector<std::vector<at::Tensor>>(L));
  for (Stream s : streams) {
    for (int64_t l = 0; l < L; ++l) {
      const auto& src = s == Stream::K ? cap.k(l) : cap.v(l);
      int64_t total = 0;
      for (const auto& x : src) total += x.numel();
      const int64_t stride = std::max<int64_t>(1, (total + opt.max_samples - 1) / opt.max_samples);
      int64_t phase = 0;
      ResidualSink sink = [&](int64_t, Stream, const at::Tensor& u) {
        auto f = u.reshape({-1});
        if (f.numel() > phase) samples[(int)s][l].push_back(f.slice(0, phase, f.numel(), stride).clone());
        phase = ((phase - f.numel()) % stride + stride) % stride;
      };
      for (const auto& x : src) codec.encode(l, s, x, sink);
    }
  }
  json summary = {{"codec", codec.options().describe()}, {"per_layer", opt.per_layer}, {"streams", json::object()}};
  for (Stream s : streams) {
    const std::string sn = stream_name(s);
    std::vector<at::Tensor> per_layer;
    for (int64_t l = 0; l < L; ++l) {
      KAKEYA_CHECK(!samples[(int)s][l].empty(),
                   "codebook: no " << sn << " residuals for layer " << l << " (boundary layer or empty capture?)");
      per_layer.push_back(at::cat(samples[(int)s][l]));
    }
    at::Tensor pooled;
    if (!opt.per_layer) pooled = at::cat(per_layer);
    json sj = json::object();
    for (int b : opt.bits) {
      std::vector<float> rows;
      json lj = json::array();
      const auto& g = gaussian_codebook(b);
      ScalarCodebook pooled_cb;
      if (!opt.per_layer) pooled_cb = lloyd_max_fit(pooled, b);
      double fit_sum = 0, gauss_sum = 0;
      for (int64_t l = 0; l < L; ++l) {
        const auto& x = per_layer[l];
        ScalarCodebook cb = opt.per_layer ? lloyd_max_fit(x, b) : pooled_cb;
        rows.insert(rows.end(), cb.centroids.begin(), cb.centroids.end());
        const double mf = empirical_mse(x, cb), mg = empirical_mse(x, g);
        fit_sum += mf;
        gauss_sum += mg;
        lj.push_back({{"layer", l}, {"mse_fitted", mf}, {"mse_gaussian_table", mg}, {"gain", mg / mf}, {"centroids", cb.centroids}});
      }
      CalibBundle::write_f32(dir + "/codebook_" + sn + "_b" + std::to_string(b) + ".f32", rows);
      sj["b" + std::to_string(b)] = {{"gaussian_optimal_mse_N01", gaussian_mse(g)},
                                     {"mse_fitted_mean", fit_sum / L},
                                     {"mse_gaussian_table_mean", gauss_sum / L},
                                     {"gain_mean", gauss_sum / fit_sum},
                                     {"layers", lj}};
    }
    // Shape of the residual distribution: what decides whether calibration can beat the Gaussian table.
    auto all = at::cat(per_layer).to(at::kDouble);
    const double m = all.mean().item<double>(), sd = all.std().item<double>();
    sj["samples"] = all.numel();
    sj["mean"] = m;
    sj["std"] = sd;
    sj["kurtosis"] = ((all - m) / sd).pow(4).mean().item<double>();
    sj["frac_abs_gt_2"] = all.abs().gt(2).to(at::kDouble).mean().item<double>();
    sj["frac_abs_gt_3"] = all.abs().gt(3).to(at::kDouble).mean().item<double>();
    summary["streams"][sn] = sj;
  }
  fs::write_atomic(dir + "/codebook_summary.json", summary.dump(2) + "\n");
  json sl = json::array();
  for (Stream s : streams) sl.push_back(stream_name(s));
  entry["streams"] = sl;
  entry["bits"] = opt.bits;
  entry["per_layer"] = opt.per_layer;
  entry["layout"] = "codebook_{stream}_b{bits}.f32: little-endian f32 [num_layers, 2^bits], row = layer, ascending";
  entry["codec"] = codec.options().describe();
  entry["summary"] = "codebook_summary.json";
  CalibBundle::update_manifest(dir, cfg, "codebook", entry);
  return summary;
}

}  // namespace kakeya::calib
