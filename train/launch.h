// `kakeya launch`: runs one program as N ranks of a data-parallel job on this host, or as this
// host's N ranks of a job over several hosts (one launcher per host, --nnodes/--node-rank). The
// launcher of node 0 hosts the rendezvous store (a c10d TCPStore), so the store outlives any
// rank; each rank gets its global rank, the world size and the store's address through the
// environment (train/dist.h reads them). Each launcher watches its ranks: the first one that
// exits abnormally is recorded in the store (every other rank's failing collective, on any
// host, then names it) and printed; its ranks still running after the grace period are
// terminated. Ctrl-C stops every rank. Node 0's launcher keeps the store up until every node
// has reported its ranks done (or the timeout passes).
#pragma once
#include <string>
#include <vector>

namespace kakeya::train {

struct LaunchOptions {
  int nproc = 1;                // ranks on this host
  int nnodes = 1, node_rank = 0;  // hosts in the job, and which one this is (0 hosts the store)
  std::string master_addr = "127.0.0.1";  // node 0's address (for nodes > 0 and every rank)
  int port = 0;                 // store port (0: a free one; required with several nodes)
  double timeout_s = 300;       // collectives and rendezvous, handed to the ranks
  std::string backend = "auto"; // auto | gloo | nccl
  double grace_s = 30;          // after a rank fails, how long the others get to exit by themselves
};

struct LaunchResult {
  int exit_code = 0;    // 0 when every rank exited 0; else the first failed rank's (128 + signal if killed)
  std::string failure;  // "rank 1 (pid 4242) was killed by signal 9 (Killed)"; empty on success
};

// Runs `argv` (argv[0] an executable path; the rest its arguments) as opt.nproc ranks and
// waits for all of them. Progress and failures also go to stderr.
LaunchResult launch(const LaunchOptions& opt, const std::vector<std::string>& argv);

}  // namespace kakeya::train
