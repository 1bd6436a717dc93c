// One entry point per decode mode (ar | restored-reforward | restored | fused) that keeps its
// state across prompts, as a server keeps it across requests: a Decoder is built for a mode,
// its options and a capacity (the positions of the longest prompt + new tokens it will serve),
// allocates its caches and static buffers once, captures its CUDA graphs on the first greedy
// run and replays them in every later one. decode() is a Decoder used once.
//   ar                  ArDecoder (infer/generate.h), memory report of the full-KV cache
//   restored            RestoredDecoder (infer/restored.h)
//   restored-reforward  decode_reforward (the slow reference keeps nothing between tokens)
//   fused               FusedDecoder (infer/fused.h)
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "infer/fused.h"
#include "infer/generate.h"
#include "infer/restored.h"

namespace kakeya {

class Decoder {
 public:
  // drafter/ftheta as the mode needs them (see decode()); capacity: prompt + new tokens of the
  // longest run. Options the graphs depend on (mode, restore, sampling, block size, cuda_graph)
  // are fixed here; run() refuses others by name.
  Decoder(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const DecodeOptions& opt,
          int64_t capacity);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  DecodeResult run(const std::vector<int64_t>& prompt, const DecodeOptions& opt);
  // fused runs only: the per-block time split of the last run.
  const FusedTiming& fused_split() const { return split_; }

 private:
  const Model& v_;
  const Drafter* d_;
  const FTheta* f_;
  DecodeOptions opt_;
  int64_t capacity_;
  std::unique_ptr<ArDecoder> ar_;
  std::unique_ptr<RestoredDecoder> restored_;
  std::unique_ptr<FusedDecoder> fused_;
  FusedTiming split_;
};

// The checks decode() runs before anything is allocated (validate_restore / validate_fused,
// the model's position limit): throws on bad input with the flag and value at fault.
void decode_checks(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                   const std::vector<int64_t>& prompt, const DecodeOptions& opt);

// One decode session. drafter/ftheta: required by the restored modes unless a = 1; fused
// drafts with the drafter. Throws on bad input with the flag and value at fault.
DecodeResult decode(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                    const std::vector<int64_t>& prompt, const DecodeOptions& opt);

}  // namespace kakeya
