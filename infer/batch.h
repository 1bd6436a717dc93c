// Continuous batching of AR decode sequences (`kakeya serve --batch N`): up to N sequences
// decode together, one token each per batched forward, each in its own row of one cache of
// independent rows (KVCacheOptions::rows: every row at its own positions, `capacity` per row).
//
// A sequence joins between steps: its prompt is prefilled alone, as ArDecoder prefills (one
// forward into a one-row cache, the first token sampled from its last logits), and its K/V are
// copied into the first free row. It leaves between steps; the last row then moves into its
// place, so the rows in use are always the first size() and a step runs over exactly those
// (KVCache::first_rows). Each row's logits are sampled as ArDecoder samples them (greedy:
// argmax; otherwise the sequence's own seeded Sampler), so a sequence's tokens do not depend on
// which others share its steps — up to the rounding of a GEMM over several rows instead of one
// (the same tokens in f32; bf16 may differ where two logits nearly tie).
//
// On CUDA a greedy step runs as a CUDA graph over a bucket of rows (the next power of two of
// size(), rows past size() fed token 0 at position 0 into rows nobody reads), captured the first
// time its bucket is used (or by capture_all); steps with sampled rows, and MoE models over
// more rows than the experts' gathered path takes, run eagerly.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/model/kv_cache.h"
#include "core/model/model.h"
#include "core/model/sampling.h"

#ifdef KAKEYA_CUDA
namespace at::cuda {
struct CUDAGraph;
}
#endif

namespace kakeya {

class BatchDecoder {
 public:
  // max_rows: sequences decoded together; capacity: positions one sequence may reach (prompt +
  // new tokens). Allocates max_rows + 1 rows of K/V (the extra one prefills joins).
  BatchDecoder(const Model& model, int64_t max_rows, int64_t capacity, bool cuda_graphs = true);
  ~BatchDecoder();

  int64_t max_rows() const { return pool_.options().batch; }
  int64_t size() const { return (int64_t)seqs_.size(); }  // sequences seated now
  int64_t capacity() const { return pool_.capacity(); }
  int64_t kv_bytes() const { return pool_.bytes() + prefill_.bytes(); }  // every row, and the prefill row

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
    int64_t length = 0;  // positions its row holds
    int64_t last = 0;    // the token the next step feeds (at position `length`)
    int64_t end = 0;     // prompt + max_new_tokens: it produces tokens while length + 1 < end
    std::unique_ptr<Sampler> sampler;
  };
  // The forward of the first n rows from the static buffers, argmax into next_; returns their
  // logits [n, V] f32 (an eager step samples its sampled rows from them).
  at::Tensor run_rows(int64_t n);
#ifdef KAKEYA_CUDA
  // The graph of a step over `rows` rows (captured on first use), or null where steps run eagerly.
  at::cuda::CUDAGraph* graph(int64_t rows);
#endif
  const Model& model_;
  KVCache pool_;     // [max_rows] independent rows
  KVCache prefill_;  // one row: a joining sequence's prompt
  std::vector<Seq> seqs_;  // row order
  int64_t next_id_ = 0;
  bool cuda_graphs_;
  at::Tensor ids_, pos_, next_;  // [max_rows, 1], [max_rows, 1], [max_rows] int64: a step's static buffers
  struct Graphs;                 // per bucket of rows (CUDA builds)
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace kakeya
