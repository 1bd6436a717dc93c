// Which layers to restore (`kakeya ftheta-layers`): a restored layer that does not beat dropping
// its restored positions (evict-only: sinks + the exact window) is a defect, so it is measured
// per layer on held-out text and only the layers that help read restored K/V.
//
// Measure: mean teacher-forced NLL over held-out token sequences through the restored cache
// (infer/restored.h score_restored), for
//   none                 every covered layer drops (the baseline restoration must beat)
//   {l}, each covered l  only layer l restores: gain(l) = NLL(none) - NLL({l})
//   all                  every covered layer restores
//   chosen               the layers with gain(l) > min_gain
// The answer is all, or chosen where it is significantly better than all (paired 95% interval of
// the per-sequence NLL difference below 0: short held-out sequences barely see a restored region
// at large windows, and a subset chosen on noise can drop layers long contexts need), or none
// when it is no worse than that (restoring no layer is what helps, and the config says so); it
// goes into f_θ's config (FThetaConfig::restore_layers), which RestoreOptions::layers "auto" reads.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "infer/restored.h"

namespace kakeya::train {

struct LayerSelectOptions {
  RestoreOptions restore;   // sink, window, full-attn policy of the measurement (layers is set per run)
  double min_gain = 0.0;    // nats per token a layer must gain alone to be chosen
};

// Sets f.restore_layers (measured) and returns the report: per configuration its NLL, per layer
// its gain, the choice. progress(done, total) after every scored sequence.
nlohmann::json select_restore_layers(const Model& verifier, const Drafter& drafter, FTheta& f,
                                     const std::vector<std::vector<int64_t>>& seqs, const LayerSelectOptions& o,
                                     const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace kakeya::train
