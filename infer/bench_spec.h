// The speculative-decoding benchmark of `kakeya bench spec`: in one run, decode tok/s of `ar`
// (the full-KV CUDA-graph AR loop), `restored` (the restored verifier, one token per forward)
// and `fused` (speculative decoding on the restored verifier, infer/fused.h), τ and the fused
// per-block time split (draft / verify / cache upkeep = restoration + drafter context), on
// held-out code and prose prompts (train-drafter's split: files held out by content hash,
// train/drafter_data.h) and on NIAH prompts at given context lengths (with each mode's recall).
//
// One decoder per mode and prompt set (infer/decoder.h make_decoder), sized for the set's
// longest prompt + new tokens, reused by every prompt of the set; each set starts with untimed
// warm-up runs of every mode on its first prompt. Progress lines go to stderr.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/io/tokenizer.h"
#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "infer/options.h"

namespace kakeya {

struct BenchSpecOptions {
  std::vector<std::string> modes{"ar", "restored", "fused"};  // a subset, run in this order
  RestoreOptions restore;          // the restored modes (fused included)
  int64_t block_size = 0;          // fused: tokens per verify forward (0: the drafter's block_size)
  bool cuda_graph = true;          // false: eager launches in every mode
  int64_t warmup = 1;              // untimed runs per mode and set first
  // Held-out code/prose sets: train-drafter's held-out prompts (its eval prompts: seed = its --seed + 1).
  int64_t prompts = 8;             // per domain (0: no code/prose sets)
  int64_t prompt_len = 64;         // tokens, BOS included
  int64_t new_tokens = 192;        // generated per prompt (no stop)
  int64_t heldout_percent = 10;
  uint64_t seed = 1;
  std::vector<std::string> code, prose;  // corpus roots, as given to train-drafter
  // NIAH sets: one per context length, niah_samples prompts per depth; generation stops at EOS.
  std::vector<int64_t> niah_contexts{4096, 16384};
  std::vector<double> niah_depths{0.5};
  int64_t niah_samples = 1;
  int64_t niah_new = 24;
  std::string source_dir = "data/codec";  // NIAH haystack files
};

// What the benchmark decodes with; the caller keeps them alive through the run.
struct BenchSpecModels {
  const Model* verifier = nullptr;
  const Drafter* drafter = nullptr;  // needed by fused and by restored modes that read f_θ
  const FTheta* ftheta = nullptr;
  std::string device;                // the verifier's device as reports name it
};
// Loads the models once the prompts are known: RoPE positions for `max_positions`, the drafter and
// f_θ when `need_restore`.
using BenchSpecLoader = std::function<BenchSpecModels(int64_t max_positions, bool need_restore)>;

struct BenchSpecResult {
  // {"bench": "spec", "device", "dtype", "restore", "block_size", "cuda_graph", "heldout", "sets": [{"set",
  // "prompts", "max_new_tokens", "stop_at_eos", "modes": {mode: {...}}, "per_prompt", "fused_vs_ar", ...}]}
  nlohmann::json report;
  std::string table;  // the summary table with its legend, as printed on stdout
};

// Builds the prompt sets (throws naming the flag on bad input, before any model loads), loads the
// models through `load`, runs every mode over every set.
BenchSpecResult run_bench_spec(const Tokenizer& tok, const BenchSpecOptions& opt, const BenchSpecLoader& load);

}  // namespace kakeya
