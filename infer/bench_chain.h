// `kakeya bench chain`: what one dependent launch costs inside a replayed decode step.
//
// A batch-1 decode step of a small model is a chain of ~130 launches, each reading what the one
// before wrote, and its speed is that chain's length times a link's cost, not its bytes over the
// bandwidth. This measures a link: chains of one kind of the step's own kernels (Gemma 3 270M's
// sizes by default), each link reading the link before's output, captured in one CUDA graph and
// replayed, both as kernels (with programmatic dependent launch, as the step runs them) and as
// one persistent kernel's program (ops::StepProgram). A link's cost is the marginal one: the time
// of a chain of 2·links launches less that of `links`, over `links`, so the graph's own launch
// drops out. The two strategies' final outputs must agree bit for bit (the program runs the
// kernels' own bodies), or the bench throws.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace kakeya {

struct BenchChainOptions {
  at::Device device{at::kCUDA, 0};
  int64_t hidden = 640;         // the row a link reads and writes (Gemma 3 270M's hidden size)
  int64_t intermediate = 2048;  // the MLP chain's inner size (Gemma 3 270M's)
  int64_t qkv = 1536;           // rows of the q/k/v projection (Gemma 3 270M's: 4 + 1 + 1 heads of 256)
  int64_t vocab = 262144;       // rows of the greedy head's chains (Gemma 3's vocabulary)
  int64_t links = 256;          // launches of the shorter chain (the longer has twice as many)
  int64_t repeats = 20;         // timed replays of each chain (the median counts)
};

// {"device_name", "hidden", "intermediate", "qkv", "vocab", "links", "repeats", "chains": [{"chain", "what",
//   "launches_per_link", "kernels_us_per_link", "persistent_us_per_link", "persistent_step", "outputs_equal"}]}
// in bf16. The head's chains run as kernels only (no persistent fields; "head-screen" adds
// "rows_summed_per_link"). Throws naming the option at fault (not a CUDA device, a CPU-only build,
// sizes out of range, --qkv or --intermediate below --hidden: a link's next row is the first H values
// of its output).
nlohmann::json bench_chain(const BenchChainOptions& o);
std::string bench_chain_table(const nlohmann::json& report);  // aligned text table

}  // namespace kakeya
