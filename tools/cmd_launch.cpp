// kakeya launch: a training subcommand (or capture) as N data-parallel ranks on this host (train/launch.h).
//   kakeya launch --nproc 2 -- train-ftheta --online corpus --drafter d --save out --batch 8
// Ranks use Gloo on the CPU and NCCL on CUDA (rank r on GPU r modulo the GPUs present);
// --backend gloo lets several ranks share one GPU. Several hosts: one launcher per host with
// the same --nnodes, --master-addr and --port, and --node-rank 0 .. nnodes-1.
#include <unistd.h>

#include <climits>
#include <cstdio>

#include "core/error.h"
#include "tools/cli_common.h"
#include "train/launch.h"

namespace kakeya::cli {

void register_launch(CLI::App& app) {
  auto o = std::make_shared<train::LaunchOptions>();
  auto cmd = std::make_shared<std::vector<std::string>>();
  auto* c = app.add_subcommand("launch", "Run train-ftheta, train-drafter or capture as N data-parallel ranks (c10d)");
  c->add_option("--nproc", o->nproc, "number of ranks (processes) on this host")->capture_default_str();
  c->add_option("--nnodes", o->nnodes, "hosts in the job (one launcher per host)")->capture_default_str();
  c->add_option("--node-rank", o->node_rank, "this host's index (0 hosts the rendezvous store)")->capture_default_str();
  c->add_option("--master-addr", o->master_addr, "node 0's address (several nodes)")->capture_default_str();
  c->add_option("--port", o->port, "rendezvous store port (0: a free one; the same on every node)")->capture_default_str();
  c->add_option("--timeout", o->timeout_s, "seconds a rank waits for the others in a collective")->capture_default_str();
  c->add_option("--backend", o->backend, "auto (NCCL on CUDA, Gloo on CPU) | gloo | nccl")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  c->add_option("--grace", o->grace_s, "after a rank fails, seconds before the others are terminated")
      ->capture_default_str();
  c->add_option("command", *cmd, "the subcommand and its flags (after --)");
  c->prefix_command();  // without --: everything from the subcommand's name on is left unparsed
  c->footer("Example: kakeya launch --nproc 2 -- train-ftheta --online CORPUS --drafter D --save OUT --batch 8");
  c->callback([o, c, cmd] {
    std::vector<std::string> argv = *cmd;
    for (const auto& a : c->remaining()) argv.push_back(a);
    KAKEYA_CHECK(!argv.empty(), "launch: no subcommand (kakeya launch --nproc N -- train-ftheta ...)");
    KAKEYA_CHECK(argv[0] == "train-ftheta" || argv[0] == "train-drafter" || argv[0] == "capture",
                 "launch: '" << argv[0] << "' does not run data-parallel (expected train-ftheta, train-drafter or capture)");
    char exe[PATH_MAX] = {0};
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    KAKEYA_CHECK(n > 0, "launch: cannot find this executable (/proc/self/exe)");
    argv.insert(argv.begin(), std::string(exe, n));
    const train::LaunchResult r = train::launch(*o, argv);
    KAKEYA_CHECK(r.exit_code == 0, "launch: " << r.failure);
  });
}

}  // namespace kakeya::cli
