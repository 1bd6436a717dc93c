// Scenario A (seeds 003): clean prefill of `context` tokens, the codec applied
// once to the whole cache (every layer's K and/or V as the cache holds them:
// sliding layers only their window), then teacher-forced evaluation of the next
// `n_eval` tokens continuing from that coded cache through the same KVCache.
// Judged against the uncoded continuation: Δppl, top-1 agreement with the
// uncoded argmax, KL(uncoded ‖ coded), per passage.
//
// K/V are captured pre-RoPE during the prefill through Tap::KNorm / Tap::VNorm
// (exact, no inverse rotation, partial-rotary safe); after decoding, K gets the
// model's own RoPE (Model::rope) and both are written back with KVCache::write at
// their positions. The uncoded reference goes through the same rebuild, so the
// identity codec gives Δppl = 0 exactly (checked against the untouched prefill
// cache on the first passage: `rebuild_max_abs_logit_diff`).
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "calib/codec/calib_bundle.h"
#include "calib/codec/codec.h"
#include "core/model/model.h"

namespace kakeya::calib {

struct CodecEvalOptions {
  int64_t context = 512;      // prefill tokens (the coded cache)
  int64_t n_eval = 128;       // teacher-forced tokens scored after it
  int64_t chunk = 128;        // tokens per evaluation forward
  std::string streams = "kv"; // k | v | kv: the streams codecs may touch (the other stays exact)
  std::function<void(const std::string&)> log;  // progress lines
};

struct PassageScore {
  int64_t tokens = 0;
  double nll_ref = 0, nll = 0;  // mean NLL of the targets, uncoded and coded
  double top1 = 0;              // fraction of positions whose argmax equals the uncoded argmax
  double kl = 0;                // mean KL(uncoded ‖ coded), nats
  double dppl() const { return std::exp(nll - nll_ref) - 1.0; }
};

struct CodecEvalRow {
  std::string label, spec;             // as given, and every knob normalised
  int64_t bytes = 0, values = 0;       // coded cache (all layers, K and V; exact parts as bf16)
  int64_t shared_bytes = 0;            // bundle data the codec reads (once per model)
  double sq_err_k = 0, sq_ref_k = 0, sq_err_v = 0, sq_ref_v = 0;  // Σ‖x - x̂‖², Σ‖x - mean‖² per stream
  std::map<std::string, int64_t> bytes_by_field;
  double codec_seconds = 0;
  std::vector<PassageScore> passages;
  double bits_per_value() const { return values ? 8.0 * bytes / values : 0; }
  double ratio() const { return bytes ? 2.0 * values / bytes : 0; }  // vs bf16
  PassageScore pooled() const;  // token-weighted over passages
  nlohmann::json to_json() const;
};

struct CodecEvalResult {
  std::vector<CodecEvalRow> rows;
  std::vector<double> ppl_ref;  // per passage
  double rebuild_max_abs_logit_diff = 0;
  nlohmann::json to_json() const;
};

// passages: token ids, each at least context + n_eval + 1 long (extra is ignored).
CodecEvalResult codec_eval(const Model& model, const std::vector<std::vector<int64_t>>& passages,
                           const std::vector<CodecOptions>& codecs, const CalibBundle* bundle,
                           const CodecEvalOptions& opt);

}  // namespace kakeya::calib
