#include "train/ftheta_select.h"

#include <cmath>
#include <string>

#include "core/error.h"

namespace kakeya::train {
using json = nlohmann::json;

json select_restore_layers(const Model& verifier, const Drafter& drafter, FTheta& f,
                           const std::vector<std::vector<int64_t>>& seqs, const LayerSelectOptions& o,
                           const std::function<void(int64_t, int64_t)>& progress) {
  KAKEYA_CHECK(!seqs.empty(), "ftheta-layers: no held-out sequences to measure on");
  const ModelConfig& cfg = verifier.config();
  std::vector<int64_t> covered;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (cfg.is_sliding(l) || o.restore.full_attn == FullAttn::Restored) covered.push_back(l);
  const int64_t total = (int64_t)(covered.size() + 3) * (int64_t)seqs.size();
  int64_t done = 0;
  if (progress) progress(0, total);
  // Mean NLL per token over every sequence with the given --restore-layers.
  auto nll = [&](const std::string& layers) {
    RestoreOptions ro = o.restore;
    ro.layers = layers;
    double sum = 0;
    int64_t n = 0;
    for (const auto& s : seqs) {
      ScoreResult r = score_restored(verifier, &drafter, &f, s, ro);
      for (double lp : r.logprobs) sum -= lp;
      n += (int64_t)r.logprobs.size();
      if (progress) progress(++done, total);
    }
    return sum / (double)n;
  };
  auto join = [](const std::vector<int64_t>& ls) {
    std::string s;
    for (int64_t l : ls) s += (s.empty() ? "" : ",") + std::to_string(l);
    return s;
  };
  const double none = nll("none"), all = nll("all");
  json per_layer = json::array();
  std::vector<int64_t> chosen;
  for (int64_t l : covered) {
    const double alone = nll(std::to_string(l));
    const double gain = none - alone;
    per_layer.push_back({{"layer", l}, {"nll_alone", alone}, {"gain_nats", gain}});
    if (gain > o.min_gain) chosen.push_back(l);
  }
  double chosen_nll = none;
  if (!chosen.empty() && chosen.size() < covered.size()) chosen_nll = nll(join(chosen));
  else if (chosen.size() == covered.size()) chosen_nll = all;
  if (progress) progress(total, total);
  // The best of the three sets.
  std::vector<int64_t> pick = chosen;
  double best = chosen_nll;
  std::string why = "layers that gain alone";
  if (all < best) {
    pick = covered;
    best = all;
    why = "every covered layer (beats the layers that gain alone)";
  }
  if (none <= best) {
    pick.clear();
    best = none;
    why = "no layer: dropping the restored positions is best";
  }
  f.mutable_config().restore_layers = pick;
  f.mutable_config().restore_layers_measured = true;
  auto ppl = [](double x) { return std::exp(x); };
  return {{"sequences", (int64_t)seqs.size()},
          {"tokens_per_sequence", (int64_t)seqs[0].size()},
          {"restore", o.restore.to_json()},
          {"min_gain", o.min_gain},
          {"nll", {{"none", none}, {"all", all}, {"chosen", chosen_nll}}},
          {"ppl", {{"none", ppl(none)}, {"all", ppl(all)}, {"chosen", ppl(chosen_nll)}, {"selected", ppl(best)}}},
          {"per_layer", per_layer},
          {"chosen_alone", chosen},
          {"restore_layers", pick},
          {"why", why}};
}

}  // namespace kakeya::train
