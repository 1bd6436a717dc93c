// f_θ training (`kakeya train-ftheta`) on captured data (data/capture.h): no
// verifier or drafter forward at train time, only f_θ + the loss
// (train/ftheta_loss.h), which recomputes attention with the frozen verifier's
// norms, RoPE and o_proj (the verifier is loaded f32; bf16 autocast on CUDA).
//
// Data: every captured sequence is held in memory (bf16, CPU), split into
// training and held-out sequences (the last `heldout` of the capture). A step's
// batch = `batch` training sequences drawn by (seed, step) only, cropped to
// their common prefix length (at most max_len; prefixes, because a query's
// attention needs every key from position 0). Held-out evaluation: each
// held-out sequence alone, cropped to max_len, no grad; before the first step,
// every eval_every steps and at the end.
//
// AdamW (train/train_util.h), lr schedule const | cosine with linear warmup
// (warmup step s has lr·(s+1)/warmup; cosine decays to lr/100 at the last step),
// global grad-norm clip. A non-finite loss or gradient halts before the update,
// naming the step and the verifier layer (or parameter).
//
// Checkpoint (one safetensors file, replaced atomically): parameters, AdamW
// moments, the f_θ config and the state (step, logs, evaluations); a resumed
// run ends with the same weights as an uninterrupted one.
//
// Data-parallel (distribute(), train/dist.h): every rank draws the step's global batch and
// computes its rows of it (online: makes only those sequences); gradients, loss and
// statistics are summed over ranks before the update; held-out sequences are split over
// ranks. N ranks at --batch B end with the weights of one process at --batch B (up to the
// order of floating-point sums). Rank 0 alone writes the checkpoint and prints.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/model/ftheta.h"
#include "core/model/model.h"
#include "train/dist.h"
#include "train/ftheta_loss.h"
#include "train/train_util.h"

namespace kakeya::train {

struct FThetaTrainOptions {
  FThetaLossOptions loss;
  int64_t steps = 2000;
  int64_t batch = 4;               // sequences per step
  int64_t max_len = 512;           // prefix length cap per sequence
  double lr = 1e-3;
  std::string lr_schedule = "cosine";  // const | cosine
  int64_t warmup_steps = 100;
  AdamWOptions adamw{0.9, 0.999, 1e-8, 0.01, 1.0};
  bool autocast = true;            // bf16 autocast when training on CUDA
  // CUDA: each step's loss + backward replays a CUDA graph captured once per batch length (the
  // step is launch-bound: ~10k small kernels). Batches are then cropped to a multiple of 128
  // tokens, so a few graphs serve every batch. Not part of to_json: a resumed run may differ.
  bool cuda_graph = true;
  uint64_t seed = 0;
  int64_t eval_every = 200;        // held-out evaluation period in steps (0: start and end only)
  double checkpoint_seconds = 60;
  double log_seconds = 5;
  double deadline = 0;             // unix seconds: checkpoint and return before this (0: none)
  int64_t max_steps_this_run = 0;  // return (with a checkpoint) after this many steps (0: no limit)
  nlohmann::json to_json() const;  // what a resume must agree on
};

// One training sequence in memory (CPU, bf16 floats).
struct FThetaSequence {
  at::Tensor dk, dv;               // [T, L_d, H_d, D_d] (f_θ input drafter_kv; else undefined)
  at::Tensor feats;                // [T, n·H] target features (f_θ input target_features; else undefined)
  std::vector<at::Tensor> q;       // per verifier layer [T, H_q, D]
  std::vector<at::Tensor> k, v;    // per verifier layer [T, H_kv, D]
  std::vector<at::Tensor> o;       // per verifier layer [T, hidden]
  int64_t length() const { return k.at(0).size(0); }
};

// Online training data (`train-ftheta --online`): sequence i of the training stream, made when a
// batch asks for it (the verifier runs in the loop). The same index always gives the same sequence.
using FThetaSequenceSource = std::function<FThetaSequence(int64_t index)>;

// Stacks sequences (prefixes of length T) into a batch on `device` (floats f32).
FThetaBatch make_ftheta_batch(const std::vector<const FThetaSequence*>& seqs, int64_t T, at::Device device);

struct FThetaEval {
  int64_t step = 0;
  double loss = 0;
  at::Tensor stats;                // [L, kNumStats] f32 CPU, mean over held-out sequences
  nlohmann::json to_json(const ModelConfig& verifier) const;  // per layer + per layer type
};

// One optimisation step's outputs, on the device (reading them syncs).
struct FThetaStepResult {
  at::Tensor loss;       // [] f32
  at::Tensor stats;      // [L, kNumStats] f32
  at::Tensor grad_norm;  // [] f32, before clipping
};

struct FThetaStepGraph;  // ftheta_train.cpp (CUDA builds)

class FThetaTrainer {
 public:
  // `f` must hold f32 parameters (trained in place); `verifier` f32 on the same device.
  FThetaTrainer(const FThetaTrainer&) = delete;  // graphs_ capture this trainer's tensors
  FThetaTrainer(const Model& verifier, FTheta& f, std::vector<FThetaSequence> train, std::vector<FThetaSequence> heldout,
                const FThetaTrainOptions& opt, std::string checkpoint);
  // Online: n_train training sequences made on demand by `source` (held-out ones kept in memory).
  FThetaTrainer(const Model& verifier, FTheta& f, FThetaSequenceSource source, int64_t n_train,
                std::vector<FThetaSequence> heldout, const FThetaTrainOptions& opt, std::string checkpoint);
  ~FThetaTrainer();
  // Train as one rank of `dist` (before resume/run): rank 0's starting weights go to every rank.
  // --batch must be a multiple of the number of ranks.
  void distribute(const Dist& dist);
  bool resume();                   // from the checkpoint if it exists; refuses another f_θ config or options
  bool run();                      // until `steps` or the deadline; true when finished
  void save_checkpoint() const;
  FThetaEval evaluate() const;
  double lr_at(int64_t step) const;
  // One step on `b` at learning rate `lr` (loss, backward, NaN/Inf halt, AdamW),
  // step() += 1. run() calls it on sample(step()); `kakeya bench train-ftheta` times it.
  FThetaStepResult step_on(const FThetaBatch& b, double lr);
  int64_t step() const { return step_; }
  nlohmann::json report() const;   // options, logs, evaluations, reduction factor

 private:
  void init(bool has_train);  // checks and optimiser state, shared by both constructors
  FThetaBatch sample(int64_t step) const;
  bool graphed() const;  // step_on replays CUDA graphs
  // Loss, backward and the finite flag ([] bool on the device) of one step: the part a graph replays.
  FThetaStepResult forward_backward(const FThetaBatch& b, at::Tensor& finite);
  [[noreturn]] void fail_non_finite(const FThetaStepResult& r) const;
  // Data-parallel: sums gradients, loss, statistics and the non-finite flag over ranks.
  void reduce_step(FThetaStepResult& r, at::Tensor& finite) const;

  const Model& verifier_;
  FTheta& f_;
  std::vector<FThetaSequence> train_, heldout_;
  FThetaSequenceSource source_;  // online: makes training sequence i (train_ stays empty)
  int64_t n_train_ = 0;
  FThetaTrainOptions opt_;
  std::string ckpt_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  std::vector<at::Tensor> params_, m_, v_;
  int64_t step_ = 0;
  double train_seconds_ = 0;
  nlohmann::json log_ = nlohmann::json::array();    // {step, loss, lr, grad_norm, seconds, terms{...}}
  nlohmann::json evals_ = nlohmann::json::array();  // FThetaEval::to_json
  std::map<int64_t, std::unique_ptr<FThetaStepGraph>> graphs_;  // by batch length T
  const Dist* dist_ = nullptr;  // data-parallel rank (distribute()); null: one process
};

}  // namespace kakeya::train
