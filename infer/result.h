// The one result every decode mode returns (tokens, timings, memory, mode-specific figures).
#pragma once
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "infer/memory.h"

namespace kakeya {

// Relative error of restored vs true K/V, accumulated over every restored
// (position, layer), split by layer type and stream: sqrt(Σ‖r - t‖² / Σ‖t‖²),
// in raw space (what f_θ predicts) and in cache space (after k_norm/v_norm + RoPE,
// what attention reads). Sinks (exact copies) are not counted.
struct RestoreStats {
  // [type: 0 sliding, 1 full][stream: 0 K, 1 V][0 err², 1 ref²], raw and cache space.
  std::array<std::array<std::array<double, 2>, 2>, 2> raw{}, cache{};
  int64_t positions = 0;     // positions restored through f_θ
  double rel(bool full, bool v, bool cache_space) const;
  RestoreStats& operator+=(const RestoreStats& o);
  nlohmann::json to_json() const;
};

// Seconds summed over blocks (the prefill and the first token excluded).
struct FusedTiming {
  double draft = 0, verify = 0, extend = 0;
  // Restoration batches (device time). On CUDA with graphs they run on a side stream next to
  // the blocks (restore_overlapped): not on the critical path, so not part of upkeep().
  double restore = 0;
  bool restore_overlapped = false;
  double capture = 0;  // CUDA graph capture (host wall time, inside the decode time; a decoder's first run)
  int64_t blocks = 0;
  // Cache upkeep on the critical path: the drafter context extension (+ restoration when in place).
  double upkeep() const { return extend + (restore_overlapped ? 0.0 : restore); }
  FusedTiming& operator+=(const FusedTiming& o);
  nlohmann::json to_json() const;
};

struct DecodeResult {
  std::vector<int64_t> tokens;          // generated ids (prompt excluded)
  double prefill_seconds = 0;           // from the call to the first generated token
  double decode_seconds = 0;            // from the first generated token to the last
  double capture_seconds = 0;           // CUDA graph captures of a decoder's first run (in decode_seconds; the restored prefill chunk's in prefill_seconds)
  int64_t steady_allocations = -1;      // CUDA allocations from the first graph replay to the end (-1: no replay)
  // DecodeOptions::megakernel: how the step ran ("N launches as P persistent-kernel launches of G
  // blocks + K kernels", or why it kept its kernels); empty when not asked.
  std::string step_program;
  MemoryReport memory;
  int64_t served_positions = 0;         // positions that went through the verifier (prompt + fed tokens)
  // Restored modes.
  RestoreStats stats;                   // filled when restore.stats
  // Share of each layer type's span the last query attends to through exactly one
  // exact or restored copy per position (1.0 = nothing lost, nothing twice); -1: no such layers.
  double attention_fraction_sliding = -1, attention_fraction_full = -1;
  int64_t restored_positions = 0;       // positions that left the exact window
  // Speculative modes (fused, spec).
  std::vector<int64_t> committed;       // tokens committed by each verify forward
  FusedTiming split;                    // fused: per-part times
  int64_t block_size = 0;               // tokens per verify forward
  bool cuda_graph = false;              // fused: the blocks replayed CUDA graphs
  std::vector<std::string> warnings;    // e.g. a block larger than the drafter was trained for
  double tau() const;                   // mean of `committed` (0 if none)
  int64_t committed_tokens() const;     // sum of `committed`
  int64_t verify_forwards() const { return (int64_t)committed.size(); }
  double decode_tokens_per_second() const {
    return tokens.size() > 1 && decode_seconds > 0 ? (tokens.size() - 1) / decode_seconds : 0.0;
  }
};

}  // namespace kakeya
