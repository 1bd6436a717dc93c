// DFlash drafter training (the recipe of arXiv 2602.06036, §training):
//   frozen target; per sequence N random anchors a in the target-generated part;
//   block [tok[a], MASK × (B-1)] at positions a .. a+B-1 sees the target's context
//   features of positions < a and the block itself only (DFlash's masks inside);
//   loss = Σ_k w_k · CE(draft_k, tok[a+k]) / Σ w_k over k = 1 .. B-1, w_k = exp(-(k-1)/γ);
//   AdamW (decoupled decay on matrices), linear warmup + cosine decay, grad-norm clip.
// Only the drafter's own weights train; the target's embedding and lm_head stay frozen.
// With freeze_context the drafter's context path (fc, hidden_norm, every k_proj/v_proj)
// stays frozen too, so its raw context K/V — what a trained f_θ reads — do not move.
// The step count can be derived from a time budget (--train-seconds): the first
// steps are timed, then the schedule is fixed and stored in the checkpoint.
// Data-parallel (distribute(), train/dist.h): every rank draws the step's global batch and
// computes its rows; the loss is normalised by the whole batch's weight, so the ranks' losses
// sum to the one-process loss and the summed gradients are its gradients. Rank 0 writes the
// checkpoint and prints; a timed schedule takes the shortest of the ranks' step counts.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/model.h"
#include "train/drafter_data.h"
#include "train/dist.h"

namespace kakeya::train {

struct TrainOptions {
  int64_t batch = 16;           // sequences per step
  int64_t anchors = 24;         // blocks per sequence
  double gamma = 7.0;           // position decay of the loss weights
  double lr = 1e-3;
  double min_lr_ratio = 0.05;   // cosine floor, as a fraction of lr
  int64_t warmup_steps = 200;
  double weight_decay = 0.01;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;
  int64_t steps = 0;            // 0: derive from train_seconds
  double train_seconds = 480;   // budget for the optimisation steps when steps == 0
  int64_t calibration_steps = 12;
  uint64_t seed = 0;
  double deadline = 0;          // unix seconds: checkpoint and return before this (0: none)
  int64_t max_steps_this_run = 0;  // return (with a checkpoint) after this many steps (0: no limit)
  double checkpoint_seconds = 60;
  double log_seconds = 5;
  // Fine-tuning a drafter that an f_θ was trained against: fc, hidden_norm and every
  // layer's k_proj/v_proj stay bitwise unchanged (no grad, no moments, no decay), so
  // the raw context K/V k_proj(c), v_proj(c) are the same function of the features.
  bool freeze_context = false;
};

// True for the tensors freeze_context keeps fixed (z-lab names): fc.weight,
// hidden_norm.weight, layers.*.self_attn.k_proj.weight, layers.*.self_attn.v_proj.weight.
bool is_context_parameter(const std::string& name);

// One logged point of the loss curve.
struct LogPoint {
  int64_t step;
  double loss, acc1, accept_len, lr, grad_norm, elapsed;
};

struct TrainState {
  int64_t step = 0;
  int64_t total_steps = 0;      // fixed after calibration
  double train_seconds = 0;     // optimisation wall time so far (all sessions)
  double step_seconds = 0;      // measured during calibration
  std::vector<LogPoint> log;
  bool finished() const { return total_steps > 0 && step >= total_steps; }
};

// Teacher-forced metrics of one batch (no grad): the loss, top-1 accuracy of the
// first draft position, and the acceptance length a greedy verifier would give
// (leading correct drafts + 1, averaged over blocks) — on the target's own greedy
// continuations this is τ up to numerics.
struct BatchMetrics {
  double loss = 0, acc1 = 0, accept_len = 0;
  int64_t blocks = 0;
};

// The training forward: tokens [Bs, S] int64 and anchors A [Bs, N] int64 (on the
// drafter's device) -> final-normed drafter hidden of block positions 1..B-1,
// [Bs, N, B-1, H] (logits via Drafter::logits). Block n = [tok[A_n], MASK × (B-1)]
// at positions A_n .. A_n+B-1 sees the target's features of positions < A_n and
// itself only: what Drafter::draft sees after extending its cache to A_n.
at::Tensor block_hidden(const Model& target, const Drafter& drafter, const at::Tensor& tokens, const at::Tensor& A);

class DrafterTrainer {
 public:
  // `drafter` must hold f32 parameters (it is trained in place). `train` holds the
  // target-generated sequences; `checkpoint` is the resumable state file.
  DrafterTrainer(const Model& target, Drafter& drafter, std::vector<Sequences> train, const TrainOptions& opt,
                 std::string checkpoint);
  // Resumes from the checkpoint if it exists (same drafter config and freeze_context
  // required; with freeze_context its frozen tensors must equal the drafter's bitwise).
  bool resume();
  // Train as one rank of `dist` (before resume/run): rank 0's starting weights go to every
  // rank; --batch must be a multiple of the number of ranks.
  void distribute(const Dist& dist);
  // Runs until the schedule ends or the deadline nears; checkpoints on the way and at the end.
  // Returns true when training is finished.
  bool run();
  void save_checkpoint() const;
  const TrainState& state() const { return st_; }
  int64_t trainable_parameters() const;
  int64_t frozen_parameters() const;
  // Metrics over held-out sequences (teacher forcing, same anchors rule), `max_batches` batches.
  BatchMetrics evaluate(const Sequences& seqs, int64_t max_batches, uint64_t seed) const;

 private:
  struct Batch {
    at::Tensor tokens;   // [Bs, S] int64
    at::Tensor anchors;  // [Bs, N] int64
    at::Tensor valid;    // [Bs, N, B-1] bool: label exists and anchor is real
    // Over the whole drawn batch (all ranks' rows): the loss weight and the real blocks, the
    // denominators of the loss and the metrics.
    double weight_total = 0, blocks_total = 0;
  };
  Batch sample(const std::vector<const Sequences*>& pool, uint64_t seed) const;
  Batch rows(const Batch& b, int64_t begin, int64_t end) const;  // a rank's rows, the totals kept
  // Loss (scalar, with graph when grad is enabled) and detached metrics for one batch.
  std::pair<at::Tensor, at::Tensor> loss(const Batch& b) const;  // {loss [], metrics [3] = (loss, acc1, accept_len)}
  double lr_at(int64_t step) const;
  void step_optimizer(double lr, at::Tensor& grad_norm);

  const Model& target_;
  Drafter& drafter_;
  std::vector<Sequences> train_;
  TrainOptions opt_;
  std::string ckpt_;
  std::vector<std::pair<std::string, at::Tensor>> params_;  // trained (requires grad)
  std::vector<std::pair<std::string, at::Tensor>> frozen_;  // freeze_context: checkpointed, never updated
  std::vector<at::Tensor> m_, v_;   // AdamW moments, like params_
  at::Tensor pos_weights_host_;     // [B-1] f32 CPU: exp(-(k-1)/γ) (batch totals, no device read)
  at::Tensor pos_weights_;          // [B-1] f32: the same on the drafter's device
  TrainState st_;
  const Dist* dist_ = nullptr;      // data-parallel rank (distribute()); null: one process
};

// Held-out τ: speculative decoding of each prompt (max_new tokens, greedy),
// τ per domain, acceptance histogram, tok/s of AR and speculative, and whether
// the output matched greedy AR token for token.
nlohmann::json evaluate_tau(const Model& target, const Drafter& drafter, const std::vector<std::vector<int64_t>>& prompts,
                            int64_t max_new, int64_t block_size, const std::vector<int64_t>& stop_ids,
                            const std::string& label);

}  // namespace kakeya::train
