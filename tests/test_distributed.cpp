// Data-parallel training across processes (train/dist.h, train/launch.h) with Gloo on the CPU:
// this binary launches itself as the ranks (KAKEYA_TEST_WORKER selects what a rank runs).
//   - 2 ranks at global batch B end with the weights of one process at batch B (f_θ trainer on
//     the tiny Gemma 3 of the ftheta fixture; drafter trainer on the tiny Qwen3 target);
//   - a 2-rank checkpoint resumes in one process and ends where one process alone ends;
//   - a rank killed mid-run: the other exits non-zero by itself, well within the timeout, with
//     an error naming the killed rank; the launcher reports it;
//   - bad input (a batch that does not split, malformed launcher variables) is refused by name.
#include <arpa/inet.h>
#include <ftw.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/io/fs.h"
#include "core/io/safetensors.h"
#include "tests/test_util.h"
#include "tests/train_test_util.h"
#include "train/dist.h"
#include "train/launch.h"

using namespace kakeya;
using namespace kakeya::train;

namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : fallback;
}

std::string self_exe() {
  char buf[PATH_MAX] = {0};
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return std::string(buf, n > 0 ? n : 0);
}

std::string temp_dir(const std::string& tag) {
  std::string d = fs::temp_dir() + "/kakeya_test_dist_" + tag + "_" + std::to_string(::getpid());
  fs::make_dirs(d);
  return d;
}

// Removes a test's directory when the test ends (its files are read before that). Not
// std::filesystem: libtorch.so exports its own copy of it, which the dynamic linker may pick.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& tag) : path(temp_dir(tag)) {}
  ~TempDir() {
    ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
};

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

FThetaTrainOptions ftheta_options(int64_t batch, int64_t steps, int64_t stop_after) {
  FThetaTrainOptions o = test::ftheta_small_options();
  o.batch = batch;
  o.steps = steps;
  o.max_steps_this_run = stop_after;
  o.log_seconds = 1e9;
  return o;
}

TrainOptions drafter_options(int64_t batch, int64_t steps, int64_t stop_after) {
  TrainOptions o = test::drafter_small_options(steps);
  o.batch = batch;
  o.max_steps_this_run = stop_after;
  return o;
}

// ---------------------------------------------------------------- the ranks

// What one rank runs: its stderr goes to DIR/stderr.<rank>, its pid to DIR/pid.<rank> once it
// has joined the group; errors are printed and give exit status 1, as in the CLI.
int run_worker(const std::string& what) {
  const std::string dir = std::getenv("KAKEYA_TEST_DIR");
  const DistEnv env = dist_env_from_environment();
  (void)std::freopen((dir + "/stderr." + std::to_string(env.rank)).c_str(), "w", stderr);
  try {
    Dist dist(env, at::kCPU);
    std::ofstream(dir + "/pid." + std::to_string(env.rank)) << ::getpid();
    const int64_t batch = env_int("KAKEYA_TEST_BATCH", 4), steps = env_int("KAKEYA_TEST_STEPS", 6),
                  stop_after = env_int("KAKEYA_TEST_STOP_AFTER", 0);
    if (what == "ftheta") {
      auto t = test::ftheta_fixture();
      FTheta f = FTheta::random(t.fc, 5 + env.rank, at::kFloat, at::kCPU);  // rank 0's weights must win
      FThetaTrainer tr(t.m, f, t.seqs, {t.seqs[1]}, ftheta_options(batch, steps, stop_after), dir + "/ck.safetensors");
      tr.distribute(dist);
      tr.resume();
      tr.run();
    } else if (what == "drafter") {
      auto s = test::drafter_fixture();
      auto d = test::random_drafter(s, 5 + env.rank);
      DrafterTrainer tr(*s.target, d, {s.seqs}, drafter_options(batch, steps, stop_after), dir + "/ck.safetensors");
      tr.distribute(dist);
      tr.resume();
      tr.run();
    } else {
      KAKEYA_FAIL("KAKEYA_TEST_WORKER='" << what << "': expected ftheta or drafter");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// ---------------------------------------------------------------- the tests

// What the ranks run, through the environment they inherit (set before any launcher thread starts).
struct WorkerEnv {
  WorkerEnv(const std::string& what, const std::string& dir, int64_t batch, int64_t steps, int64_t stop_after) {
    ::setenv("KAKEYA_TEST_WORKER", what.c_str(), 1);
    ::setenv("KAKEYA_TEST_DIR", dir.c_str(), 1);
    ::setenv("KAKEYA_TEST_BATCH", std::to_string(batch).c_str(), 1);
    ::setenv("KAKEYA_TEST_STEPS", std::to_string(steps).c_str(), 1);
    ::setenv("KAKEYA_TEST_STOP_AFTER", std::to_string(stop_after).c_str(), 1);
  }
  ~WorkerEnv() {
    for (const char* v : {"KAKEYA_TEST_WORKER", "KAKEYA_TEST_DIR", "KAKEYA_TEST_BATCH", "KAKEYA_TEST_STEPS",
                          "KAKEYA_TEST_STOP_AFTER"})
      ::unsetenv(v);
  }
};

LaunchOptions gloo_launch(int nproc, double timeout_s = 60, double grace_s = 60) {
  LaunchOptions lo;
  lo.nproc = nproc;
  lo.timeout_s = timeout_s;
  lo.grace_s = grace_s;
  lo.backend = "gloo";
  return lo;
}

LaunchResult launch_workers(const std::string& what, const std::string& dir, int nproc, int64_t batch, int64_t steps,
                            int64_t stop_after, double timeout_s = 60, double grace_s = 60) {
  WorkerEnv env(what, dir, batch, steps, stop_after);
  return launch(gloo_launch(nproc, timeout_s, grace_s), {self_exe()});
}

// A TCP port nothing listens on right now (the kernel's pick for a socket bound to port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  if (fd < 0 || ::bind(fd, (sockaddr*)&a, sizeof a) != 0 || ::getsockname(fd, (sockaddr*)&a, &n) != 0) return 0;
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string rank_stderr(const std::string& dir, int rank) { return slurp(dir + "/stderr." + std::to_string(rank)); }

using Weights = std::vector<std::pair<std::string, at::Tensor>>;

// Two checkpoints' parameters agree up to the order of floating-point sums: per tensor, the
// difference is under 1e-3 of how far training moved it from `init` (a reduction-order change
// in a gradient reaches the weights through AdamW's normalisation, so an absolute bound would
// say nothing about whether the runs did the same training). The step counts are equal.
void expect_same_weights(const std::string& a, const std::string& b, const Weights& init, const std::string& what) {
  TensorStore sa = TensorStore::open_file(a), sb = TensorStore::open_file(b);
  EXPECT_EQ(nlohmann::json::parse(sa.metadata()["state"])["step"], nlohmann::json::parse(sb.metadata()["state"])["step"])
      << what;
  ASSERT_FALSE(init.empty());
  for (const auto& [name, w0] : init) {
    at::Tensor x = sa.get("param/" + name).to(at::kDouble), y = sb.get("param/" + name).to(at::kDouble);
    const double diff = (x - y).norm().item<double>(), moved = (x - w0.to(at::kDouble)).norm().item<double>();
    EXPECT_GT(moved, 0) << what << ": " << name << " did not train";
    EXPECT_LE(diff, 1e-3 * moved) << what << ": " << name << " differs by " << diff << " (L2), training moved it "
                                  << moved;
  }
}

Weights snapshot(const Weights& named) {
  Weights out;
  for (const auto& [n, p] : named) out.emplace_back(n, p.detach().clone());
  return out;
}

// The one-process f_θ run the ranks are compared with (the workers' init seed for rank 0).
struct OneProcessFTheta {
  test::FThetaFixture t = test::ftheta_fixture();
  FTheta f = FTheta::random(t.fc, 5, at::kFloat, at::kCPU);
  Weights init = snapshot(f.named_parameters());
  std::string path;
  FThetaTrainer tr;
  OneProcessFTheta(const std::string& dir, const FThetaTrainOptions& o)
      : path(dir + "/one.safetensors"), tr(t.m, f, t.seqs, {t.seqs[1]}, o, path) {}
};

TEST(Distributed, FThetaTwoRanksEqualOneProcessAndResumeOnOne) {
  const TempDir tmp("ftheta");
  const std::string& dir = tmp.path;
  // One process: 10 steps at batch 4, checkpointed at step 6 on the way.
  OneProcessFTheta base(dir, ftheta_options(4, 10, 6));
  auto& t = base.t;
  const std::string& one = base.path;
  const Weights& init = base.init;
  FThetaTrainer& ta = base.tr;
  EXPECT_FALSE(ta.run());
  // Two ranks: the same 6 steps (each rank 2 rows of every batch).
  LaunchResult r = launch_workers("ftheta", dir, 2, 4, 10, 6);
  ASSERT_EQ(r.exit_code, 0) << r.failure << "\n" << rank_stderr(dir, 0) << rank_stderr(dir, 1);
  expect_same_weights(one, dir + "/ck.safetensors", init, "2 ranks vs 1 process at step 6");
  // The 2-rank checkpoint resumed by one process; the first run continued: both end at step 10.
  EXPECT_TRUE(ta.run());
  FTheta b = FTheta::random(t.fc, 9, at::kFloat, at::kCPU);
  FThetaTrainer tb(t.m, b, t.seqs, {t.seqs[1]}, ftheta_options(4, 10, 0), dir + "/ck.safetensors");
  ASSERT_TRUE(tb.resume());
  EXPECT_TRUE(tb.run());
  expect_same_weights(one, dir + "/ck.safetensors", init, "resumed on 1 rank vs 1 process at step 10");
  // Held-out evaluation is split over the ranks (rank 1 has no held-out sequence here): the
  // 2-rank run's held-out losses are the one-process ones.
  auto evals = [](const std::string& p) {
    return nlohmann::json::parse(TensorStore::open_file(p).metadata()["state"])["evals"];
  };
  auto ea = evals(one), eb = evals(dir + "/ck.safetensors");
  ASSERT_EQ(ea.size(), eb.size());
  for (size_t i = 0; i < ea.size(); ++i)
    EXPECT_NEAR(ea[i]["loss"].get<double>(), eb[i]["loss"].get<double>(), 1e-4 * std::abs(ea[i]["loss"].get<double>()))
        << "evaluation " << i;
}

TEST(Distributed, DrafterTwoRanksEqualOneProcess) {
  const TempDir tmp("drafter");
  const std::string& dir = tmp.path;
  auto s = test::drafter_fixture();
  const std::string one = dir + "/one.safetensors";
  auto d = test::random_drafter(s, 5);
  const Weights init = snapshot(d.named_parameters());
  DrafterTrainer ta(*s.target, d, {s.seqs}, drafter_options(8, 6, 0), one);
  EXPECT_TRUE(ta.run());
  LaunchResult r = launch_workers("drafter", dir, 2, 8, 6, 0);
  ASSERT_EQ(r.exit_code, 0) << r.failure << "\n" << rank_stderr(dir, 0) << rank_stderr(dir, 1);
  expect_same_weights(one, dir + "/ck.safetensors", init, "drafter: 2 ranks vs 1 process");
}

// Two launchers, as on two hosts (here both on the loopback): node 0 hosts the store, each
// starts one rank; the job equals one process at the same global batch.
TEST(Distributed, TwoNodesEqualOneProcess) {
  const TempDir tmp("nodes");
  const std::string& dir = tmp.path;
  OneProcessFTheta base(dir, ftheta_options(4, 5, 0));
  EXPECT_TRUE(base.tr.run());
  const int port = free_port();
  ASSERT_GT(port, 0);
  WorkerEnv env("ftheta", dir, 4, 5, 0);
  auto node = [&](int k) {
    LaunchOptions lo = gloo_launch(1);
    lo.nnodes = 2;
    lo.node_rank = k;
    lo.port = port;
    return std::async(std::launch::async, [lo] { return launch(lo, {self_exe()}); });
  };
  auto n0 = node(0), n1 = node(1);
  LaunchResult r0 = n0.get(), r1 = n1.get();
  ASSERT_EQ(r0.exit_code, 0) << r0.failure << "\n" << rank_stderr(dir, 0) << rank_stderr(dir, 1);
  ASSERT_EQ(r1.exit_code, 0) << r1.failure << "\n" << rank_stderr(dir, 0) << rank_stderr(dir, 1);
  expect_same_weights(base.path, dir + "/ck.safetensors", base.init, "2 nodes x 1 rank vs 1 process");
  LaunchOptions bad = gloo_launch(1);
  bad.nnodes = 2;
  test::expect_error([&] { launch(bad, {self_exe()}); }, "give every node the same --port");
  bad.port = port;
  bad.node_rank = 2;
  test::expect_error([&] { launch(bad, {self_exe()}); }, "--node-rank 2: expected 0 .. 1");
}

TEST(Distributed, KilledRankIsNamedByTheOtherWithinTheTimeout) {
  const TempDir tmp("kill");
  const std::string& dir = tmp.path;
  const double timeout_s = 30, grace_s = 120;
  auto t0 = std::chrono::steady_clock::now();
  auto fut = std::async(std::launch::async, [&] { return launch_workers("ftheta", dir, 2, 4, 1000000, 0, timeout_s, grace_s); });
  // Both ranks joined the group: let them train a moment, then kill rank 1.
  const std::string pid1 = dir + "/pid.1";
  for (int i = 0; i < 1200 && !(fs::exists(dir + "/pid.0") && fs::exists(pid1)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(fs::exists(pid1)) << "rank 1 never joined:\n" << rank_stderr(dir, 0) << rank_stderr(dir, 1);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const pid_t victim = (pid_t)std::stol(slurp(pid1));
  auto t_kill = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(fut.wait_for(std::chrono::seconds((int)(timeout_s + 30))), std::future_status::ready)
      << "the surviving rank did not exit";
  LaunchResult r = fut.get();
  const double after_kill = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_kill).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.failure.find("rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9"), std::string::npos)
      << r.failure;
  // Rank 0 stopped by itself (the launcher's grace period had not ended) and said why.
  EXPECT_LT(after_kill, grace_s) << "rank 0 was terminated by the launcher, not by its own error";
  EXPECT_LT(after_kill, timeout_s + 10);
  const std::string err0 = rank_stderr(dir, 0);
  EXPECT_NE(err0.find("error: rank 0 of 2:"), std::string::npos) << err0;
  EXPECT_NE(err0.find("rank 1 (pid " + std::to_string(victim) + ")"), std::string::npos) << err0;
  (void)t0;
}

TEST(Distributed, BatchThatDoesNotSplitIsRefused) {
  const TempDir tmp("split");
  const std::string& dir = tmp.path;
  LaunchResult r = launch_workers("ftheta", dir, 2, 3, 4, 0);
  EXPECT_NE(r.exit_code, 0);
  const std::string err = rank_stderr(dir, 0) + rank_stderr(dir, 1);
  EXPECT_NE(err.find("--batch 3 does not split over 2 ranks"), std::string::npos) << err;
}

TEST(Distributed, MalformedLauncherVariablesAreNamed) {
  auto with = [](const char* name, const char* value, const std::string& needle) {
    ::setenv(name, value, 1);
    test::expect_error([] { dist_env_from_environment(); }, needle);
    ::unsetenv(name);
  };
  with("KAKEYA_WORLD_SIZE", "two", "KAKEYA_WORLD_SIZE='two': expected an integer");
  ::setenv("KAKEYA_MASTER_PORT", "29999", 1);
  ::setenv("KAKEYA_WORLD_SIZE", "2", 1);
  with("KAKEYA_RANK", "2", "KAKEYA_RANK=2: expected 0 .. 1");
  with("KAKEYA_DIST_BACKEND", "mpi", "expected auto, gloo or nccl");
  ::unsetenv("KAKEYA_MASTER_PORT");
  with("KAKEYA_RANK", "0", "without KAKEYA_MASTER_PORT: start ranks with `kakeya launch`");
  ::unsetenv("KAKEYA_WORLD_SIZE");
  // No launcher: one process, collectives are the identity.
  Dist one(dist_env_from_environment(), at::kCPU);
  EXPECT_EQ(one.world(), 1);
  EXPECT_EQ(one.backend(), "none");
  std::vector<at::Tensor> g{at::ones({3})};
  one.all_reduce_sum(g, "nothing");
  EXPECT_TRUE(at::equal(g[0], at::ones({3})));
  test::expect_error([] { launch(LaunchOptions{}, {"/nonexistent/kakeya"}); }, "/nonexistent/kakeya is not an executable");
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* w = std::getenv("KAKEYA_TEST_WORKER")) return run_worker(w);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
