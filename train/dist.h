// Data-parallel training across processes through LibTorch's c10d: rendezvous in a
// TCPStore hosted by `kakeya launch` (train/launch.h), one process group per run (Gloo on
// CPU, NCCL on CUDA; Gloo also carries CUDA tensors when several ranks share one GPU).
//
// How the trainers use it: every rank draws the same global batch from (seed, step) and
// computes its own rows of it; each rank's loss is its share of the global loss (the parts
// sum to what one process computes on the whole batch), so the summed gradients are the
// one-process gradients and the one AdamW step that follows leaves every rank with the same
// weights. Rank 0 writes checkpoints and reports; a checkpoint does not record the number of
// ranks, so a run resumes on any number of them.
//
// A failed collective (a peer died, or did not answer within the timeout) throws a
// kakeya::Error naming this rank, the operation and — when the launcher saw it exit — the
// rank that failed, so no rank hangs on a dead peer.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kakeya::train {

// What `kakeya launch` hands each rank through the environment.
struct DistEnv {
  int rank = 0, world = 1, local_rank = 0;  // KAKEYA_RANK, KAKEYA_WORLD_SIZE, KAKEYA_LOCAL_RANK
  std::string addr = "127.0.0.1";           // KAKEYA_MASTER_ADDR: the launcher's store
  int port = 0;                             // KAKEYA_MASTER_PORT
  double timeout_s = 300;                   // KAKEYA_DIST_TIMEOUT: collectives and rendezvous
  std::string backend = "auto";             // KAKEYA_DIST_BACKEND: auto | gloo | nccl
};
// The launcher's variables; a single process (world 1) when they are absent. Malformed
// values throw naming the variable.
DistEnv dist_env_from_environment();
// The variables above as "NAME=value" strings for rank `rank` of `world` (the launcher's side).
std::vector<std::string> dist_env_variables(const DistEnv& env);

class Dist {
 public:
  // Joins the launcher's store and builds the process group for tensors on `device`. On CUDA
  // the rank's GPU becomes current (local_rank modulo the GPUs present) before anything else.
  // Without a launcher (no store port in `env`): one process, every collective the identity.
  Dist(const DistEnv& env, at::Device device);
  ~Dist();
  Dist(const Dist&) = delete;
  Dist& operator=(const Dist&) = delete;

  int rank() const { return env_.rank; }
  int world() const { return env_.world; }
  bool is_root() const { return env_.rank == 0; }
  const std::string& backend() const { return backend_; }  // "none" | "gloo" | "nccl"
  at::Device device() const { return device_; }  // this rank's device (cuda:i on CUDA)

  // Rows [begin, end) of a global batch of n rows that this rank computes. n must divide
  // evenly (every rank's loss share then has the same weight); otherwise throws naming `flag`.
  std::pair<int64_t, int64_t> share(int64_t n, const std::string& flag) const;

  // Sums the tensors over ranks in place (one flattened all-reduce for the list; all on the
  // group's device). `what` names the operation in errors ("gradients at step 12").
  void all_reduce_sum(std::vector<at::Tensor>& ts, const std::string& what) const;
  // Rank 0's values into every rank's tensors (in place).
  void broadcast(std::vector<at::Tensor>& ts, const std::string& what) const;
  int64_t all_reduce_min(int64_t v, const std::string& what) const;
  bool any(bool v, const std::string& what) const;  // true on every rank when true on one
  void barrier(const std::string& what) const;

 private:
  struct Impl;
  [[noreturn]] void fail(const std::string& what, const std::string& cause) const;
  DistEnv env_;
  std::string backend_ = "none";
  at::Device device_ = at::kCPU;
  std::unique_ptr<Impl> impl_;
};

// The store key where the launcher records the first rank that exited abnormally.
constexpr const char* kDistFailedKey = "kakeya/failed";

}  // namespace kakeya::train
