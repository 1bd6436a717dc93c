// Which full-attention layers get a richer row code than the others (--full-code BASE+L=RICH),
// chosen by what each layer's upgrade buys in perplexity on calibration text: `kakeya calibrate
// layer-codes` writes the choice into the calibration bundle (entry "layer_codes"), and
// `--full-code auto` reads it. The text is the calibration corpus, never the evaluation documents,
// so a layer chosen here is judged afresh by `kakeya eval-long`.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <vector>

#include "core/model/model.h"
#include "infer/options.h"

namespace kakeya {

struct LayerCodeOptions {
  // The decoder the codes are chosen for: full_attn Codec, full_code the base code (every
  // full-attention layer's), no layer codes of its own. Exact restoration (mix_alpha 1) needs
  // neither drafter nor f_θ, so nothing but the verifier runs.
  RestoreOptions decoder;
  ops::RowCode rich;        // the code a chosen layer gets
  int64_t layers = 1;       // at most this many layers get it (only those whose upgrade lowers the NLL)
  int64_t context = 16384;  // tokens a window (the model's BOS first where it has one)
  int64_t tail = 512;       // last tokens of a window scored
  int64_t windows = 4;      // consecutive windows of the text (at most what it holds)
};

using LayerCodeProgress = std::function<void(int64_t done, int64_t total)>;  // tokens scored, from (0, total)

// Scores every window (teacher-forced, as decode steps see the cache: score_restored) with the
// full-attention layers exact (the reference), with the base code on every one, and for each
// full-attention layer L that stores K/V with L in `rich`; chooses the `layers` upgrades of largest
// mean NLL gain over the base code, paired per window, among those that gain. ids: the text's
// tokens without BOS. Returns
//   {"code": "pw4+11=pw5v4" (the base code alone when none gains), "base", "rich", "chosen": [L],
//    "exact_nll", "base_nll", "per_layer": [{"layer", "nll", "gain", "gain_ci95", "extra_bytes"}],
//    "windows", "context", "tail", "decoder"}
// (NLLs in nats per token; extra_bytes: what the upgrade adds per position of the layer).
nlohmann::json select_layer_codes(const Model& verifier, const std::vector<int64_t>& ids, const LayerCodeOptions& o,
                                  const LayerCodeProgress& progress = nullptr);

}  // namespace kakeya
