#include "infer/result.h"

#include <cmath>

namespace kakeya {

double RestoreStats::rel(bool full, bool v, bool cache_space) const {
  const auto& a = (cache_space ? cache : raw)[full ? 1 : 0][v ? 1 : 0];
  return a[1] > 0 ? std::sqrt(a[0] / a[1]) : 0.0;
}

RestoreStats& RestoreStats::operator+=(const RestoreStats& o) {
  for (int t = 0; t < 2; ++t)
    for (int st = 0; st < 2; ++st)
      for (int e = 0; e < 2; ++e) {
        raw[t][st][e] += o.raw[t][st][e];
        cache[t][st][e] += o.cache[t][st][e];
      }
  positions += o.positions;
  return *this;
}

nlohmann::json RestoreStats::to_json() const {
  nlohmann::json j{{"positions", positions}};
  for (int t = 0; t < 2; ++t) {
    const char* type = t ? "full" : "sliding";
    bool any = raw[t][0][1] > 0;
    if (!any) continue;
    j[type] = {{"raw_k", rel(t, false, false)},
               {"raw_v", rel(t, true, false)},
               {"cache_k", rel(t, false, true)},
               {"cache_v", rel(t, true, true)}};
  }
  return j;
}

FusedTiming& FusedTiming::operator+=(const FusedTiming& o) {
  draft += o.draft;
  verify += o.verify;
  extend += o.extend;
  restore += o.restore;
  restore_overlapped = restore_overlapped || o.restore_overlapped;
  capture += o.capture;
  blocks += o.blocks;
  return *this;
}

nlohmann::json FusedTiming::to_json() const {
  auto per = [&](double s) { return blocks > 0 ? 1e3 * s / blocks : 0.0; };
  return {{"blocks", blocks},
          {"draft_seconds", draft},
          {"verify_seconds", verify},
          {"restore_seconds", restore},
          {"restore_overlapped", restore_overlapped},
          {"extend_seconds", extend},
          {"upkeep_seconds", upkeep()},
          {"capture_seconds", capture},
          {"ms_per_block", {{"draft", per(draft)}, {"verify", per(verify)}, {"upkeep", per(upkeep())},
                            {"restore", per(restore)}, {"extend", per(extend)}}}};
}

int64_t DecodeResult::committed_tokens() const {
  int64_t n = 0;
  for (int64_t c : committed) n += c;
  return n;
}

double DecodeResult::tau() const {
  int64_t n = 0;
  for (int64_t c : committed) n += c;
  return committed.empty() ? 0.0 : (double)n / (double)committed.size();
}
}  // namespace kakeya
