// The restored decoders (DecodeMode::Restored and the RestoredReforward reference) and
// teacher-forced scoring through the restored cache. The rules they implement and the
// Restorer that applies them: infer/restorer.h.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/sampling.h"
#include "infer/decoder.h"
#include "infer/generate.h"
#include "infer/restorer.h"
#include "infer/score.h"
#include "infer/upkeep.h"

namespace kakeya {

// The incremental restored decoder: its KV cache for `capacity` positions, Restorer, step
// buffers, restoration runner and CUDA graphs (the decode step's, the restoration batch's and
// the steady prefill chunk's) are built once (as ArDecoder's). drafter/ftheta: required unless
// a = 1 or evict-only.
class RestoredDecoder : public Decoder {
 public:
  RestoredDecoder(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const DecodeOptions& opt,
                  int64_t capacity);
  ~RestoredDecoder() override;
  int64_t capacity() const override { return cache_.capacity(); }
  int64_t length() const override { return cache_.length(); }
  MemoryReport memory() const override;

 private:
  DecodeResult feed(const std::vector<int64_t>& tokens, const DecodeOptions& opt, bool fresh) override;
  const Model& v_;
  const Drafter* d_;
  const FTheta* f_;
  KVCache cache_;
  Restorer rest_;
  Sampler sampler_;
  at::Tensor cur_, pos_, step_, out_;  // [1, 1], [1], [1], [capacity] int64: the step's static buffers
  std::unique_ptr<UpkeepRunner> upkeep_;
  DecodeLoop loop_;
  ChunkGraph chunks_;  // the steady prefill chunk's graph (CUDA)
};

// The slow reference (DecodeMode::RestoredReforward): per generated token the whole prefix
// again from an empty cache with one slot per position. Keeps nothing between calls.
class ReforwardDecoder : public Decoder {
 public:
  ReforwardDecoder(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const DecodeOptions& opt,
                   int64_t capacity);
  bool extends() const override { return false; }
  int64_t capacity() const override { return capacity_; }
  int64_t length() const override { return 0; }
  MemoryReport memory() const override { return last_memory_; }

 private:
  DecodeResult feed(const std::vector<int64_t>& tokens, const DecodeOptions& opt, bool fresh) override;
  const Model& v_;
  const Drafter* d_;
  const FTheta* f_;
  int64_t capacity_;
  MemoryReport last_memory_;
};

// Teacher-forced scoring (infer/score.h logic) through the incremental restored
// cache: the sequence runs in chunks of <= window tokens, each chunk's logits
// scored against the next tokens. One window (the whole sequence, <= the model's positions).
ScoreResult score_restored(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                           const std::vector<int64_t>& ids, const RestoreOptions& opt, RestoreStats* stats = nullptr);

}  // namespace kakeya
