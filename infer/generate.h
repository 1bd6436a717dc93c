// The plain autoregressive decode loop (the `ar` baseline every other mode is
// compared with): prefill, then one token per forward. On CUDA the decode step
// is captured once as a CUDA graph that also feeds its own output back, so the
// steady state launches one graph per token and syncs only to stream text.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/model.h"
#include "core/sampling.h"

namespace kakeya {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;
  std::vector<int64_t> stop_ids;        // generation ends after emitting one of these
  bool cuda_graph = true;               // CUDA only
  bool stream = true;                   // call on_token per token (one host sync each)
  std::function<void(int64_t)> on_token;
};

struct GenerateResult {
  std::vector<int64_t> tokens;          // generated ids (prompt excluded)
  double prefill_seconds = 0;
  double decode_seconds = 0;            // from the first to the last generated token
  int64_t cache_bytes = 0;
  double decode_tokens_per_second() const {
    return tokens.size() > 1 && decode_seconds > 0 ? (tokens.size() - 1) / decode_seconds : 0.0;
  }
};

GenerateResult generate(const Model& model, const std::vector<int64_t>& prompt, const GenerateOptions& opt);

}  // namespace kakeya
