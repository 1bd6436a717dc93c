#include "infer/layer_codes.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "infer/long_eval.h"
#include "infer/restored.h"

namespace kakeya {

namespace {

// Bytes of one position's K and V rows of layer l in `c` (a weighted code's K weights and the
// rows' means are per layer, not per position).
int64_t position_bytes(const ModelConfig& cfg, int64_t l, const ops::RowCode& c) {
  return cfg.kv_heads(l) * ops::row_pair_bytes(cfg.layer_head_dim[l], c);
}

}  // namespace

nlohmann::json select_layer_codes(const Model& v, const std::vector<int64_t>& ids, const LayerCodeOptions& o,
                                  const LayerCodeProgress& progress) {
  const ModelConfig& cfg = v.config();
  const RestoreOptions& base = o.decoder;
  KAKEYA_CHECK(base.full_attn == FullAttn::Codec && base.full_code.defined() && base.full_code_layers.empty(),
               "calibrate layer-codes: the decoder must code its full-attention layers with one base code "
               "(--full-code CODE, no +L=CODE), got " << ops::layer_codes_name(base.full_code, base.full_code_layers));
  KAKEYA_CHECK(!base.needs_ftheta(), "calibrate layer-codes: the decoder must restore exactly (mix_alpha 1) or evict: "
                                      "the choice runs no drafter or f_θ");
  KAKEYA_CHECK(o.rich.defined() && !(o.rich == base.full_code),
               "calibrate layer-codes: --rich must be a code other than the base code "
                   << ops::row_code_name(base.full_code) << ", got " << ops::row_code_name(o.rich));
  KAKEYA_CHECK(o.tail >= 1 && o.tail < o.context,
               "calibrate layer-codes: --tail " << o.tail << " must be in [1, " << o.context - 1 << "] (--context "
                                                << o.context << ")");
  KAKEYA_CHECK(o.windows >= 1, "calibrate layer-codes: --windows expected >= 1, got " << o.windows);
  const int64_t limit = cfg.max_position_embeddings;
  KAKEYA_CHECK(limit <= 0 || o.context <= limit, "calibrate layer-codes: --context " << o.context << " exceeds the model's limit of "
                                                                                   << limit << " positions (max_position_embeddings)");
  KAKEYA_CHECK(base.sink + base.window < o.context,
               "calibrate layer-codes: --sink " << base.sink << " + --window " << base.window << " must be below --context "
                                                << o.context << " (no position would leave the window to be coded)");
  std::vector<int64_t> full;  // the full-attention layers that store K/V: the ones a code applies to
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (cfg.stores_full_kv(l)) full.push_back(l);
  KAKEYA_CHECK(!full.empty(), "calibrate layer-codes: the model has no full-attention layer that stores K/V");
  KAKEYA_CHECK(o.layers >= 0 && o.layers <= (int64_t)full.size(),
               "calibrate layer-codes: --layers " << o.layers << " must be in [0, " << full.size()
                                                  << "] (the model's full-attention layers that store K/V)");

  // Windows: [BOS] + the next context - 1 (or context) tokens of the text, back to back.
  const bool bos = cfg.bos_token_id >= 0;
  const int64_t body = o.context - (bos ? 1 : 0);
  const int64_t available = (int64_t)ids.size() / body;
  KAKEYA_CHECK(available >= 1, "calibrate layer-codes: the text holds " << ids.size() << " tokens, one window of --context "
                                                                        << o.context << " needs " << body);
  const int64_t W = std::min(o.windows, available);
  std::vector<std::vector<int64_t>> windows(W);
  for (int64_t w = 0; w < W; ++w) {
    if (bos) windows[w].push_back(cfg.bos_token_id);
    windows[w].insert(windows[w].end(), ids.begin() + w * body, ids.begin() + (w + 1) * body);
  }

  // The configs: exact full-attention layers, the base code, then one upgrade per layer.
  std::vector<RestoreOptions> configs;
  RestoreOptions exact = base;
  exact.full_attn = FullAttn::Exact;
  configs.push_back(exact);
  configs.push_back(base);
  for (int64_t l : full) {
    RestoreOptions r = base;
    r.full_code_layers.assign(l + 1, ops::RowCode{});
    r.full_code_layers[l] = o.rich;
    configs.push_back(r);
  }
  std::vector<std::vector<double>> nll(configs.size());  // [config][window]
  const int64_t total = W * (int64_t)configs.size() * o.context;  // tokens scored
  int64_t done = 0;
  if (progress) progress(0, total);
  for (int64_t w = 0; w < W; ++w)
    for (size_t c = 0; c < configs.size(); ++c) {
      nll[c].push_back(tail_nll(score_restored(v, nullptr, nullptr, windows[w], configs[c]), o.tail));
      if (progress) progress(done += o.context, total);
    }

  // Gains over the base code, paired per window; the largest positive ones are chosen.
  nlohmann::json per_layer = nlohmann::json::array();
  std::vector<std::pair<double, int64_t>> gains;
  for (size_t i = 0; i < full.size(); ++i) {
    const auto d = paired_differences(nll[1], nll[2 + i]);
    const double g = mean(d);
    const auto ci = mean_ci95(d);
    auto finite = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
    per_layer.push_back({{"layer", full[i]},
                         {"nll", mean(nll[2 + i])},
                         {"gain", g},
                         {"gain_ci95", {finite(ci.first), finite(ci.second)}},
                         {"extra_bytes", position_bytes(cfg, full[i], o.rich) - position_bytes(cfg, full[i], base.full_code)}});
    if (g > 0) gains.push_back({g, full[i]});
  }
  std::sort(gains.begin(), gains.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int64_t> chosen;
  for (size_t i = 0; i < gains.size() && (int64_t)i < o.layers; ++i) chosen.push_back(gains[i].second);
  std::sort(chosen.begin(), chosen.end());
  std::vector<ops::RowCode> codes;
  if (!chosen.empty()) codes.assign(chosen.back() + 1, ops::RowCode{});
  for (int64_t l : chosen) codes[l] = o.rich;

  return {{"code", ops::layer_codes_name(base.full_code, codes)},
          {"base", ops::row_code_name(base.full_code)},
          {"rich", ops::row_code_name(o.rich)},
          {"chosen", chosen},
          {"exact_nll", mean(nll[0])},
          {"base_nll", mean(nll[1])},
          {"per_layer", per_layer},
          {"windows", W},
          {"context", o.context},
          {"tail", o.tail},
          {"decoder", base.to_json()}};
}

}  // namespace kakeya
