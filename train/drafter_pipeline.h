// The drafter-making pipeline of `kakeya train-drafter`: a DFlash drafter for a target that has
// none, in four idempotent stages under `out` (rerunning the same options resumes where a
// deadline stopped the last run):
//   1. data    prompts from local code/prose files, continued greedily by the target
//              (OUT/data/*.safetensors + OUT/data/manifest.json; reused when present)
//   2. train   DFlash recipe (train/drafter_train.h), resumable (OUT/train/checkpoint.safetensors)
//   3. export  OUT/drafter/{config.json, model.safetensors} (z-lab layout, bf16)
//   4. eval    τ on held-out prompts per domain with the exported drafter -> OUT/report.json,
//              OUT/drafter/manifest.json (command, commit, data, τ)
// Data-parallel under `kakeya launch --nproc N` (train/dist.h, from the environment): rank r
// continues its slice of every prompt list (rank 0 joins the slices with concat_sequences),
// every rank trains on its rows of each batch, and rank 0 alone writes the report, exports
// and evaluates. Progress lines go to stderr.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/io/tokenizer.h"
#include "core/model/model.h"
#include "train/drafter_train.h"

namespace kakeya::train {

struct DrafterPipelineOptions {
  std::string model = "checkpoints/models/gemma3-270m";  // the target's directory (checked against cached data, recorded)
  std::string out;                      // data cache, checkpoint, drafter, report
  std::string init;                     // start from this drafter directory instead of random weights
  std::string drafter;                  // eval_only: the drafter to evaluate (empty: OUT/drafter)
  std::string commit = "unknown";       // source commit, recorded in the manifest
  std::string command;                  // the invocation, recorded in the report ("command", "train_command")
  std::vector<std::string> code, prose;  // data sources (list_corpus roots)
  int heldout_percent = 10;             // files held out (by content hash)
  int64_t prompt_len = 64, gen_len = 192, train_prompts = 12000, eval_prompts = 48, gen_batch = 256;
  // Drafter geometry (random init); mask_token < 0: the tokenizer's <mask>.
  int64_t layers = 5, heads = 8, kv_heads = 2, head_dim = 64, intermediate = 1280, block_size = 16, mask_token = -1;
  int64_t eval_max_new = 192;           // new tokens per held-out prompt for τ
  int64_t heldout_batches = 8;          // teacher-forced held-out batches per domain
  double eval_seconds = 150;            // time the evaluation needs (deferred if the deadline is closer)
  bool eval_only = false;               // skip data and training: evaluate `drafter`
  TrainOptions train;                   // the recipe (train.seed: data order, anchors, init; train.deadline)
  std::string device = "cpu";           // the device as the user named it (reports, progress)
  at::Device torch_device = at::kCPU;   // this rank's device for the process group (train/dist.h)
  // RoPE positions the target needs: the longest training sequence or evaluation, plus a block.
  int64_t max_positions() const;
};

// Loading is the caller's: the tokenizer of `model`, and the target for `max_positions`
// positions on this rank's device (called after the process group picked the rank's GPU).
struct DrafterPipelineLoaders {
  std::function<Tokenizer()> tokenizer;
  std::function<Model(int64_t max_positions)> target;
};

// Runs the stages above. Returns the report as written to OUT/report.json (on rank 0; null on
// the other ranks), also when it stops early: training unfinished before the deadline, or the
// evaluation deferred. Throws on bad options (naming the flag) and on cached data made with
// other model/prompt_len/gen_len.
nlohmann::json make_drafter(const DrafterPipelineOptions& opt, const DrafterPipelineLoaders& load);

}  // namespace kakeya::train
