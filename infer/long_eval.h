// Long-context evaluation suite run side by side over decoder configs (`kakeya eval-long`):
// the synthetic tasks of data/longeval.h (NIAH variants, variable tracking, common/frequent
// words) at a ladder of contexts, scored on greedy answers, plus teacher-forced perplexity of
// the last tokens of held-out documents at each context.
//
// Every config sees exactly the same prompts (one plan, same seeds) and keeps ONE Decoder
// (infer/decoder.h) for the whole run, so its caches and CUDA graphs are built once. The run
// goes context by context (ascending), and within a context one prompt (or document) at a
// time through every config, so a run stopped at its deadline has the same cells done for
// every config: a partial report still compares like with like.
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "core/io/tokenizer.h"
#include "data/longeval.h"
#include "infer/restored.h"

namespace kakeya {

struct LongEvalConfig {
  std::string name;                  // the spec as written ("restored:64"): the config's key in reports
  DecodeMode mode = DecodeMode::Ar;  // Ar (the full-KV oracle) or Restored
  RestoreOptions restore;            // Restored only
  bool oracle() const { return mode == DecodeMode::Ar; }
};

// Config specs, W = the exact window (a positive integer); the rest of the restore options
// come from `base` (sink, chunk, full_attn, mix_alpha, layers):
//   oracle            DecodeMode::Ar, full KV
//   evict:W           restored mode with layers "none": sinks + the window, older positions dropped
//   restored:W        restored mode, layers as in base (the caller's default, "auto")
// and modifiers after "restored", joined by '-', in any order:
//   all               every covered layer reads its restored positions (restored-all:W)
//   CODE              the restored regions stored as CODE coded rows (ops::row_code_names(),
//                     core/kernels/ops.h): restored-int4:W
//   codec [CODE]      full-attention layers as coded rows (--full-attn codec), in CODE right after
//                     it, else base's full_code: restored-codec:W, restored-int4-codec-lm3:W; a
//                     full-attention layer may take its own: restored-codec-pw4+17=pw5v4:W
// and "exact" in place of "restored" (the region holds each position's exact K/V, --mix-alpha 1).
// Errors name the bad spec and list the forms.
LongEvalConfig parse_long_eval_config(const std::string& spec, const RestoreOptions& base);
// A comma-separated list of specs; names must be unique.
std::vector<LongEvalConfig> parse_long_eval_configs(const std::string& specs, const RestoreOptions& base);
// Whether a config restores through the drafter and f_θ (the others, oracle, exact and evict-only
// ones, run without loading them).
bool configs_need_ftheta(const std::vector<LongEvalConfig>& configs);

struct LongEvalOptions {
  std::vector<std::string> tasks;    // data::long_task_names() entries
  std::vector<int64_t> contexts;     // prompt lengths in tokens; the run goes through them ascending
  int64_t samples = 3;               // prompts per (task, context): seeds seed .. seed + samples - 1
  uint64_t seed = 0;
  data::ChatFormat chat = data::ChatFormat::None;
  std::string source_dir;            // the tasks' text sources; empty: data::LongTaskOptions' default
  int64_t ppl_docs = 4;              // held-out documents scored per context (0: no perplexity)
  int64_t ppl_tail = 512;            // scored tokens: the last ones of each context-long document prefix
  std::string ppl_dir = "data/longeval/docs";  // *.txt, taken in name order
  // The run stops before a prompt (or document) whose estimated time would pass it (the rate so
  // far times its tokens), and reports what is done with "partial": true.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  // A report of an earlier run to continue (null: none). Its prompts and documents are taken as
  // done, per config: a run stopped at its deadline goes on where it stopped, more --samples or
  // --ppl-docs add to it, and a config it lacks runs everything. It must be of the same suite:
  // tasks, contexts, seed, chat format, perplexity tail, and each shared config's restore
  // options; its samples' seeds and its documents must be those of this plan (checked, the
  // error names the field).
  nlohmann::json resume;
  // Called with the report so far (the same form as the result, "partial": true) at most every
  // checkpoint_seconds while the run goes on: the caller writes it where a later run can resume.
  std::function<void(const nlohmann::json&)> checkpoint;
  double checkpoint_seconds = 30;
  // A config's name (empty: none): every other config is also compared with it, paired as with
  // the oracle ("vs_reference"), e.g. compact restored modes against the uncompressed one.
  std::string reference;
};

struct LongEvalDoc {
  std::string path;
  std::vector<int64_t> ids;  // BOS (when the model has one) + the document's first tokens: the longest context's length
};

// Everything the configs share, made before any model runs: the prompts and the documents.
struct LongEvalPlan {
  std::vector<int64_t> contexts;  // ascending, unique
  // samples[t][c][s]: task t (LongEvalOptions::tasks order), context contexts[c], sample s.
  std::vector<std::vector<std::vector<data::LongSample>>> samples;
  std::vector<LongEvalDoc> docs;
  // Every config's Decoder capacity: the longest context + the largest answer budget of any task
  // (data::long_task_max_new_tokens), whichever tasks run (bf16 restored outputs depend on it).
  int64_t decode_capacity = 0;
  int64_t positions = 0;          // RoPE positions the run needs: decode_capacity, or a scored document + 1
};

// Checks the options (tasks — none is allowed when documents are scored —, contexts within the
// model's max_position_embeddings, samples, ppl_tail shorter than every context, enough documents
// long enough) before building anything, then builds every prompt and tokenizes the documents.
// Throws naming what is wrong.
LongEvalPlan plan_long_eval(const Tokenizer& tok, const ModelConfig& cfg, const LongEvalOptions& opt);

// Progress in tokens through the verifier (prompts + their new-token budgets, scored
// documents), summed over configs.
using LongEvalProgress = std::function<void(int64_t done, int64_t total)>;

// Runs every config over `plan` (plan_long_eval of the same options). drafter/ftheta: needed by configs that read restored
// positions (not by the oracle or evict:W). Before any decoding:
// the plan fits the model's RoPE table, config names are unique, and validate_restore accepts
// every restored config at every prompt. Decoding is greedy up to the sample's max_new_tokens,
// stopping at the model's EOS ids and <end_of_turn> when the tokenizer has it.
// Report: {"configs": [{"name", "mode", "restore", "tasks": {task: {context: {"score", "ci95",
// "n", "per_sample"}}}, "ppl": {context: {"nll", "ppl", "ci95_nll", "n", "per_doc"}},
// "seconds", "summary"}], "tasks", "contexts", "samples", "oracle", "ppl_docs", "ppl_tail",
// "prompts" (per task and context: each prompt's seed, length, budget and answers), "partial",
// "resumed" (how many prompts and documents came from opt.resume)}; the summary: mean score, per
// task family, and vs the oracle (the first config in Ar mode, if any), paired prompt by prompt
// and document by document: the score difference in points per task and per family with its 95%
// interval, the share of generated texts identical to the oracle's, and the perplexity ratio with its
// interval (exp of the mean per-document NLL difference ± its 95% half-width); with
// opt.reference, "reference" names it and every other config's summary has the same comparison
// with it as "vs_reference".
nlohmann::json run_long_eval(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const Tokenizer& tok,
                             const std::vector<LongEvalConfig>& configs, const LongEvalOptions& opt,
                             const LongEvalPlan& plan, const LongEvalProgress& progress = {});
// plan_long_eval with the verifier's config, then the run above.
nlohmann::json run_long_eval(const Model& verifier, const Drafter* drafter, const FTheta* ftheta, const Tokenizer& tok,
                             const std::vector<LongEvalConfig>& configs, const LongEvalOptions& opt,
                             const LongEvalProgress& progress = {});

// 95% interval of a mean score in [0, 1]: Wilson when every score is 0 or 1 (or there is a single
// score, whose sample deviation is undefined), else the normal approximation with the sample
// standard deviation, clipped to [0, 1].
std::pair<double, double> score_ci95(const std::vector<double>& scores);
// The arithmetic mean (0 for no values).
double mean(const std::vector<double>& x);
// Mean NLL (nats a token) of the last `tail` tokens sr scored: the suite's perplexity measure.
double tail_nll(const ScoreResult& sr, int64_t tail);
// mean ± 1.96·sd/√n (sample sd); NaN at both ends below 2 values (the report writes null).
std::pair<double, double> mean_ci95(const std::vector<double>& x);
// a[i] - b[i] over the first min(|a|, |b|) entries: the paired differences of two configs on the
// same prompts (or documents), which vary far less than either config's own scores.
std::vector<double> paired_differences(const std::vector<double>& a, const std::vector<double>& b);
// The family a task belongs to in summaries: the name up to its first '_' ("niah_multikey" -> "niah").
std::string long_task_family(const std::string& task);

}  // namespace kakeya
