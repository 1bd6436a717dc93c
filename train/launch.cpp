#include "train/launch.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "train/dist.h"

extern char** environ;

namespace kakeya::train {

namespace {

volatile std::sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

std::string describe(int status) {
  if (status == -1) return "ended with an unknown status";
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "ended with wait status " + std::to_string(status);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

LaunchResult launch(const LaunchOptions& opt, const std::vector<std::string>& argv) {
  KAKEYA_CHECK(opt.nproc >= 1, "launch --nproc " << opt.nproc << ": expected >= 1");
  KAKEYA_CHECK(opt.timeout_s > 0, "launch --timeout " << opt.timeout_s << ": expected seconds > 0");
  KAKEYA_CHECK(!argv.empty(), "launch: no command to run (kakeya launch --nproc N -- train-ftheta ...)");
  KAKEYA_CHECK(::access(argv[0].c_str(), X_OK) == 0, "launch: " << argv[0] << " is not an executable file");
  KAKEYA_CHECK(opt.nnodes >= 1 && opt.node_rank >= 0 && opt.node_rank < opt.nnodes,
               "launch --node-rank " << opt.node_rank << ": expected 0 .. " << opt.nnodes - 1 << " (--nnodes "
                                     << opt.nnodes << ")");
  KAKEYA_CHECK(opt.nnodes == 1 || opt.port > 0,
               "launch --nnodes " << opt.nnodes << ": give every node the same --port (node 0 hosts the store there)");

  const bool host = opt.node_rank == 0;
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions so;
    so.port = (uint16_t)opt.port;
    so.isServer = host;
    so.waitWorkers = false;
    so.timeout = std::chrono::milliseconds((int64_t)(opt.timeout_s * 1000));
    store = c10::make_intrusive<c10d::TCPStore>(host ? "127.0.0.1" : opt.master_addr, so);
  } catch (const std::exception& e) {
    if (host) KAKEYA_FAIL("launch: cannot host the rendezvous store on port " << opt.port << " (--port): " << e.what());
    KAKEYA_FAIL("launch --node-rank " << opt.node_rank << ": cannot reach node 0's store at " << opt.master_addr << ":"
                                      << opt.port << " (--master-addr, --port): " << e.what());
  }
  DistEnv env;
  env.world = opt.nproc * opt.nnodes;
  env.addr = opt.nnodes > 1 ? opt.master_addr : "127.0.0.1";
  env.port = store->getPort();
  env.timeout_s = opt.timeout_s;
  env.backend = opt.backend;

  // The ranks inherit this environment minus the launcher's own variables (an enclosing
  // launch's values must not leak into these ranks).
  std::vector<std::string> ours;
  for (const auto& v : dist_env_variables(env)) ours.push_back(v.substr(0, v.find('=') + 1));  // "NAME="
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    bool mine = false;
    for (const auto& name : ours) mine = mine || std::strncmp(*e, name.c_str(), name.size()) == 0;
    if (!mine) base.push_back(*e);
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  auto prev_int = std::signal(SIGINT, on_signal);
  auto prev_term = std::signal(SIGTERM, on_signal);
  g_signal = 0;
  std::vector<pid_t> pids;
  for (int r = 0; r < opt.nproc; ++r) {
    env.rank = opt.node_rank * opt.nproc + r;
    env.local_rank = r;
    std::vector<std::string> vars = base;
    for (auto& v : dist_env_variables(env)) vars.push_back(v);
    std::vector<char*> envp;
    for (auto& v : vars) envp.push_back(const_cast<char*>(v.c_str()));
    envp.push_back(nullptr);
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, argv[0].c_str(), nullptr, nullptr, args.data(), envp.data());
    if (rc != 0) {
      for (pid_t p : pids) ::kill(p, SIGTERM);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      std::signal(SIGINT, prev_int);
      std::signal(SIGTERM, prev_term);
      KAKEYA_FAIL("launch: cannot start rank " << r << " (" << argv[0] << "): " << std::strerror(rc));
    }
    pids.push_back(pid);
    std::fprintf(stderr, "[launch] rank %d of %d: pid %d (store port %d)\n", env.rank, env.world, (int)pid, env.port);
  }

  // Supervise: reap ranks as they end; after the first abnormal exit, give the others the
  // grace period (their collectives fail and name it), then terminate what is left.
  std::vector<bool> running(pids.size(), true);
  int left = opt.nproc;
  LaunchResult result;
  bool failed = false, termed = false, killed = false;
  double term_at = -1, kill_at = -1;
  auto signal_running = [&](int sig) {
    for (size_t r = 0; r < pids.size(); ++r)
      if (running[r]) ::kill(pids[r], sig);
  };
  while (left > 0) {
    int status = 0;
    // Only this launcher's ranks: waitpid(-1) would reap other children of the process.
    pid_t p = 0;
    int r = 0;
    for (; r < (int)pids.size(); ++r)
      if (running[r] && (p = ::waitpid(pids[r], &status, WNOHANG)) != 0) break;
    if (p != 0) {
      if (p < 0) status = -1;  // no longer our child (reaped by someone else): its status is unknown
      p = pids[r];
      running[r] = false;
      --left;
      if (status == 0) continue;
      const int global = opt.node_rank * opt.nproc + r;
      const std::string what = "rank " + std::to_string(global) + " (pid " + std::to_string(p) + ") " + describe(status);
      if (failed) {
        std::fprintf(stderr, "[launch] %s\n", what.c_str());
        continue;
      }
      failed = true;
      result.exit_code = exit_code(status);
      result.failure = what;
      try {
        // The first failure of the whole job stays (another node's launcher may have recorded one).
        store->compareSet(kDistFailedKey, {}, std::vector<uint8_t>(what.begin(), what.end()));
      } catch (const std::exception&) {
        // The store is this process's own server; if even that fails, stderr still says it.
      }
      std::fprintf(stderr, "[launch] %s; the other ranks get %.0f s to stop\n", what.c_str(), opt.grace_s);
      if (term_at < 0) term_at = seconds() + opt.grace_s;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (g_signal != 0 && term_at < 0) {
      if (result.exit_code == 0) {
        result.exit_code = 128 + g_signal;
        result.failure = std::string("the launcher was interrupted (") + strsignal(g_signal) + ")";
      }
      term_at = seconds();
    }
    // SIGTERM first (checkpoints are written atomically, so none is left half-written), SIGKILL 10 s later.
    if (!termed && term_at >= 0 && seconds() >= term_at) {
      signal_running(SIGTERM);
      termed = true;
      kill_at = seconds() + 10;
    }
    if (termed && !killed && seconds() >= kill_at) {
      signal_running(SIGKILL);
      killed = true;
    }
  }
  std::signal(SIGINT, prev_int);
  std::signal(SIGTERM, prev_term);
  // Several nodes: the store lives in node 0's launcher, and other nodes' ranks may still need it.
  if (opt.nnodes > 1) {
    try {
      store->add("kakeya/nodes_done", 1);
      if (host) {
        const double until = seconds() + opt.timeout_s;
        while (store->add("kakeya/nodes_done", 0) < opt.nnodes && seconds() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    } catch (const std::exception&) {
      // Node 0's store is gone: nothing left to wait for.
    }
  }
  if (result.exit_code == 0) std::fprintf(stderr, "[launch] all %d ranks of this node finished\n", opt.nproc);
  return result;
}

}  // namespace kakeya::train
