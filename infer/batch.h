// Continuous batching of decode sequences (`kakeya serve --batch N`): up to N sequences decode
// together, one token each per batched forward, each in its own row of one cache of independent
// rows (KVCacheOptions::rows: every row at its own positions, `capacity` per row). Two modes:
//   ar        rows of the model's own cache (as ArDecoder);
//   restored  rows of the restored cache (as RestoredDecoder: sinks + exact window, older positions
//             restored through f_θ into the row's restored region, optionally coded; --full-attn
//             codec rows coded as they are written). Each row keeps its own Restorer.
//
// A sequence joins between steps, into the first free row: its prompt is prefilled alone, as its
// one-sequence decoder prefills it, straight into the row (KVCache::row: a view of one row, so the
// prefill and the row's Restorer write where the batched steps read), and its first token is
// sampled from the last logits. It leaves between steps and frees its row. A step runs the rows up
// to the last one in use (free rows among them decode token 0 at position 0 into rows nobody
// reads; a joining sequence clears its row first). Restored rows are restored in batches between
// steps, each row on its own schedule (Restorer::next_upkeep), and every step stores each row's
// target features into that row's part of one shared feature ring, which its Restorer reads.
//
// Each row's logits are sampled as the one-sequence decoder samples them (greedy: argmax;
// otherwise the sequence's own seeded Sampler), so a sequence's tokens do not depend on which
// others share its steps — up to the rounding of a GEMM over several rows instead of one (the
// same tokens in f32; bf16 may differ where two logits nearly tie).
//
// On CUDA a greedy step runs as a CUDA graph over a bucket of rows (the next power of two of the
// rows in use), captured the first time its bucket is used (or by capture_all); steps with sampled
// rows, and MoE models over more rows than the experts' gathered path takes, run eagerly. A
// restored row's prefill replays its own steady-chunk graph (infer/restorer.h ChunkGraph).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/kv_cache.h"
#include "core/model/model.h"
#include "core/model/sampling.h"
#include "infer/options.h"
#include "infer/restorer.h"

#ifdef KAKEYA_CUDA
namespace at::cuda {
struct CUDAGraph;
}
#endif

namespace kakeya {

class BatchDecoder {
 public:
  // opt.mode: ar or restored (opt.restore; drafter/ftheta as the restored decoder takes them:
  // required unless evict-only); opt.cuda_graph: graphs on CUDA. max_rows: sequences decoded
  // together; capacity: positions one sequence may reach (prompt + new tokens).
  BatchDecoder(const Model& model, const Drafter* drafter, const FTheta* ftheta, const DecodeOptions& opt,
               int64_t max_rows, int64_t capacity);
  ~BatchDecoder();

  int64_t max_rows() const { return pool_.options().batch; }
  int64_t size() const { return seated_; }  // sequences seated now
  int64_t capacity() const { return pool_.capacity(); }
  bool restores() const { return opt_.mode == DecodeMode::Restored; }
  // Every row's K/V (and restored region), and the restorers' rings of pending f_θ inputs.
  int64_t kv_bytes() const;

  // Seats a new sequence: prefills `prompt`, samples its first token. max_new_tokens: the most
  // tokens it will produce (the first one included; prompt + max_new_tokens <= capacity).
  // Returns {id, first token}. Throws, seating nothing, when every row is taken or it cannot fit.
  std::pair<int64_t, int64_t> join(const std::vector<int64_t>& prompt, const SamplingOptions& sampling,
                                   int64_t max_new_tokens);
  // One token for every seated sequence (each fed its previous one): {id, token} in row order.
  // Throws when a sequence has produced its max_new_tokens (it must leave first).
  std::vector<std::pair<int64_t, int64_t>> step();
  void leave(int64_t id);  // frees its row; unknown ids are an error
  // Captures every bucket's graph now (CUDA; nothing elsewhere), so no step waits for a capture
  // (a server before it listens).
  void capture_all();

 private:
  struct Seq {
    int64_t id = 0;
    int64_t length = 0;  // positions its row holds (the next step feeds position `length`)
    int64_t end = 0;     // prompt + max_new_tokens: it produces tokens while length + 1 < end
    std::unique_ptr<Sampler> sampler;
  };
  struct Row {
    Row(KVCache view, int64_t b) : cache(std::move(view)), index(b) {}
    KVCache cache;                       // this row of pool_, as a cache of one sequence
    int64_t index;                       // its row in pool_
    std::unique_ptr<Restorer> rest;      // restored mode: keeps the row's restored region
    std::unique_ptr<ChunkGraph> chunks;  // restored mode: the row's steady prefill chunk
    std::optional<Seq> seq;              // the sequence seated here, if any
  };
  // The forward of the first n rows from the static buffers (restored: storing their target
  // features), argmax into next_, and the next step's inputs: ids_ = next_, pos_ += live_;
  // returns their logits [n, V] f32.
  at::Tensor run_rows(int64_t n);
  int64_t rows_in_use() const;  // the last seated row + 1
#ifdef KAKEYA_CUDA
  // The graph of a step over `rows` rows (captured on first use), or null where steps run eagerly.
  at::cuda::CUDAGraph* graph(int64_t rows);
#endif
  const Model& model_;
  const Drafter* drafter_;
  const FTheta* ftheta_;
  DecodeOptions opt_;
  KVCache pool_;  // [max_rows] independent rows
  std::vector<std::unique_ptr<Row>> rows_;
  int64_t seated_ = 0;
  int64_t next_id_ = 0;
  // A step's static buffers, int64 on the device: ids_, pos_ [max_rows, 1] what each row feeds
  // and where; live_ [max_rows, 1] 1 on seated rows (their position advances), 0 on free ones;
  // next_ [max_rows] each row's new token.
  at::Tensor ids_, pos_, live_, next_;
  // Restored rows whose f_θ reads target features: the step stores row b's into rows
  // b·ring_ .. b·ring_ + ring_ - 1 of feat_ring_ (its Restorer's feature ring), at feat_rows_.
  std::unique_ptr<TargetFeatureCapture> feats_;
  int64_t ring_ = 0;
  at::Tensor feat_ring_;             // [max_rows · ring_, n·H]
  at::Tensor feat_base_, feat_rows_;  // [max_rows] int64: b·ring_, and this step's row of each
  struct Graphs;                      // per bucket of rows (CUDA builds)
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace kakeya
