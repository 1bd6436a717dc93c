// What a decode session holds in memory, next to two honest baselines at the same context:
// full KV (every layer, every position) and the model's native cache (Gemma 3's sliding
// layers only ever keep their sliding window). Entries are typed (MemoryPart), so a mode that
// adds state (fused: the drafter's context) sets its part instead of editing a line by name.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/model/config.h"
#include "infer/options.h"

namespace kakeya {

class Model;
class Drafter;
class FTheta;
class KVCache;
class Restorer;
struct DrafterConfig;
struct FThetaConfig;

enum class MemoryPart {
  // K/V-like state (counted in MemoryReport::kv_bytes)
  SlidingExact,     // sliding layers: exact ring (AR: the native window ring)
  SlidingRestored,  // sliding layers: restored region
  FullExact,        // full-attention layers: every position (AR, --full-attn exact) or the exact ring
  FullRestored,     // full-attention layers: restored region (--full-attn restored)
  FullCoded,        // full-attention layers: every position as coded rows (--full-attn codec)
  RestorePending,   // f_θ inputs of positions not restored yet
  TrueRaw,          // true raw K/V kept for --mix-alpha / statistics
  DrafterContext,   // the drafter's context cache (modes that draft)
  // parameters (listed, not counted as KV)
  VerifierWeights,
  DrafterWeights,
  FThetaWeights,
};
const char* memory_part_key(MemoryPart p);  // stable JSON key, e.g. "sliding_exact"
bool is_weights(MemoryPart p);

struct MemoryLine {
  MemoryPart part;
  std::string name;    // what a reader sees in the table
  int64_t bytes = 0;
  std::string note;
  bool grows = false;  // grows with the context (e.g. exact full-attention K/V under S5)
};

struct MemoryReport {
  int64_t positions = 0;              // context the caches serve (prompt + new tokens)
  std::vector<MemoryLine> kv;         // K/V-like state (counted in kv_bytes)
  std::vector<MemoryLine> weights;    // parameters (listed, not counted as KV)
  int64_t full_kv_bytes = 0, native_kv_bytes = 0;
  void add(MemoryLine line);          // into kv or weights by its part
  // The line of this part, replaced (or added when absent).
  void set(MemoryLine line);
  const MemoryLine* find(MemoryPart p) const;  // null when absent
  int64_t kv_bytes() const;
  int64_t bounded_bytes() const;      // the lines that do not grow with the context
  nlohmann::json to_json() const;
  std::string table() const;          // aligned text table with ratios
};

// The full-KV oracle's cache (AR) of `capacity` positions: the plan (shapes only) and the
// report (the plan plus the weights).
MemoryReport ar_memory_plan(const ModelConfig& cfg, at::ScalarType dtype, int64_t capacity);
MemoryReport ar_memory_report(const Model& verifier, int64_t capacity);

// A restored-cache session (what `restored` reports; fused sets its drafter context).
MemoryReport restored_memory_report(const Model& verifier, const Drafter* drafter, const FTheta* ftheta,
                                    const KVCache& cache, const Restorer& restorer, const RestoreOptions& opt,
                                    int64_t positions);

// What restored_memory_report reports, from the shapes alone (nothing allocated): the K/V lines
// of a restored decode of `capacity` positions, in `dtype`. drafter, ftheta: the
// pair whose inputs wait in the pending rings (null when a = 1; f_θ's input decides whether
// the drafter's raw K/V wait too). Weights are not listed. Tests check it against the
// measured report; it answers "what would 8k cost" without an 8k decode.
MemoryReport restored_memory_plan(const ModelConfig& cfg, const DrafterConfig* drafter, const FThetaConfig* ftheta,
                                  const RestoreOptions& o, at::ScalarType dtype, int64_t capacity);

// What a fixed KV budget holds of one decoder, from its per-session K/V bytes at n positions
// (kv_bytes_at, non-decreasing in n): the longest context one session fits (up to max_context),
// and how many sessions of `context` positions fit side by side.
struct BudgetFit {
  int64_t budget = 0;           // bytes
  int64_t longest = 0;          // most positions one session fits (0: not even one)
  bool limited_by_model = false;  // max_context fits: the model's limit, not the budget, ended it
  int64_t context = 0;
  int64_t session_bytes = 0;    // one session at `context`
  int64_t sessions = 0;         // floor(budget / session_bytes)
  nlohmann::json to_json() const;
};
BudgetFit fit_budget(const std::function<int64_t(int64_t)>& kv_bytes_at, int64_t budget, int64_t max_context,
                     int64_t context);

// Bytes a tensor holds (0 when undefined).
int64_t tensor_bytes(const at::Tensor& t);

// Memory of f_θ's weights next to the caches (the drafter's: Drafter::weight_bytes).
int64_t ftheta_weight_bytes(const FTheta& f);

}  // namespace kakeya
